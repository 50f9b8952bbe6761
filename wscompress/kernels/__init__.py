"""Compiled CPU kernels: look-up-table matmul for palettized weights (``lut.cpp``), dense
products for decoding (``lowrank.cpp``: fused low-rank factors, float16 and int8 weights), k-means' nearest-centroid search and
seeding (``kmeans.cpp``), the trellis code's Viterbi search (``trellis.cpp``), and for calibration's bfloat16 passes with
AVX-512 BF16 the Gram matrices and cross products (``products.cpp``) and a one-pass RMSNorm
(``norms.cpp``); on CUDA, the look-up-table product for
decoding in Triton (``lut_triton.py``), used where Triton is installed (CUDA builds of torch
bring it).

``make install`` builds them (``python -m wscompress.kernels.build``) with torch's C++ extension
tools into ``<cache>/kernels/torch-<version>-<where>-<cpu>/<name>``; later processes load the built libraries. Where
they cannot be built or loaded (no compiler, an unusual platform) or ``WSCOMPRESS_KERNELS=0``,
the loaders (``lut()``, ``lowrank()``, ``kmeans()``, ...) return None, ``status()`` says why, and layers use
their pure-torch path (calibration the BLAS and the models' own norms), which gives the same
results. A Triton kernel that fails to compile on a GPU is
reported once and the torch path takes over.
"""

from __future__ import annotations

import hashlib
import os
import warnings
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from ..model.forms import wscompress_format, wscompress_palettized, wscompress_trellis
from ..model.forms.wscompress_format import DECODE_ROWS
from ..model.forms.wscompress_palettized import SparseRows

HERE = Path(__file__).parent


def _disabled() -> bool:
    return os.environ.get("WSCOMPRESS_KERNELS", "1") == "0"


# Kernels registered as PyTorch operators (torch.ops.wscompress.*), which a compiled graph calls
# like any aten op; the others are plain Python modules (calibration's, never inside a graph).
OPERATORS = {"lut": ("lut_linear", "lut_linear_q8", "lut_linear_i8", "lut_linear_bf16", "lut_dense", "lut_dense_q8"),
             "lowrank": ("lowrank_linear",), "trellis": ("trellis_viterbi", "trellis_linear", "trellis_dense")}


# Intel's AVX-512 gathers fetch a palettized row's pairs of weights in one instruction, 1.2-1.3x
# faster than eight loads there (docs/runtime.md); AMD's were slower than the dense product
GATHER = {"GenuineIntel": ["-DWSCOMPRESS_GATHER_PAIRS"]}


@cache
def _load(source: str) -> tuple[ModuleType | None, str]:
    if _disabled():
        return None, "disabled by WSCOMPRESS_KERNELS=0"
    from ..io.files import cache_dir
    from ..io.hardware import cpu_flags, cpu_vendor

    build = cache_dir() / "kernels" / _build_folder() / source
    build.mkdir(parents=True, exist_ok=True)
    try:
        from torch.utils.cpp_extension import load

        with build_lock(build):
            module = load(name=f"wscompress_{source}", sources=[str(_staged(HERE / f"{source}.cpp", build))],
                          build_directory=str(build), verbose=False,
                          extra_cflags=["-O3", f"-march={_march()}", "-fopenmp", *GATHER.get(cpu_vendor(), [])],
                          extra_ldflags=["-fopenmp"], is_python_module=source not in OPERATORS)
        if source in OPERATORS:
            module = torch.ops.wscompress
            _shape_rules(source)
    except Exception as err:  # noqa: BLE001 - any build or load failure means: use the torch path
        return None, f"not built ({_why(err)})"
    flags = cpu_flags()
    isa = 'AVX-512' if 'avx512f' in flags else 'AVX2' if 'avx2' in flags else 'scalar'
    return module, f"{source}.cpp ({isa if _march() == 'native' else f'-march={_march()}'})"


