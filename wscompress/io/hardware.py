"""Facts of the machine a run is on: the CPU's features, bfloat16 in hardware, the device a process computes on."""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from ..errors import UsageError
from . import distributed


def resolve_device(device: str) -> torch.device:
    """The recipe's device; under a launcher, ``auto``/``cuda`` mean this process's own GPU
    (``auto``: the CPU when the launch has more processes on this machine than GPUs)."""
    if device in ("auto", "cuda") and distributed.gpu_per_process():
        return torch.device("cuda", distributed.local_rank())
    if device == "auto":
        return torch.device("cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError(f"model.device is {device!r} but no CUDA device is available", "set model.device: auto or cpu")
    if device.startswith("cuda") and not distributed.gpu_per_process():
        gpus, processes = torch.cuda.device_count(), distributed.local_processes()
        raise UsageError(f"model.device is {device!r} but the launch runs {processes} processes on this machine and "
                         f"only {gpus} GPU{' is' if gpus == 1 else 's are'} visible",
                         f"start one process per GPU (torchrun --nproc_per_node {gpus}) or set model.device: cpu")
    return torch.device(device)


def _cpuinfo(*keys: str) -> str | None:
    """The value of the first /proc/cpuinfo line named one of ``keys`` (None where there is no
    such line or file). Read once per caller: the file's clock readings change."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return None
    return next((value.strip() for key, _, value in (line.partition(":") for line in lines) if key.strip() in keys), None)


@functools.cache
def cpu_vendor() -> str:
    """The CPU's vendor as /proc/cpuinfo names it (GenuineIntel, AuthenticAMD; "" where unknown)."""
    return _cpuinfo("vendor_id") or ""


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (the ``flags`` line of /proc/cpuinfo, ``Features`` on ARM; none
    where there is no such file). Nothing else of the file: its clock readings change."""
    return frozenset((_cpuinfo("flags", "Features") or "").split())


@functools.cache
def cpu_name() -> str:
    """The CPU's model name, for benchmark tables ("unknown CPU" where /proc/cpuinfo has none)."""
    return _cpuinfo("model name") or "unknown CPU"


def vector_flags() -> str:
    """The CPU's vector flags (AVX*, FMA, F16C, AMX) in one line, for benchmark tables."""
    return " ".join(sorted(f for f in cpu_flags() if f.startswith(("avx", "fma", "f16c", "amx"))))


@functools.cache
def native_bfloat16(device: torch.device) -> bool:
    """Whether ``device`` multiplies bfloat16 in hardware: a GPU that has it, or a CPU with
    AVX-512 BF16 or AMX that oneDNN uses (elsewhere bfloat16 is emulated, slower than float32)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported(including_emulation=False)
    if device.type != "cpu" or not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return False
    return not cpu_flags().isdisjoint({"avx512_bf16", "amx_bf16"})
