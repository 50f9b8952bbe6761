"""Several processes through ``torch.distributed`` (launched by ``torchrun`` or ``accelerate launch``).

The launcher sets ``WORLD_SIZE``/``RANK``/``LOCAL_RANK``; ``init`` joins the process group
(NCCL on GPUs, gloo on CPUs) and gives each process its GPU. Calibration splits its batches
over the processes and sums the statistics (``reduced``), fine-tuning wraps the model in
accelerate's DDP/FSDP, and evaluation splits its windows or lm-eval requests. In a plain process
every helper here is a no-op: one process, rank 0.
"""

from __future__ import annotations

import os
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist


def launched() -> bool:
    """Whether a launcher started several processes."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def local_rank() -> int:
    """This process's index on its machine (0 in a plain process)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def local_processes() -> int:
    """How many processes of the launch run on this machine (1 in a plain process)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def gpu_per_process() -> bool:
    """Whether every process on this machine can have a GPU of its own (in a plain process:
    whether there is a GPU). The same answer in every process, so all choose one backend."""
    return torch.cuda.is_available() and torch.cuda.device_count() >= local_processes()


def init() -> None:
    """Join the launcher's process group (once); each process takes its own GPU where there
    are enough. Collectives on CPU tensors (``model.device: cpu`` on a GPU machine) go
    through gloo, on CUDA tensors through NCCL."""
    if launched() and not dist.is_initialized():
        if gpu_per_process():
            torch.cuda.set_device(local_rank())
            dist.init_process_group("cpu:gloo,cuda:nccl")
        else:
            dist.init_process_group("gloo")


def world() -> tuple[int, int]:
    """(rank, number of processes); (0, 1) in a plain process."""
    return (dist.get_rank(), dist.get_world_size()) if dist.is_available() and dist.is_initialized() else (0, 1)


def is_main() -> bool:
    """Rank 0: the process that writes files and reports."""
    return world()[0] == 0


def barrier() -> None:
    """Wait for every process (nothing to wait for in a plain process)."""
    if world()[1] > 1:
        dist.barrier()


def reduced(t: torch.Tensor) -> torch.Tensor:
    """``t`` summed over all processes, in place (itself in a plain process)."""
    if world()[1] > 1:
        dist.all_reduce(t)
    return t


@contextmanager
def shared_atomic_dir(target: Path) -> Iterator[Path]:
    """``storage.atomic_dir`` for every process of a launch: rank 0 makes the temporary folder
    (and swaps it in at the end), the others write into the same one."""
    from .files import atomic_dir

    rank, size = world()
    if size == 1:
        with atomic_dir(target) as tmp:
            yield tmp
        return
    with atomic_dir(target) if rank == 0 else nullcontext() as tmp:
        box = [str(tmp) if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        yield Path(box[0])
        dist.barrier()  # every rank is done with it before rank 0 renames it