@contextmanager
def build_lock(build: Path) -> Iterator[None]:
    """Hold ``build`` for one process while torch builds or loads its library there.

    torch's own lock is a file (``<build>/lock``) that its builder deletes when done and every
    other process waits on, forever, while it exists: a build killed by SIGTERM or SIGKILL
    left it behind and each later run slept at start. This lock is the operating system's
    (``flock``), released when its holder ends however it ends; whoever holds it is the only
    wscompress process in the folder, so a ``lock`` file found then is a dead builder's and is
    removed. (Where ``fcntl`` is missing, Windows, torch's lock alone applies.)"""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(build / "wscompress.lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        try:
            (build / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)


def _march() -> str:
    """The CPU the kernels are compiled for: this one, or ``WSCOMPRESS_MARCH``, a CPU with AVX2 at
    least (e.g. ``haswell`` for AVX2 only, to test or time another machine's path on this one)."""
    return os.environ.get("WSCOMPRESS_MARCH", "native")


def _shape_rules(source: str) -> None:
    """What each operator returns, by shape alone (torch.compile traces with these)."""
    if source == "lut":
        torch.library.register_fake("wscompress::lut_linear")(
            lambda x, idx, tables, width, group_size, out, row_ptr, pos, delta: x.new_empty(x.shape[0], out))
        torch.library.register_fake("wscompress::lut_linear_q8")(
            lambda x, idx, tables, scales, width, group_size, out, row_ptr, pos, delta, row_scale=None:
            x.new_empty(x.shape[0], out))
        torch.library.register_fake("wscompress::lut_dense")(
            lambda idx, tables, width, group_size, out, in_features, row_ptr, pos, delta: tables.new_empty(out, in_features))
        torch.library.register_fake("wscompress::lut_linear_i8")(
            lambda x, idx, tables, scales, width, group_size, out, row_ptr, pos, delta: x.new_empty(x.shape[0], out))
        torch.library.register_fake("wscompress::lut_linear_bf16")(
            lambda x, idx, tables, scales, width, group_size, out, row_ptr, pos, delta: x.new_empty(x.shape[0], out))
        torch.library.register_fake("wscompress::lut_dense_q8")(
            lambda idx, tables, scales, width, group_size, out, in_features: tables.new_empty(2 * out, in_features))
    elif source == "trellis":
        torch.library.register_fake("wscompress::trellis_viterbi")(lambda w, h, values, bits: w.new_empty(w.shape, dtype=torch.int32))
        torch.library.register_fake("wscompress::trellis_linear")(
            lambda x, stream, scale, bits, state_bits: x.new_empty(x.shape[0], stream.shape[0] * 16))
        torch.library.register_fake("wscompress::trellis_dense")(
            lambda stream, scale, bits, state_bits: scale.new_empty(stream.shape[0] * 16, stream.shape[1] * 16,
                                                                    dtype=torch.float32))
    else:
        torch.library.register_fake("wscompress::lowrank_linear")(
            lambda x, basis, coeff, bias: x.new_empty(*x.shape[:-1], coeff.shape[0]))
        torch.library.register_fake("wscompress::half_linear")(
            lambda x, w, bias: x.new_empty(*x.shape[:-1], w.shape[0]))
        torch.library.register_fake("wscompress::int8_linear")(
            lambda x, q, s, bias: x.new_empty(*x.shape[:-1], q.shape[0]))


def _build_folder() -> str:
    """A folder name for this torch installation on this CPU: torch's version, where it lives
    and the CPU's instruction set. The compile command names torch's headers by path, so two
    environments (a CI clone's virtual environment beside a working copy's) sharing one build
    folder rebuilt each other's library, ~27 s, whenever they took turns; and the libraries are
    built for the CPU at hand (``-march=native``), so one built on an AVX-512 machine would
    crash with an illegal instruction on another sharing the cache (a cluster's home folder)."""
    from ..io.hardware import cpu_flags

    where = hashlib.sha1(torch_folder().encode()).hexdigest()[:10]
    cpu = hashlib.sha1(" ".join(sorted(cpu_flags())).encode()).hexdigest()[:8]
    return f"torch-{torch.__version__}-{where}-{cpu}" + ("" if _march() == "native" else f"-{_march()}")


def torch_folder() -> str:
    """torch's folder as its compile command names it: by its absolute path, symlinks kept
    (``torch.utils.cpp_extension`` takes its include paths from ``os.path.abspath``). Keyed by
    the resolved path instead, an environment that reaches torch through a symlink shared a
    build folder with the one that reaches it directly, and each rebuilt the other's library."""
    return os.path.dirname(os.path.abspath(torch.__file__))


def _staged(src: Path, build: Path) -> Path:
    """``src`` copied into the build folder, rewritten only when its text changed. The compile
    command names this copy, so checkouts and installs of the same source share one build; with
    each checkout's own path in the command, two of them (a CI clone beside a working copy)
    rebuilt each other's library, ~27 s, whenever they took turns."""
    copy, text = build / src.name, src.read_bytes()
    if not copy.exists() or copy.read_bytes() != text:
        tmp = copy.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(text)
        tmp.replace(copy)  # whole or not at all, for a process building beside this one
    return copy


def _why(err: Exception) -> str:
    """An error in one line, for ``status``."""
    return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"


def lut() -> ModuleType | None:
    """The compiled LUT module, or None when it is not available (see ``status``)."""
    return _load("lut")[0]


def lowrank() -> ModuleType | None:
    """The compiled low-rank module, or None when it is not available (see ``status``)."""
    return _load("lowrank")[0]


def kmeans() -> ModuleType | None:
    """The compiled k-means loops (nearest centroid, k-means++ seeding), or None when they are
    not available."""
    return _load("kmeans")[0]


def trellis() -> ModuleType | None:
    """The compiled trellis-code operators (the Viterbi search of ``maths.trellis``, decoding a
    ``TrellisLinear``), or None when they are not available."""
    return _load("trellis")[0]


def _bf16(source: str) -> tuple[ModuleType | None, str]:
    """A kernel that needs AVX-512 BF16, loaded (and built) only on a CPU that has it."""
    from ..io.hardware import cpu_flags

    if _march() != "native":  # another CPU's build: calibration keeps the BLAS rather than guess its flags
        return None, f"built for -march={_march()}"
    return _load(source) if "avx512_bf16" in cpu_flags() else (None, "this CPU has no AVX-512 BF16")


def products() -> ModuleType | None:
    """The compiled bfloat16 products, or None where they are not available (see
    ``calibration_status``)."""
    return _bf16("products")[0]


def norms() -> ModuleType | None:
    """The compiled bfloat16 RMSNorm, or None where it is not available."""
    return _bf16("norms")[0]


def calibration_status() -> str:
    """Which paths calibration's bfloat16 passes take, in words."""
    paths = []
    for source, fallback in (("products", "the BLAS"), ("norms", "the models' own norms")):
        module, why = _bf16(source)
        paths.append(f"{fallback} ({source}.cpp: {why})" if module is None else why.replace("AVX-512", "AVX-512 BF16"))
    return ", ".join(paths)


_norm_verdicts: dict[type, bool] = {}  # RMSNorm class -> whether norms.cpp reproduces its forward


def rms_norm_forward(module: nn.Module) -> Callable | None:
    """A one-pass forward for ``module`` if it looks like a LLaMA-style RMSNorm (a class named
    ``*RMSNorm`` with a 1-D weight and ``variance_epsilon`` or ``eps``), else None. It runs the
    kernel on bfloat16 CPU inputs without gradients and the module's own forward otherwise.
    The first call for each class runs both and keeps to the class's own forward for good if
    they differ by more than bfloat16 rounding (Gemma's ``1 + weight``, a norm in float32)."""
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    weight = getattr(module, "weight", None)
    if (not type(module).__name__.endswith("RMSNorm") or not isinstance(eps, float) or not isinstance(weight, torch.Tensor)
            or weight.dim() != 1 or "forward" in module.__dict__ or norms() is None):  # a forward set on it: a hook's
        return None
    own, kind = module.forward, type(module)

    def forward(x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        w = module.weight
        if (args or kwargs or _norm_verdicts.get(kind) is False or x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16
                or x.device.type != "cpu" or x.shape[-1] != w.numel()
                or torch.is_grad_enabled() and (x.requires_grad or w.requires_grad)):
            return own(x, *args, **kwargs)
        y = norms().rms_norm(x.contiguous(), w.contiguous(), eps)
        if kind not in _norm_verdicts:
            reference = own(x)
            _norm_verdicts[kind] = reference.dtype == y.dtype and torch.allclose(y.float(), reference.float(), rtol=2**-6, atol=0)
            return reference
        return y

    return forward


@cache
def _load_triton() -> tuple[ModuleType | None, str]:
    if _disabled():
        return None, "disabled by WSCOMPRESS_KERNELS=0"
    try:
        from . import lut_triton
    except ImportError as err:
        return None, f"no Triton ({err})"
    return lut_triton, "lut_triton.py (CUDA decoding)"


_gpu_failure: str | None = None  # why the Triton kernel stopped being used, once it failed


def lut_gpu() -> ModuleType | None:
    """The Triton LUT module, or None when it is not available or failed (see ``status``)."""
    return None if _gpu_failure else _load_triton()[0]


def status() -> str:
    """Which paths compressed layers use, in words (the CUDA one where a GPU is present)."""
    paths = [_load(source)[1] for source in ("lut", "lowrank")]
    if torch.cuda.is_available():
        paths.append(_gpu_failure or _load_triton()[1])
    return ", ".join(dict.fromkeys(paths))


_NO_OUTLIERS = SparseRows(*(torch.empty(0, dtype=t) for t in (torch.int64, torch.int32, torch.float16)))


def palettized_linear(x: torch.Tensor, indices: torch.Tensor, width: int, tables: torch.Tensor, group_size: int,
                      out_features: int, outliers: SparseRows | None = None,
                      rounded: tuple[torch.Tensor, torch.Tensor] | None = None,
                      scale: torch.Tensor | None = None) -> torch.Tensor | None:
    """x @ Wᵀ (no bias) for a palettized W whose row r reads ``tables[r // group_size]`` at its
    indices (``width`` 4: two per byte, low nibble first; 8: one per byte) plus the ``outliers``'
    corrections, times the row ``scale`` where given, or None where the kernel does not apply (gradients needed, kernels
    unavailable, on CPU not float32, on CUDA more than DECODE_ROWS rows: prefill is
    compute-bound, and cuBLAS on the weight decoded by torch wins there). Decoding on CPU
    multiplies 8-bit activations by the ``rounded`` tables (``wscompress_palettized.round_tables``)
    where they are given and the CPU has the instructions (``Q8``); prefill multiplies the same
    tables on AMX tiles where ``amx_prefill`` says, else in integers where ``integer_prefill``
    says, else the BLAS on the decoded weight."""
    if torch.is_grad_enabled() and (x.requires_grad or tables.requires_grad):
        return None
    if _triton_path(x):
        return _gpu_linear(x, indices, width, tables, group_size, out_features, outliers, scale)
    module = _compiled_ops() or lut()
    if module is None or x.device.type != "cpu" or x.dtype != torch.float32:
        return None
    flat = x.reshape(-1, x.shape[-1]).contiguous()
    sparse = outliers or _NO_OUTLIERS
    if flat.shape[0] > DECODE_ROWS and rounded is not None and amx_prefill(width, tables):
        y = module.lut_linear_bf16(flat, indices, *rounded, width, group_size, out_features, *sparse)
    elif flat.shape[0] > DECODE_ROWS and rounded is not None and integer_prefill(width, tables, out_features, flat.shape[1]):
        y = module.lut_linear_i8(flat, indices, *rounded, width, group_size, out_features, *sparse)
    elif flat.shape[0] > DECODE_ROWS:  # prefill: decode this layer's dense weight once (transient), the BLAS multiplies
        w = module.lut_dense(indices, tables.detach().float().contiguous(), width, group_size, out_features, flat.shape[1], *sparse)
        y = F.linear(flat, w)
    elif rounded is not None and q8(width):  # the row scales applied as each row ends
        y, scale = module.lut_linear_q8(flat, indices, *rounded, width, group_size, out_features, *sparse, scale), None
    else:
        y = module.lut_linear(flat, indices, tables.detach().float().contiguous(), width, group_size, out_features, *sparse)
    if scale is not None:  # held as stored (float16): multiplied in as it is, with no converted copy
        y.mul_(scale)
    return y.view(*x.shape[:-1], out_features)


def integer_prefill(width: int, tables: torch.Tensor, out: int, inp: int) -> bool:
    """Whether prefill and evaluation multiply this palettized layer in integers
    (``lut_linear_i8``, on the weight decoding's byte products multiply, perplexity within
    0.02 %): for every layout but nibble vectors, as ``WSCOMPRESS_INT8_PREFILL`` says: ``1``
    always, ``0`` never, unset where the build decodes the weight vectorised and multiplies
    16-bit integers (``lut_q8(8)``: AVX-512 VBMI and VNNI) and the layer has at least
    INTEGER_PREFILL_WEIGHTS weights: from there its integer products gain on float32 (16-bit
    ones for 12-bit tables, three 8-bit ones for 4-d vectors' 16-bit tables); at SmolLM2's
    widths evaluation measured slower with them (docs/runtime.md)."""
    choice = os.environ.get("WSCOMPRESS_INT8_PREFILL", "")
    if choice == "0" or _nibble_vectors(width, tables):
        return False
    return choice == "1" or q8(8) and out * inp >= INTEGER_PREFILL_WEIGHTS


INTEGER_PREFILL_WEIGHTS = 1 << 22  # from 2048 x 2048 on the integer products gain on float32 (docs/runtime.md)


def _nibble_vectors(width: int, tables: torch.Tensor) -> bool:
    """Vectors of nibble indices, which prefill keeps in float32: their rounded tables have no decode."""
    return width == 4 and tables.dim() == 3 and tables.shape[2] > 1


_amx: list[bool] = []  # whether this CPU and build have AMX tiles (a global: a compiled graph reads it as a constant)


def amx_prefill(width: int, tables: torch.Tensor) -> bool:
    """Whether prefill and evaluation multiply this palettized layer on AMX tiles
    (``lut_linear_bf16``: the rounded tables' values and the input in bfloat16, float32 sums,
    through oneDNN's brgemm micro-kernel in torch): where the CPU has AMX and the build decodes
    tables vectorised (``lut_amx``), for every layout ``integer_prefill`` takes, at every width
    (at SmolLM2's as at 1.1B the tiles gain on float32: docs/runtime.md), unless
    ``WSCOMPRESS_AMX=0`` or a set ``WSCOMPRESS_INT8_PREFILL`` (``1``: integers, ``0``: float32)
    leaves prefill to ``integer_prefill``."""
    if (os.environ.get("WSCOMPRESS_AMX", "1") == "0" or os.environ.get("WSCOMPRESS_INT8_PREFILL", "")
            or _nibble_vectors(width, tables)):
        return False
    if not _amx:
        _amx.append(lut() is not None and bool(torch.ops.wscompress.lut_amx()))
    return _amx[0]


_q8: dict[int, bool] = {}  # q8()'s answers by index width (a global: a compiled graph reads it as a constant)


def q8(width: int) -> bool:
    """Whether decoding multiplies 8-bit activations (``lut_linear_q8``) for tables of this index
    width: nibbles and pairs' 6-bit indices where the LUT kernels are built with AVX2 or AVX-512
    BW/VBMI/VNNI, byte indices with the latter only (on AVX2 their 256-entry look-ups cost more
    than the float path's), unless ``WSCOMPRESS_Q8=0`` keeps float activations. Rounding the
    activations to 8 bits a block of 32 moves the decoded tokens' perplexity by the figure
    docs/runtime.md gives; prefill and evaluation multiply as ``integer_prefill`` says."""
    if width not in _q8:
        _q8[width] = (os.environ.get("WSCOMPRESS_Q8", "1") != "0" and lut() is not None
                      and bool(torch.ops.wscompress.lut_q8(width)))
    return _q8[width]


def _compiled_ops():
    """The operators, where torch.compile traces a call: the eager step before tracing loaded
    them, and the loader itself (file system, compiler) is nothing a graph can hold."""
    return torch.ops.wscompress if torch.compiler.is_compiling() else None


def _triton_path(x: torch.Tensor) -> bool:
    """Whether ``x`` goes to the Triton kernel: CUDA tensors (tests send CPU tensors through
    Triton's interpreter)."""
    return x.device.type == "cuda"


def _gpu_linear(x: torch.Tensor, indices: torch.Tensor, width: int, tables: torch.Tensor, group_size: int,
                out_features: int, outliers: SparseRows | None, scale: torch.Tensor | None) -> torch.Tensor | None:
    global _gpu_failure
    module = lut_gpu()
    if module is None or x.numel() > DECODE_ROWS * x.shape[-1] or tables.dim() != 2 and width != 8:
        return None  # vectors (groups, K, d) are read at 8 bits a vector only
    flat = x.reshape(-1, x.shape[-1]).contiguous()
    try:
        y = module.lut_linear(flat, indices, width, tables.detach().contiguous(), group_size, out_features, outliers,
                              None if scale is None else scale.detach())
    except Exception as err:  # noqa: BLE001 - a Triton or driver that cannot build it: the torch path
        _gpu_failure = f"lut_triton.py failed ({_why(err)})"
        warnings.warn(f"wscompress: {_gpu_failure}; palettized layers materialise their weight instead", stacklevel=2)
        return None
    return y.view(*x.shape[:-1], out_features)


def low_rank_linear(x: torch.Tensor, basis: torch.Tensor, coeff: torch.Tensor,
                    bias: torch.Tensor | None) -> torch.Tensor | None:
    """coeff (basis x) + bias in one call for decoding, or None where the kernel does not apply
    (more than DECODE_ROWS rows, not CPU float32, kernels unavailable, gradients needed). It runs
    once per low-rank layer and decoded token, so the checks are kept few and cheap."""
    module = _compiled_ops() or lowrank()
    if (module is None or x.device.type != "cpu" or x.numel() > DECODE_ROWS * x.shape[-1]
            or not x.dtype == basis.dtype == coeff.dtype == torch.float32 or bias is not None and bias.dtype != x.dtype
            or torch.is_grad_enabled() and (x.requires_grad or basis.requires_grad or coeff.requires_grad)):
        return None
    return module.lowrank_linear(x, basis, coeff, bias)


def _narrow(x: torch.Tensor, bias: torch.Tensor | None):
    """The operators that multiply a NarrowLinear's stored weight into float32 sums, or None where
    they do not apply (more than DECODE_ROWS rows, not CPU float32, kernels unavailable, gradients
    needed): the layer then converts its weight for the call."""
    module = _compiled_ops() or lowrank()
    if (module is None or x.device.type != "cpu" or x.dtype != torch.float32 or x.numel() > DECODE_ROWS * x.shape[-1]
            or bias is not None and bias.dtype != torch.float32
            or torch.is_grad_enabled() and (x.requires_grad or bias is not None and bias.requires_grad)):
        return None
    return module


def half_linear(x: torch.Tensor, weight16: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """x Wᵀ + b for a float16 W (``HalfLinear``) with float32 sums, for decoding on CPU, or None (``_narrow``)."""
    module = _narrow(x, bias)
    return None if module is None else module.half_linear(x, weight16, bias)


def int8_linear(x: torch.Tensor, q: torch.Tensor, scale16: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """x Wᵀ + b for W = int8 ``q`` times a float16 scale per 32 of a row (``Int8Linear``) with
    float32 sums, for decoding on CPU, or None (``_narrow``)."""
    module = _narrow(x, bias)
    return None if module is None else module.int8_linear(x, q, scale16, bias)


def six_bit_pairs() -> bool:
    """Whether the CPU kernels read pairs' 6-bit indices as stored (the 3-bit recipe, held once):
    where their byte products spread them, which every build for a CPU with AVX2 has (AVX-512
    VBMI: a byte permute and VPMULTISHIFTQB; AVX2: shifts, and VPSHUFB over four 16-entry
    parts: held once at 0.53-1.04x the speed of a byte a pair, docs/runtime.md), byte products on.
    The float path spreads them 8 at a time, slower than it reads a byte a pair, so without byte
    products the layout keeps a byte a pair. ``WSCOMPRESS_MARCH`` names a CPU with AVX2 at least."""
    from ..io.hardware import cpu_flags

    return not _disabled() and os.environ.get("WSCOMPRESS_Q8", "1") != "0" and "avx2" in cpu_flags()


def trellis_linear(x: torch.Tensor, stream: torch.Tensor, scale: torch.Tensor, bits: int, state_bits: int,
                   bias: torch.Tensor | None) -> torch.Tensor | None:
    """x Wᵀ + b for a ``TrellisLinear`` on CPU in float32 without gradients: decoding (at most
    DECODE_ROWS rows) computes each tile's values once into the products, longer inputs
    multiply the decoded weight with the BLAS; None elsewhere (its torch path)."""
    module = _compiled_ops() or trellis()
    if (module is None or x.device.type != "cpu" or x.dtype != torch.float32
            or torch.is_grad_enabled() and (x.requires_grad or bias is not None and bias.requires_grad)):
        return None
    flat = x.reshape(-1, x.shape[-1])
    scale = scale.float() / wscompress_trellis.ONE_MAD_STD  # the kernels' values are the byte sums less their mean
    if flat.shape[0] <= DECODE_ROWS:
        y = module.trellis_linear(flat, stream, scale, bits, state_bits)
        y = y if bias is None else y + bias
    else:
        y = F.linear(flat, module.trellis_dense(stream, scale, bits, state_bits), bias)
    return y.reshape(*x.shape[:-1], -1)


def trellis_path(layer: nn.Module) -> str | None:
    """What ``trellis_linear`` does for a ``TrellisLinear`` where it is, in words, or None."""
    cpu = layer.stream.device.type == "cpu"
    return "trellis kernel for decoding, BLAS on the decoded weight for prefill" if cpu and trellis() is not None else None


def palettized_path(layer: nn.Module) -> str | None:
    """What ``palettized_linear`` does for a ``PalettizedLinear`` where it is, in words, or None where it does not take it."""
    if layer.dtype_probe.device.type == "cuda":
        return "LUT kernel (Triton) for decoding, weight materialised for prefill" if lut_gpu() is not None else None
    layout = layer.kernel_layout() if lut() is not None and layer.dtype_probe.device.type == "cpu" else None
    if layout is None:
        return None
    rounded = layout.rounded is not None
    decode = "byte products on 8-bit activations" if rounded and q8(layout.width) else "float look-ups"
    prefill = ("integer products" if rounded and integer_prefill(layout.width, layout.tables, layer.out_features,
                                                                 layer.in_features) else "BLAS on the decoded weight")
    return f"LUT kernel ({decode}) for decoding, {prefill} for prefill"


def low_rank_path(layer: nn.Module) -> str | None:
    """What ``low_rank_linear`` does for a ``LowRankLinear`` where it is, in words, or None."""
    plain = type(layer.basis) is nn.Linear and type(layer.coeff) is nn.Linear  # not palettized in turn
    cpu = layer.coeff.weight.device.type == "cpu" if plain else False
    return "fused kernel for decoding, BLAS for prefill" if cpu and lowrank() is not None else None


def narrow_path(layer: nn.Module) -> str | None:
    """What ``half_linear`` and ``int8_linear`` do for a ``NarrowLinear`` where it is, in words, or None."""
    cpu = layer.dtype_probe.device.type == "cpu"
    return "kernel with float32 sums for decoding, BLAS on converted slices for prefill" if cpu and lowrank() is not None else None


# the compressed layers (model/forms) call these where they apply, their torch path elsewhere
wscompress_format.KERNELS.update(palettized=palettized_linear, low_rank=low_rank_linear, half=half_linear,
                                int8=int8_linear, trellis=trellis_linear)
wscompress_format.PATHS.update(palettized=palettized_path, low_rank=low_rank_path, half=narrow_path, int8=narrow_path,
                               trellis=trellis_path)
wscompress_palettized.SIX_BIT_PAIRS = ("cpu",) if six_bit_pairs() else ()
