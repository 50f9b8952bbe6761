"""The compressed layers of wscompress, their storage format, and the transformers classes that load them.

This module imports torch, transformers and numpy (which transformers needs) and nothing of
wscompress, on purpose: wscompress uses it, and copies it into every model folder it writes (as
``modeling_wscompress.py``, named in ``config.json``'s ``auto_map``), so the folder loads with
``AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)`` where wscompress is
not installed. There every layer runs its torch reference path; wscompress fills ``KERNELS``
with its compiled and Triton kernels when it is imported.

A compressed folder is a HF checkpoint whose ``config.json`` has ``model_type: wscompress``:
the base model's own config (``base_config``) and how its layers are stored (``compression``:
the compressed layers by name with their constructor arguments, the modules reached under
several names and the tensors stored once for several names). ``config.json`` stays a valid
config for any reader (AutoTokenizer's probe, hub tooling), while the weights are a transformers
weight *variant* (``model.wscompress.safetensors``) that only these classes ask for: a stock
model class finds no weights and refuses the folder instead of filling it with random ones.

Everything read from a folder is checked before any kernel sees it (``check_entry``,
``check_weight_files``, ``validate``): a crafted or damaged folder is a ValueError naming the
problem, never an out-of-range read.
"""

from __future__ import annotations

import heapq
import importlib.metadata
import inspect
import json
import math
import os
import re
import shutil
import types
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Literal, NamedTuple, Union, get_args, get_origin, get_type_hints

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.pytorch_utils import Conv1D

FORMAT_VERSION = 3  # 3: weights as the "wscompress" variant, config.json a plain valid config; 2: "dtype" guard
CODE_FILE = "modeling_wscompress.py"
# The weight files are this transformers variant (model.wscompress.safetensors, and its shards'
# index model.safetensors.index.wscompress.json): stock classes look for model.safetensors, find
# none and refuse the folder, while these classes ask for the variant.
VARIANT = "wscompress"
WEIGHTS = f"model.{VARIANT}.safetensors"
SHARD_INDEX = f"model.safetensors.index.{VARIANT}.json"
LEGACY_WEIGHTS, LEGACY_SHARD_INDEX = "model.safetensors", "model.safetensors.index.json"  # format 2 and before
AUTO_MAP = {"AutoConfig": "modeling_wscompress.WSCompressConfig",
            "AutoModelForCausalLM": "modeling_wscompress.WSCompressForCausalLM"}

# Fast paths, filled by wscompress when it is imported: "palettized" (look-up-table product),
# "low_rank" (fused decode), "half" and "int8" (NarrowLinear's decode products); each returns None
# where it does not apply, and the layer then runs its torch reference path, as it always does
# where nothing is registered. "generate" and "decode_step" (wscompress.evaluation.step_cache):
# generate()'s arguments and its decode call on CPU, a compiled step kept across processes.
KERNELS: dict[str, Callable[..., Any]] = {}
DECODE_ROWS = 8  # inputs with at most this many rows (decoding) go to the kernels; longer ones the BLAS
NARROW_SLICE_BYTES = 8 << 20  # a NarrowLinear's torch path on CPU converts this much of its weight at a time
INT8_BLOCK = 32  # an Int8Linear's weights per scale (llama.cpp's Q8_0 block)

# ----------------------------------------------------------------------------- index storage

BLOCK = 1024  # symbols per independently decodable Huffman block
MAX_CODE_LENGTH = 57  # a window of 57 bits + a 7-bit offset fits one uint64 read
ABSENT = 255  # code length stored for symbols that do not occur


def packed_nbytes(n: int, bits: int) -> int:
    """Bytes that ``pack`` writes for n values (8 values per ``bits`` bytes)."""
    return n if bits == 8 else math.ceil(n / 8) * bits


def pack(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack integers in [0, 2^bits) (any shape) into a flat uint8 tensor, LSB first."""
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in 1..8, got {bits}")
    flat = values.reshape(-1).to(torch.int64)
    if bits == 8:
        return flat.to(torch.uint8)
    groups = F.pad(flat, (0, (-flat.numel()) % 8)).view(-1, 8)
    # 8 values of <= 7 bits occupy disjoint bit ranges of one int64 (<= 56 bits): sum == or
    word = (groups << (torch.arange(8, device=flat.device) * bits)).sum(1)
    out = (word[:, None] >> (torch.arange(bits, device=flat.device) * 8)) & 0xFF
    return out.to(torch.uint8).reshape(-1)


def unpack(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of ``pack``: the first n values as int64."""
    if bits == 8:
        return packed[:n].to(torch.int64)
    dev = packed.device
    word = (packed.view(-1, bits).to(torch.int64) << (torch.arange(bits, device=dev) * 8)).sum(1)
    values = (word[:, None] >> (torch.arange(8, device=dev) * bits)) & ((1 << bits) - 1)
    return values.reshape(-1)[:n]


def entropy(counts: np.ndarray) -> float:
    """Shannon entropy (bits/symbol) of a histogram."""
    p = np.asarray(counts, dtype=np.float64)
    p = p[p > 0] / p.sum()
    return float(-(p * np.log2(p)).sum())


def huffman_lengths(counts: np.ndarray) -> np.ndarray:
    """Optimal prefix-code length of each symbol: ABSENT for symbols that do not occur, 0 for
    the only symbol of a one-symbol stream (it needs no bits at all)."""
    lengths = np.where(np.asarray(counts) > 0, 0, ABSENT).astype(np.int64)
    heap = [(int(c), s, [s]) for s, c in enumerate(counts) if c > 0]
    heapq.heapify(heap)
    while len(heap) > 1:
        c1, t1, s1 = heapq.heappop(heap)
        c2, t2, s2 = heapq.heappop(heap)
        lengths[s1 + s2] += 1  # every symbol below the merged node gets one bit deeper
        heapq.heappush(heap, (c1 + c2, min(t1, t2), s1 + s2))
    if lengths[lengths != ABSENT].max(initial=0) > MAX_CODE_LENGTH:  # needs > 2^38 symbols (Fibonacci counts)
        raise ValueError(f"Huffman code longer than {MAX_CODE_LENGTH} bits")
    return lengths


def canonical_codes(lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(code per symbol, symbols in canonical order) of the canonical code with these lengths."""
    order = np.lexsort((np.arange(len(lengths)), lengths))
    order = order[lengths[order] != ABSENT]
    codes = np.zeros(len(lengths), dtype=np.uint64)
    code, prev = 0, int(lengths[order[0]]) if len(order) else 0
    for i, s in enumerate(order):
        length = int(lengths[s])
        if i:
            code = (code + 1) << (length - prev)
        codes[s], prev = code, length
    return codes, order


@dataclass
class HuffmanStream:
    data: np.ndarray  # uint8 bit stream, MSB first
    lengths: np.ndarray  # uint8 code length per symbol (ABSENT: does not occur)
    block_bits: np.ndarray  # int32 bits of each block of BLOCK symbols
    n: int  # symbols

    @property
    def bits(self) -> int:
        return int(self.block_bits.astype(np.int64).sum())


def huffman_encode(symbols: np.ndarray, num_symbols: int) -> HuffmanStream:
    """Canonical Huffman code of a stream of integers in [0, num_symbols)."""
    symbols = np.asarray(symbols).reshape(-1).astype(np.int64)
    counts = np.bincount(symbols, minlength=num_symbols)
    lengths = huffman_lengths(counts)
    if symbols.size == 0:
        return HuffmanStream(np.zeros(0, np.uint8), lengths.astype(np.uint8), np.zeros(0, np.int32), 0)
    codes, _ = canonical_codes(lengths)
    present = np.where(lengths == ABSENT, 0, lengths)
    top = int(present.max())
    # bit j of each symbol's code (MSB first) and which of its `top` slots are real bits
    j = np.arange(top)
    table = ((codes[:, None] >> np.clip(present[:, None] - 1 - j, 0, None).astype(np.uint64)) & np.uint64(1)).astype(np.uint8)
    valid = j < present[:, None]
    chunks = [table[s][valid[s]] for s in np.array_split(symbols, max(1, symbols.size >> 20))]
    block_bits = np.add.reduceat(lengths[symbols], np.arange(0, symbols.size, BLOCK)).astype(np.int32)
    return HuffmanStream(np.packbits(np.concatenate(chunks)), lengths.astype(np.uint8), block_bits, symbols.size)


def huffman_decode(stream: HuffmanStream) -> np.ndarray:
    """Inverse of ``huffman_encode``: the symbols as int64. The stream is cut into blocks of
    BLOCK symbols whose bit lengths are stored, so all blocks decode at once (vectorised numpy)."""
    if stream.n == 0:
        return np.zeros(0, dtype=np.int64)
    lengths = stream.lengths.astype(np.int64)
    codes, order = canonical_codes(lengths)
    top = int(lengths[order].max(initial=0))
    # every code left-aligned to `top` bits: canonical codes sort, so the code that starts a
    # window is the last one whose aligned value is <= the window (one searchsorted per step)
    aligned = codes[order] << (top - lengths[order]).astype(np.uint64)
    data = np.concatenate([stream.data, np.zeros(8, np.uint8)]).astype(np.uint64)
    words = np.zeros(len(data) - 7, dtype=np.uint64)  # big-endian uint64 starting at each byte
    for k in range(8):
        words |= data[k: k + len(words)] << np.uint64(56 - 8 * k)
    starts = np.concatenate([[0], np.cumsum(stream.block_bits.astype(np.int64))[:-1]])
    pos = starts.copy()
    out = np.empty((len(starts), BLOCK), dtype=np.int64)
    last = len(words) - 1
    for step in range(BLOCK):
        word = words[np.minimum(pos >> 3, last)]
        window = (word << (pos & 7).astype(np.uint64)) >> np.uint64(64 - top) if top else np.zeros_like(word)
        i = np.searchsorted(aligned, window, side="right") - 1
        out[:, step] = order[i]
        pos += lengths[order[i]]
    return out.reshape(-1)[: stream.n]


class SparseRows(NamedTuple):
    """A palettized layer's weights kept aside from its codebook (outliers), as corrections by
    weight row (CSR): row r's are at flat positions ``pos[row_ptr[r]:row_ptr[r + 1]]`` of the
    (out, in) weight (column ``pos - r·in``), each adding ``delta`` (the exact weight minus its
    codebook value). By rows, the CPU kernel adds a row's few while its sums are in registers.
    ``pos`` is the layer's stored ``outlier_index`` itself where that is sorted, and ``delta``
    float16 where the layer stores its values so, so the kernels hold 2 bytes an outlier beside
    what the file holds, not 6 (docs/runtime.md)."""
    row_ptr: torch.Tensor  # (out + 1,) int32
    pos: torch.Tensor  # int32, ascending
    delta: torch.Tensor  # float16 or float32

    @classmethod
    def from_positions(cls, pos: torch.Tensor, delta: torch.Tensor, shape: tuple[int, int]) -> SparseRows:
        """From flat positions in a (out, in) weight and their corrections: ``pos`` itself
        where it is ascending int32, else sorted (a copy)."""
        if pos.dtype != torch.int32 or bool((pos[1:] < pos[:-1]).any()):
            order = pos.argsort()
            pos, delta = pos[order].to(torch.int32), delta[order]
        counts = torch.bincount(pos // shape[1], minlength=shape[0])
        row_ptr = torch.cat([counts.new_zeros(1), counts.cumsum(0)]).to(torch.int32)
        return cls(row_ptr, pos.contiguous(), delta.contiguous())


# devices whose kernels read pairs' 6-bit indices (the 3-bit recipe) as stored, so that they are
# held once, in 3 bits a weight (wscompress.kernels sets it where they do it fast); elsewhere the
# layout spreads them to a byte each
SIX_BIT_PAIRS: tuple[str, ...] = ()


class KernelLayout(NamedTuple):
    """A palettized layer as the look-up-table kernels read it (``PalettizedLinear.kernel_layout``)."""
    indices: torch.Tensor  # uint8: nibbles (``width`` 4), bytes (8), or pairs' 6-bit indices as stored (6, CPU)
    width: int
    outliers: SparseRows | None
    tables: torch.Tensor  # (groups, K) or (groups, K, d), float
    rounded: tuple[torch.Tensor, torch.Tensor] | None  # the tables as 8-bit integers and their scales, see below


def round_tables(tables: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The tables as kernels multiplying 8-bit activations read them: each group's values over
    one scale (its largest magnitude / 2047) rounded to 12-bit integers v = 16·hi + lo, padded to
    the index width's reach (K = 16 entries for nibbles, 64 for 6 bits, 256 for bytes), stored
    per group as the signed bytes hi, component-major (d, K), then the nibbles lo (two components
    a byte, at bits 0 and 4: ceil(d / 2)·K bytes): (groups, d·K + ceil(d / 2)·K) int8; and the
    scales (groups,) float32. 4-d vectors keep 16 bits (v = 256·hi + lo over largest / 32767, lo
    a byte a component: (groups, 2·d·K)): their one table a matrix spans its extreme centroids,
    and at 12 bits the byte products moved a one-shot 2-bit model's decode perplexity by +0.45 %.
    Rounding to 8 bits instead cost 1 % of perplexity; at 12 a value moves by at most 1/4094 of
    its group's largest (docs/runtime.md)."""
    t = tables.detach().float().reshape(tables.shape[0], tables.shape[1], -1).transpose(1, 2)  # (groups, d, K)
    t = F.pad(t, (0, {4: 16, 6: 64}.get(width, 256) - t.shape[2]))
    wide = t.shape[1] == 4  # 16 bits: v = 256·hi + lo, a lo byte a component
    levels, unit = (32767, 256) if wide else (2047, 16)
    scale = t.abs().amax((1, 2)).clamp_min(torch.finfo(torch.float32).tiny) / levels
    v = (t / scale[:, None, None]).round().clamp(-levels, levels).to(torch.int32)
    hi, lo = v.div(unit, rounding_mode="floor"), v.remainder(unit)
    if not wide:
        lo = F.pad(lo, (0, 0, 0, lo.shape[1] % 2))  # (groups, 2·ceil(d / 2), K)
        lo = lo[:, 0::2] + 16 * lo[:, 1::2]  # component c in byte c // 2, at bit 4 (c % 2)
    packed = torch.cat([hi.flatten(1).to(torch.int8), lo.flatten(1).to(torch.uint8).view(torch.int8)], 1)
    return packed.contiguous(), scale.contiguous()


# ----------------------------------------------------------------------------- the layers

LAYERS: dict[str, type[nn.Module]] = {}  # class name -> class: what config.json's ``compression`` names
_JSON_TYPES = {int: (int,), float: (float, int), bool: (bool,), str: (str,), type(None): (type(None),)}


class Argument(NamedTuple):
    """One constructor argument of a compressed layer, as config.json may give it."""

    accepts: Callable[[Any], bool]  # whether a value read from JSON is one the argument takes
    required: bool


def _accepts(hint: Any, where: str) -> Callable[[Any], bool]:
    """The JSON values a type hint allows: int, float (an int too), bool, str, None, a Literal of
    those, or a union of them; any other hint is a TypeError naming ``where``."""
    if get_origin(hint) is Literal:
        options = get_args(hint)
        return lambda v: any(type(v) is type(o) and v == o for o in options)  # True is not 1 here
    if get_origin(hint) in (Union, types.UnionType):
        parts = [_accepts(h, where) for h in get_args(hint)]
        return lambda v: any(part(v) for part in parts)
    if hint not in _JSON_TYPES:  # an argument without a hint is Any: refused too
        raise TypeError(f"{where}: its type hint {hint!r} is no JSON value; a compressed layer's constructor takes "
                        "int, float, bool, str, None, Literals of those and unions of them (config.json records them)")
    return lambda v: type(v) in _JSON_TYPES[hint]  # exact types: a bool is no int


def register_layer(cls: type[CompressedLayer]) -> type[CompressedLayer]:
    """Make ``cls`` loadable by its name: config.json's ``compression`` names it with its
    constructor arguments (``spec``), which ``check_entry`` checks against the type hints of
    ``cls.__init__`` (``ARGUMENTS``, read here, so a hint no JSON value fits fails at import)."""
    hints = get_type_hints(cls.__init__)
    params = [p for p in inspect.signature(cls.__init__).parameters.values() if p.name != "self"]
    cls.ARGUMENTS = {p.name: Argument(_accepts(hints.get(p.name, Any), f"{cls.__name__}.__init__({p.name})"),
                                      p.default is inspect.Parameter.empty) for p in params}
    LAYERS[cls.__name__] = cls
    return cls


class CompressedLayer:
    """What every compressed layer is: its values always come from a checkpoint (transformers never
    initialises it), it describes itself (``spec``: the constructor arguments that rebuild its
    structure) and it turns back into a dense module (``to_dense``, for export to stock transformers).

    Everything loading needs to know of a form is declared here, on its class: its constructor
    arguments (``__init__``'s type hints, read by ``register_layer``), what a folder's values of
    them may be (``check_spec``), the shape of the dense module it stands for (``dense_shape``),
    the child modules it holds (``CHILDREN``), what its loaded tensors must satisfy before a kernel
    reads them (``check_values``) and what it does once they are loaded (``settle``)."""

    _is_hf_initialized = True  # transformers' init skips modules that say so: every value is loaded
    ARGUMENTS: ClassVar[dict[str, Argument]]  # set by ``register_layer``
    CHILDREN: ClassVar[tuple[str, ...]] = ()  # its child modules: a later stage may compress them in turn

    @staticmethod
    def dense_shape(spec: dict) -> tuple[int, int]:
        """(out, in) of the linear, or (rows, width) of the table, that a layer of this spec replaces."""
        if "out_features" in spec:
            return spec["out_features"], spec["in_features"]
        return spec["num_embeddings"], spec["embedding_dim"]

    @classmethod
    def check_spec(cls, **spec) -> str | None:
        """What is wrong with these constructor arguments (read from a folder, their JSON types
        already checked), or None: checked before anything is built from them."""
        shape = cls.dense_shape(spec)
        if min(shape) < 1:
            return f"a dimension of {shape} is zero"
        if not 1 <= spec.get("rank", 1) <= sum(shape):  # a factorisation never needs more
            return f"rank {spec['rank']} is outside 1..{sum(shape)}"
        if spec.get("padding_idx") is not None and spec["padding_idx"] >= shape[0]:
            return f"padding_idx {spec['padding_idx']} is past the table's {shape[0]} rows"
        if not math.isfinite(spec.get("scale", 1.0)):
            return "its scale is not finite"
        return None

    def spec(self) -> dict:
        """Constructor keyword arguments that rebuild this module's structure (not its values)."""
        raise NotImplementedError

    def parameter_count(self) -> int | None:
        """The parameters this layer counts as in size reports, where they are not the values
        of its tensors: a form that packs every weight of its dense module into fewer bits
        counts those weights (bits a weight then divide its bytes by them). None: its tensors'
        values are its parameters (factors, int8 weights, float16 ones)."""
        return None

    def check_values(self, where: str) -> None:
        """Refuse loaded tensors that would make this layer read out of range (``where``: its name),
        with ``corrupt``; shapes and dtypes were checked on the files' headers already."""

    def settle(self, dtype: torch.dtype | None) -> None:
        """After its tensors are loaded and checked: what the layer derives from them, and values it
        stores in a dtype of its own brought to ``dtype`` (the floating dtype the model loads in, or None)."""

    def to_dense(self) -> nn.Module:
        raise NotImplementedError


class DenseCopy(torch.Tensor):
    """What a compressed linear's ``weight`` is: its dense weight, built on request, for code that
    asks any linear for its weight's shape, dtype, device or values (peft does). It refuses to be
    written to: a write would change this copy, not the layer (peft's LoRA merge writes there)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name.endswith("_") and not name.endswith("__") or name in ("__setitem__", "__iadd__", "__isub__", "__imul__"):
            raise RuntimeError(f"{name}: the weight of a compressed layer is a read-only copy (the layer stores it "
                               "compressed). To merge a LoRA adapter, keep it separate or export the model dense "
                               "first (wscompress export DIR OUT); to change the layer, change its own tensors")
        with torch._C.DisableTorchFunctionSubclass():  # what it computes is a plain tensor
            return func(*args, **(kwargs or {}))

    @property
    def data(self) -> torch.Tensor:
        return self

    @data.setter
    def data(self, value) -> None:
        self.add_(0)  # refused, with the reason


def weight_of(module: nn.Module) -> torch.Tensor:
    """The (out, in) weight of a dense or compressed linear."""
    if isinstance(module, CompressedLinear):
        return module.dense_weight()
    return module.weight.t() if isinstance(module, Conv1D) else module.weight


class CompressedLinear(CompressedLayer, nn.Linear):
    """y = x W^T + b with W stored in another form. An ``nn.Linear`` to the ecosystem (peft wraps it
    with LoRA, device maps place it), but it has no dense ``weight``: ``dense_weight()`` builds one.

    ``conv1d`` records that the layer replaced a GPT-2 ``Conv1D`` (weight stored (in, out)), so
    ``to_dense`` gives one back: stock GPT-2 checkpoints expect that layout."""

    in_features: int
    out_features: int
    conv1d: bool = False

    def __init__(self) -> None:
        nn.Module.__init__(self)  # not nn.Linear's: it would allocate the dense weight this layer replaces

    def dense_weight(self) -> torch.Tensor:
        """The weight as an (out_features, in_features) tensor."""
        raise NotImplementedError

    @property
    def weight(self) -> torch.Tensor:
        """The dense weight as a read-only copy (``DenseCopy``), built on each access."""
        return self.dense_weight().detach().as_subclass(DenseCopy)

    def to_dense(self) -> nn.Module:
        """An nn.Linear (or Conv1D, see ``conv1d``) computing the same function."""
        w = self.dense_weight().detach()
        bias = getattr(self, "bias", None)
        if self.conv1d:
            dense = Conv1D(self.out_features, self.in_features).to(w.device, w.dtype)
            w = w.T
        else:
            dense = nn.Linear(self.in_features, self.out_features, bias=bias is not None, device=w.device, dtype=w.dtype)
        with torch.no_grad():
            dense.weight.copy_(w)
            if bias is not None:
                dense.bias.copy_(bias)
            elif self.conv1d:
                dense.bias.zero_()
        return dense

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.spec().items())


@register_layer
class LowRankLinear(CompressedLinear):
    """y = coeff(basis(x)): a (rank, in) basis then (out, rank) coefficients (+ the original bias)."""

    CHILDREN = ("basis", "coeff")

    def __init__(self, in_features: int, out_features: int, rank: int, bias: bool = False, conv1d: bool = False):
        super().__init__()
        self.in_features, self.out_features, self.rank = in_features, out_features, rank
        self.conv1d = conv1d
        self.basis = nn.Linear(in_features, rank, bias=False)
        self.coeff = nn.Linear(rank, out_features, bias=bias)

    @property
    def bias(self) -> torch.Tensor | None:
        return self.coeff.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        basis, coeff = self.basis, self.coeff
        fast = KERNELS.get("low_rank")
        if fast is not None and type(basis) is nn.Linear and type(coeff) is nn.Linear:  # not palettized in turn
            y = fast(x, basis.weight, coeff.weight, coeff.bias)
            if y is not None:  # decoding on CPU: one fused call
                return y
        return coeff(basis(x))

    def dense_weight(self) -> torch.Tensor:
        return weight_of(self.coeff) @ weight_of(self.basis)  # either factor may be palettized in turn

    def spec(self) -> dict:
        return {"in_features": self.in_features, "out_features": self.out_features, "rank": self.rank,
                "bias": self.bias is not None, "conv1d": self.conv1d}

    @classmethod
    def replacing(cls, original: nn.Module, coeff: torch.Tensor, basis: nn.Linear | torch.Tensor) -> LowRankLinear:
        """The low-rank stand-in for ``original`` (its bias, dtype and device kept): coefficients
        (out, rank) and a basis given as a (rank, in) tensor or as an existing module to share."""
        w = weight_of(original)
        bias = getattr(original, "bias", None)
        new = cls(w.shape[1], w.shape[0], coeff.shape[1], bias=bias is not None, conv1d=isinstance(original, Conv1D))
        new.to(device=w.device, dtype=w.dtype)
        with torch.no_grad():
            if isinstance(basis, nn.Linear):
                new.basis = basis
            else:
                new.basis.weight.copy_(basis)
            new.coeff.weight.copy_(coeff)
            if bias is not None:
                new.coeff.bias.copy_(bias)
        return new


@register_layer
class SharedBasisLinear(LowRankLinear):
    """coeff(basis(x)) whose ``basis`` module is shared with the other layers of its group;
    saving stores it once and loading re-ties it."""


@register_layer
class LowRankDeltaLinear(CompressedLinear):
    """y = x (W_c + A B)^T + b: ``base`` (W_c) is an nn.Linear shared by a window of layers;
    A (out, rank), B (rank, in) and the bias are this layer's own."""

    CHILDREN = ("base",)

    def __init__(self, in_features: int, out_features: int, rank: int, bias: bool = False, conv1d: bool = False):
        super().__init__()
        self.in_features, self.out_features, self.rank, self.conv1d = in_features, out_features, rank, conv1d
        self.base = nn.Linear(in_features, out_features, bias=False)
        self.a = nn.Parameter(torch.empty(out_features, rank))
        self.b = nn.Parameter(torch.empty(rank, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + F.linear(F.linear(x, self.b), self.a, self.bias)

    def dense_weight(self) -> torch.Tensor:
        return self.base.weight + self.a @ self.b

    def spec(self) -> dict:
        return {"in_features": self.in_features, "out_features": self.out_features, "rank": self.rank,
                "bias": self.bias is not None, "conv1d": self.conv1d}

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [self.a, self.b]  # the shared base stays fixed: only the deltas are trained

    def penalty(self) -> torch.Tensor:
        """||A B||_F^2, computed as sum((A^T A) * (B B^T)) without forming A B."""
        return ((self.a.T @ self.a) * (self.b @ self.b.T)).sum()


CodebookDtype = Literal["float16", "bfloat16", "float32"]


def dequantize(codebook: torch.Tensor, indices: torch.Tensor, group_size: int) -> torch.Tensor:
    """Weight (out, cols * d) from codebooks (groups, K, d) and indices (out, cols): row r
    reads codebook r // group_size (differentiable in the codebook)."""
    _, k, d = codebook.shape
    offset = (torch.arange(indices.shape[0], device=indices.device) // group_size * k)[:, None]
    return codebook.reshape(-1, d)[indices + offset].reshape(indices.shape[0], -1)


@register_layer
class PalettizedLinear(CompressedLinear):
    """A linear layer stored as packed cluster indices + codebook(s).

    Memory holds ``indices`` (``bits`` bits per index, bit-packed uint8) and ``codebook``
    (groups, K, cluster_dim): output channels ``g*group_size ... (g+1)*group_size - 1`` use
    codebook g, and index (r, j) picks the centroid for weights W[r, j*d : (j+1)*d]. Weights
    kept aside (``outliers`` of them) replace their codebook value: ``outlier_index`` holds their
    flat positions, ``outlier_value`` their values. With ``scaled``, row r's codebook values are
    multiplied by ``scale[r]`` (the kept-aside values are not): rows of different magnitudes
    share a codebook of normalised values (GPTVQ). Codebooks, scales and outliers ("values") are
    stored in ``codebook_dtype`` and held so in memory too, as buffers that ``.to(dtype)`` leaves
    as they are (``model.dtype`` stays the model's): ``dtype_probe`` (empty, not saved) follows
    ``.to(dtype)`` and tells the dtype the layer computes in. ``train_values`` makes them float32
    parameters while fine-tuning trains them. Where a look-up-table kernel is
    registered (``KERNELS``) it computes from the indices directly; elsewhere, and while the
    codebook trains, the dense weight is materialised on each forward. With ``stream_bytes`` set,
    the file stores the indices Huffman-coded instead (``huffman_*`` buffers) and loading decodes them.
    """

    VALUES = ("codebook", "outlier_value", "scale")  # the tensors stored in codebook_dtype (those present)

    def __init__(self, in_features: int, out_features: int, bits: int, group_size: int | None = None,
                 cluster_dim: int = 1, bias: bool = False, stream_bytes: int | None = None, conv1d: bool = False,
                 codebook_dtype: CodebookDtype = "float32", outliers: int = 0, scaled: bool = False):
        super().__init__()
        self.in_features, self.out_features, self.bits, self.conv1d = in_features, out_features, bits, conv1d
        self.group_size = group_size or out_features
        self.cluster_dim, self.stream_bytes = cluster_dim, stream_bytes
        self.codebook_dtype, self.outliers, self.scaled = codebook_dtype, outliers, scaled
        k, n = 2 ** bits, self.num_indices
        held = getattr(torch, codebook_dtype)
        self.register_buffer("dtype_probe", torch.empty(0), persistent=False)
        self.register_buffer("codebook", torch.empty(out_features // self.group_size, k, cluster_dim, dtype=held))
        self.register_buffer("scale", torch.empty(out_features, dtype=held) if scaled else None)
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        if outliers:
            self.register_buffer("outlier_index", torch.empty(outliers, dtype=torch.int32))
            self.register_buffer("outlier_value", torch.empty(outliers, dtype=held))
        self.register_buffer("indices", torch.empty(packed_nbytes(n, bits), dtype=torch.uint8),
                             persistent=stream_bytes is None)
        if stream_bytes is not None:
            self.register_buffer("huffman_stream", torch.empty(stream_bytes, dtype=torch.uint8))
            self.register_buffer("huffman_lengths", torch.empty(k, dtype=torch.uint8))
            self.register_buffer("huffman_blocks", torch.empty(math.ceil(n / BLOCK), dtype=torch.int32))

    @property
    def num_indices(self) -> int:
        return self.out_features * self.in_features // self.cluster_dim

    @classmethod
    def check_spec(cls, **spec) -> str | None:
        out, cols, bits, d = spec["out_features"], spec["in_features"], spec["bits"], spec.get("cluster_dim", 1)
        group, stream, outliers = spec.get("group_size") or out, spec.get("stream_bytes"), spec.get("outliers", 0)
        problem = super().check_spec(**spec)
        if problem is None and not 1 <= bits <= 8:
            problem = f"bits={bits} is outside 1..8"
        elif problem is None and (d < 1 or cols % d):
            problem = f"cluster_dim={d} does not divide in_features={cols}"
        elif problem is None and (group < 1 or out % group):
            problem = f"group_size={group} does not divide out_features={out}"
        elif problem is None and outliers > out * cols:
            problem = f"{outliers} outliers in a {out}x{cols} weight"
        elif problem is None and stream is not None and stream > out * cols // d * MAX_CODE_LENGTH // 8 + 8:
            problem = f"a Huffman stream of {stream} bytes is longer than its indices can need"
        return problem

    def check_values(self, where: str) -> None:
        """Refuse loaded tensors a kernel would read out of range: every tensor's dtype and shape
        as the spec implies (the codebooks hold 2^bits entries, so any packed index is in range),
        positions of the weights kept aside inside the weight, and a decodable Huffman stream."""
        k, n = 2 ** self.bits, self.num_indices
        want = {"codebook": ((self.out_features // self.group_size, k, self.cluster_dim), None),
                "scale": ((self.out_features,), None), "bias": ((self.out_features,), None),
                "outlier_value": ((self.outliers,), None), "outlier_index": ((self.outliers,), torch.int32)}
        if self.stream_bytes is None:
            want["indices"] = ((packed_nbytes(n, self.bits),), torch.uint8)
        for name, (shape, dtype) in want.items():
            t = getattr(self, name, None)
            if t is None:
                continue
            if tuple(t.shape) != shape or (t.dtype != dtype if dtype is not None else not t.is_floating_point()):
                raise corrupt(f"{where}.{name} is {list(t.shape)} {t.dtype}, where its layer needs {list(shape)} "
                              f"{dtype or 'floating point'}")
        if self.outliers and not self.outlier_index.is_meta:
            pos = self.outlier_index
            if int(pos.min()) < 0 or int(pos.max()) >= self.out_features * self.in_features:
                raise corrupt(f"{where}.outlier_index has positions outside the {self.out_features}x{self.in_features} weight")
        if self.stream_bytes is not None:
            self.check_stream(where)

    def check_stream(self, where: str) -> None:
        """A Huffman stream the decoder can walk: lengths of a prefix code (Kraft's inequality),
        one block length per BLOCK symbols, the blocks inside the stream."""
        k, n = 2 ** self.bits, self.num_indices
        tensors = {"huffman_stream": ((self.stream_bytes,), torch.uint8), "huffman_lengths": ((k,), torch.uint8),
                   "huffman_blocks": ((math.ceil(n / BLOCK),), torch.int32)}
        for name, (shape, dtype) in tensors.items():
            t = getattr(self, name)
            if tuple(t.shape) != shape or t.dtype != dtype:
                raise corrupt(f"{where}.{name} is {list(t.shape)} {t.dtype}, where its layer needs {list(shape)} {dtype}")
        if self.huffman_stream.is_meta:
            return
        lengths = [int(v) for v in self.huffman_lengths.tolist() if v != ABSENT]
        blocks = self.huffman_blocks.long()
        if (not lengths and n or any(v > MAX_CODE_LENGTH for v in lengths)
                or sum(1 << (MAX_CODE_LENGTH - v) for v in lengths) > 1 << MAX_CODE_LENGTH):
            raise corrupt(f"{where}.huffman_lengths are not the lengths of a prefix code")
        if n and (int(blocks.min()) < 0 or int(blocks.sum()) > 8 * self.stream_bytes):
            raise corrupt(f"{where}.huffman_blocks point past the end of its stream")

    @classmethod
    def from_clusters(cls, codebook: torch.Tensor, indices: torch.Tensor, bias: torch.Tensor | None,
                      entropy_coding: bool = False, conv1d: bool = False, codebook_dtype: CodebookDtype = "float32",
                      outliers: tuple[torch.Tensor, torch.Tensor] | None = None,
                      scale: torch.Tensor | None = None) -> PalettizedLinear:
        """Build from codebook (groups, K, d), indices (out, in / d) and optionally the
        weights kept aside as (flat positions, values) and a scale per row (out,); values are
        rounded to ``codebook_dtype``."""
        groups, k, d = codebook.shape
        out, cols = indices.shape
        stream = huffman_encode(indices.cpu().numpy(), k) if entropy_coding else None
        layer = cls(cols * d, out, int(math.log2(k)), out // groups, d, bias is not None,
                    None if stream is None else len(stream.data), conv1d, codebook_dtype,
                    0 if outliers is None else outliers[0].numel(), scale is not None)
        stored = getattr(torch, codebook_dtype)
        layer.dtype_probe = layer.dtype_probe.to(codebook.device, codebook.dtype)  # it computes in the codebook's dtype
        layer.codebook = codebook.detach().to(stored, copy=True)  # its own storage
        if scale is not None:
            layer.scale = scale.detach().to(stored, copy=True)
        layer.indices = pack(indices, layer.bits)
        if outliers is not None:  # ascending, as the kernels read them (``SparseRows``)
            order = outliers[0].argsort()
            layer.outlier_index = outliers[0][order].to(torch.int32)
            layer.outlier_value = outliers[1][order].detach().to(stored)
        if bias is not None:
            layer.bias = nn.Parameter(bias.detach().clone())
        if stream is not None:
            layer.huffman_stream = torch.from_numpy(stream.data).to(codebook.device)
            layer.huffman_lengths = torch.from_numpy(stream.lengths).to(codebook.device)
            layer.huffman_blocks = torch.from_numpy(stream.block_bits).to(codebook.device)
        return layer

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        for name in self.VALUES:  # stored in codebook_dtype, whatever the model computes in
            if prefix + name in destination:
                destination[prefix + name] = destination[prefix + name].detach().to(getattr(torch, self.codebook_dtype))

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        for name in self.VALUES:  # in the dtype they are held in (trained: float32)
            if prefix + name in state_dict and (held := self._value(name)) is not None:
                state_dict[prefix + name] = state_dict[prefix + name].to(held.dtype)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)  # then ``settle`` checks and decodes

    def settle(self, dtype: torch.dtype | None) -> None:
        """Decode the Huffman-coded indices the file held, hold the values as stored (whatever
        transformers' loader made of them) and compute in ``dtype``."""
        self.decode_stream()
        self.train_values(False)
        if dtype is not None:
            self.dtype_probe = self.dtype_probe.to(dtype)

    def _apply(self, fn, recurse: bool = True):
        """``.to``, ``.cuda``, ``.half`` and the like, which leave held values in ``codebook_dtype``
        (a float16 codebook of a float32 model stays float16: 2 bytes a value, as stored)."""
        held = {name: t for name in self.VALUES if (t := self._buffers.get(name)) is not None}
        for name in held:  # kept out of ``fn``: float16 -> bfloat16 -> float16 would round them
            self._buffers[name] = None
        try:
            super()._apply(fn, recurse)
        finally:  # to the device ``fn`` moved the probe to (a meta tensor has no values to keep)
            for name, t in held.items():
                self._buffers[name] = fn(t).to(t.dtype) if t.is_meta else t.to(self.dtype_probe.device)
        return self

    @torch.no_grad()
    def train_values(self, train: bool = True) -> list[nn.Parameter]:
        """Make the values float32 parameters that fine-tuning trains (``train``), or hold them
        again as buffers rounded to ``codebook_dtype``, as saving rounds them (not ``train``: how
        a layer is built and loaded). Returns the parameters, those present (none when held)."""
        held = getattr(torch, self.codebook_dtype)
        for name in self.VALUES:
            if name not in self._buffers and name not in self._parameters:
                continue  # no outliers
            t = self._buffers.pop(name) if name in self._buffers else self._parameters.pop(name)
            if t is None:
                self.register_buffer(name, None)
            elif train:
                self.register_parameter(name, nn.Parameter(t.detach().float()))
            else:
                self.register_buffer(name, t.detach().to(held))
        return self.trainable_parameters()

    def decode_stream(self, where: str = "a palettized layer") -> None:
        """Fill ``indices`` from the Huffman-coded stream the file holds (a no-op without one),
        after checking that the stream can be decoded."""
        if self.stream_bytes is not None and not self.huffman_stream.is_meta:
            self.check_stream(where)
            self.indices = pack(torch.from_numpy(huffman_decode(self.huffman())), self.bits).to(self.codebook.device)

    def huffman(self) -> HuffmanStream:
        return HuffmanStream(self.huffman_stream.cpu().numpy(), self.huffman_lengths.cpu().numpy(),
                             self.huffman_blocks.cpu().numpy(), self.num_indices)

    def index_matrix(self) -> torch.Tensor:
        """Cluster indices as an (out, in / cluster_dim) int64 tensor."""
        return unpack(self.indices, self.bits, self.num_indices).view(self.out_features, -1)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` (any shape) of the dense weight, decoding only those rows (an embedding
        lookup in a palettized table): (*ids.shape, in_features). A decode step's few ids are
        decoded as they come, with no data-dependent shapes (so the step can be captured as a
        CUDA graph); longer inputs decode each distinct row once."""
        flat = ids.reshape(-1)
        if flat.numel() <= DECODE_ROWS:
            w = self._codebook_rows(flat)
            if self.outliers:  # every kept-aside weight written to row i where it is in row ids[i], else to a spare column
                pos = self.outlier_index.long()
                at = torch.where(pos // self.in_features == flat[:, None], pos % self.in_features, self.in_features)
                w = F.pad(w, (0, 1)).scatter_(1, at, self.outlier_value.to(w.dtype).expand_as(at))[:, :-1]
            return w.view(*ids.shape, self.in_features)
        uniq, where = torch.unique(flat, return_inverse=True)
        w = self._codebook_rows(uniq)
        if self.outliers:  # the weights kept aside in these rows
            pos = self.outlier_index.long()
            row, col = pos // self.in_features, pos % self.in_features
            at = torch.searchsorted(uniq, row).clamp_max(len(uniq) - 1)
            hit = uniq[at] == row
            w[at[hit], col[hit]] = self.outlier_value[hit].to(w.dtype)
        return w[where].view(*ids.shape, self.in_features)

    def _codebook_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` (1-D) as the codebook (and scales) give them, outliers not applied."""
        cols = self.in_features // self.cluster_dim
        packed = self.indices.view(self.out_features, -1)[ids]  # a row's indices fill whole bytes (cols % 8 == 0)
        idx = unpack(packed.reshape(-1), self.bits, len(ids) * cols).view(len(ids), cols)
        w = self.codebook[ids // self.group_size].gather(1, idx[..., None].expand(-1, -1, self.cluster_dim)).flatten(1)
        w = w.to(self.dtype_probe.dtype)
        return w if self.scale is None else w * self.scale[ids, None].to(w.dtype)

    def dense_weight(self) -> torch.Tensor:
        dtype = self.dtype_probe.dtype
        w = dequantize(self.codebook.to(dtype), self.index_matrix(), self.group_size)
        if self.scale is not None:
            w = w * self.scale.to(dtype)[:, None]
        if not self.outliers:
            return w
        return w.flatten().index_put((self.outlier_index.long(),), self.outlier_value.to(w.dtype)).view_as(w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lut_forward(x)
        if y is None:  # the reference path: materialise the weight
            return F.linear(x, self.dense_weight().to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))
        return y if self.bias is None else y + self.bias

    def kernel_layout(self) -> KernelLayout | None:
        """(indices as the LUT kernel reads them, their width, the outliers' corrections by row, the
        tables), prepared once and kept while indices, codebook and outliers stay the same: the
        stored bytes themselves at 4 and 8 bits and, on a CPU, for pairs of 6-bit indices (width 6),
        re-packed as nibbles (1-3 bits) or bytes (5-7 bits) otherwise; tables (groups, K) for scalar
        codebooks, (groups, K, d) for vectors of d = 2 or 4, of fewer than 16 entries padded to 16
        for nibbles (once, not per call: on a GPU each call's pad was one more kernel launch); for
        scalar tables and byte-indexed pairs on rows of a multiple of 32 weights, the tables rounded
        for the 8-bit kernels too (``round_tables``). None where a row's indices do not fill whole
        bytes or the vectors are longer."""
        d, cols = self.cluster_dim, self.in_features // self.cluster_dim
        if d not in (1, 2, 4) or cols % 2:
            return None
        if torch.compiler.is_compiling():  # a compiled graph reads the layout an eager call prepared (fixed values)
            return getattr(self, "_layout", None)
        # read from the module's dicts, not as attributes: nn.Module's attribute lookup made this check
        # cost more than a small layer's product (it runs on every eager call)
        buffers, value = self._buffers, self._value
        key = [(t.data_ptr(), t._version) for t in (buffers["indices"], value("codebook"))]
        if self.outliers:  # their corrections depend on the codebook and scales (which fine-tuning trains) too
            key += [(t.data_ptr(), t._version) for t in (buffers["outlier_index"], value("outlier_value"),
                                                          value("scale")) if t is not None]
        if getattr(self, "_layout_key", None) != key:
            if self.outliers and bool((buffers["outlier_index"].diff() < 0).any()):  # a folder written unsorted
                self._sort_outliers()
                return self.kernel_layout()
            idx = self.index_matrix()
            stored = self.bits in (4, 8) or (self.bits == 6 and d == 2 and self.in_features % 32 == 0
                                             and self.indices.device.type in SIX_BIT_PAIRS)
            width = self.bits if stored else 4 if self.bits <= 4 else 8
            layout = self.indices if stored else pack(idx, 4) if width == 4 else idx.to(torch.uint8).flatten()
            sparse = None
            if self.outliers:  # the exact weights kept aside: their difference to the codebook value
                pos = self.outlier_index.long()
                row, col = pos // self.in_features, pos % self.in_features
                value = self.outlier_value.float()  # in float32 whatever they are held in: rounded once, below
                exact = value if self.scale is None else value / self.scale[row].float()
                delta = exact - self.codebook[row // self.group_size, idx[row, col // d], col % d].float()  # before scaling
                # float16 errs by at most what storing the exact value in 16 bits did
                delta = delta.to(torch.float32 if self.codebook_dtype == "float32" else torch.float16)
                sparse = SparseRows.from_positions(self.outlier_index, delta.detach(), (self.out_features, self.in_features))
            tables = self.codebook[..., 0] if d == 1 else self.codebook
            if width == 4 and tables.shape[1] < 16:
                tables = F.pad(tables, (0, 0) * (d > 1) + (0, 16 - tables.shape[1]))
            rounded = (round_tables(tables, width) if (width != 4 or d == 1) and self.in_features % 32 == 0
                       and tables.device.type == "cpu" else None)  # only the CPU's 8-bit kernels read them
            self._layout, self._layout_key = KernelLayout(layout, width, sparse, tables.detach().contiguous(), rounded), key
        return self._layout

    @torch.no_grad()
    def _sort_outliers(self) -> None:
        """Order the kept-aside weights by position, in place, so that the kernels read the
        stored positions themselves (``SparseRows``); what the layer computes is unchanged."""
        order = self.outlier_index.argsort()
        self.outlier_index.copy_(self.outlier_index[order])
        self.outlier_value.copy_(self.outlier_value[order])

    def lut_forward(self, x: torch.Tensor) -> torch.Tensor | None:
        """x @ Wᵀ by a registered look-up-table kernel, never forming W; None where it does not apply."""
        fast = KERNELS.get("palettized")
        if fast is None or torch.is_grad_enabled() and (
                x.requires_grad or any(p.requires_grad for p in self.trainable_parameters())):
            return None  # the codebook trains: autograd needs the torch path (and the layout would go stale each step)
        layout = self.kernel_layout()
        if layout is None:
            return None
        return fast(x, layout.indices, layout.width, layout.tables, self.group_size, self.out_features, layout.outliers,
                    layout.rounded, self._value("scale"))

    def _value(self, name: str) -> torch.Tensor | None:
        """A value held (a buffer) or trained (a parameter), read from the module's dicts (cheap)."""
        t = self._buffers.get(name)
        return self._parameters.get(name) if t is None else t

    def trainable_parameters(self) -> list[nn.Parameter]:
        """Fine-tuning a palettized layer trains its centroids (Deep Compression) and the weights
        kept aside (as SpQR and PV-tuning do), and the row scales: all are stored as values, so
        training is free in size. They are parameters only while ``train_values`` made them so."""
        return [p for name in self.VALUES if (p := self._parameters.get(name)) is not None]

    def parameter_count(self) -> int:
        return self.out_features * self.in_features + (self.out_features if self.bias is not None else 0)

    def storage_bits(self) -> int:
        """Bits this layer's indices, codebook, scales and outliers take on disk (what is saved)."""
        index_bytes = (self.huffman_stream.numel() + self.huffman_lengths.numel() + 4 * self.huffman_blocks.numel()
                       if self.stream_bytes is not None else self.indices.numel())
        value_bytes = getattr(torch, self.codebook_dtype).itemsize
        values = self.codebook.numel() + self.outliers + (self.out_features if self.scaled else 0)
        return 8 * (index_bytes + values * value_bytes + 4 * self.outliers)

    def spec(self) -> dict:
        return {"in_features": self.in_features, "out_features": self.out_features, "bits": self.bits,
                "group_size": self.group_size, "cluster_dim": self.cluster_dim, "bias": self.bias is not None,
                "stream_bytes": self.stream_bytes, "conv1d": self.conv1d, "codebook_dtype": self.codebook_dtype,
                "outliers": self.outliers, "scaled": self.scaled}


class NarrowLinear(CompressedLinear):
    """A dense linear stored in fewer bits than float32 (``HalfLinear``, ``Int8Linear``), computed as
    its stored values in the model's dtype. Meant for what every decoded token reads whole, such as
    a tied embedding/head (a fifth of a small model's weights): decoding on CPU multiplies the
    stored values into float32 sums (the form's ``KERNEL`` in ``KERNELS``); elsewhere the weight is
    converted a slice of rows at a time. Its tensors are stored as integers (float16 ones as their
    int16 bits), so ``model.to(dtype)`` leaves them as they are; ``dtype_probe`` (empty, not
    saved) follows ``.to(dtype)`` instead and tells the dtype the layer returns rows and dense
    weights in. A form gives ``from_weight``, ``stored`` and ``decode``."""

    KERNEL: ClassVar[str]

    def __init__(self, in_features: int, out_features: int, bias: bool = False, conv1d: bool = False):
        super().__init__()
        self.in_features, self.out_features, self.conv1d = in_features, out_features, conv1d
        self.register_buffer("dtype_probe", torch.empty(0), persistent=False)
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def stored(self) -> tuple[torch.Tensor, ...]:
        """The stored tensors, as the form's kernel takes them after the input."""
        raise NotImplementedError

    def decode(self, rows: slice | torch.Tensor) -> torch.Tensor:
        """Rows of the weight (a slice, or ids of any shape) in a dtype that holds them exactly."""
        raise NotImplementedError

    def _finish(self, weight: torch.Tensor, bias: torch.Tensor | None) -> NarrowLinear:
        """``from_weight``'s last step: on ``weight``'s device, returning its dtype, with ``bias``."""
        self.to(weight.device)
        self.dtype_probe = self.dtype_probe.to(weight.dtype)
        if bias is not None:
            self.bias = nn.Parameter(bias.detach().clone())
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fast = KERNELS.get(self.KERNEL)
        y = None if fast is None else fast(x, *self.stored(), self.bias)
        if y is not None:
            return y
        # the torch path (prefill, training, GPUs): the weight converted for this call, on CPU a slice of
        # rows at a time that stays in the caches (a head's whole 113 MB float32 copy cost more than its product)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        step = self.out_features if x.device.type != "cpu" else max(1, NARROW_SLICE_BYTES // (4 * self.in_features))
        parts = [F.linear(x, self.decode(slice(r, r + step)).to(x.dtype), None if bias is None else bias[r: r + step])
                 for r in range(0, self.out_features, step)]
        return parts[0] if len(parts) == 1 else torch.cat(parts, -1)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` (any shape) of the weight (an embedding lookup in this table): (*ids.shape, in_features)."""
        return self.decode(ids).to(self.dtype_probe.dtype)

    def settle(self, dtype: torch.dtype | None) -> None:
        if dtype is not None:  # the dtype it returns rows and dense weights in (its stored tensors stay as stored)
            self.dtype_probe = self.dtype_probe.to(dtype)

    def dense_weight(self) -> torch.Tensor:
        return self.decode(slice(None)).to(self.dtype_probe.dtype)

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [] if self.bias is None else [self.bias]  # the weight stays as stored

    def spec(self) -> dict:
        return {"in_features": self.in_features, "out_features": self.out_features, "bias": self.bias is not None,
                "conv1d": self.conv1d}


@register_layer
class HalfLinear(NarrowLinear):
    """A dense linear stored in float16 (``bits16``: its int16 bits): half the bytes of float32, at
    a relative rounding of at most 2^-11 a weight; decoding on CPU: ``KERNELS["half"]``."""

    KERNEL = "half"

    def __init__(self, in_features: int, out_features: int, bias: bool = False, conv1d: bool = False):
        super().__init__(in_features, out_features, bias, conv1d)
        self.register_buffer("bits16", torch.empty(out_features, in_features, dtype=torch.int16))

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None, conv1d: bool = False) -> HalfLinear:
        """The layer for a dense (out, in) ``weight`` (rounded to float16) and ``bias``, in their dtype and device."""
        layer = cls(weight.shape[1], weight.shape[0], bias is not None, conv1d)
        layer.bits16 = weight.detach().to(torch.float16).contiguous().view(torch.int16)
        return layer._finish(weight, bias)

    @property
    def weight16(self) -> torch.Tensor:
        return self.bits16.view(torch.float16)

    def stored(self) -> tuple[torch.Tensor, ...]:
        return (self.weight16,)

    def decode(self, rows: slice | torch.Tensor) -> torch.Tensor:
        return self.weight16[rows]


@register_layer
class Int8Linear(NarrowLinear):
    """A dense linear stored as llama.cpp's Q8_0 stores one: each run of ``INT8_BLOCK`` (32) weights
    of a row as int8 values ``q`` times one float16 scale (``scale_bits``: its int16 bits), the
    run's largest magnitude / 127. 8.5 bits a weight, the rounding at most 1/254 of that largest
    magnitude; decoding on CPU: ``KERNELS["int8"]`` (float32 sums)."""

    KERNEL = "int8"

    def __init__(self, in_features: int, out_features: int, bias: bool = False, conv1d: bool = False):
        super().__init__(in_features, out_features, bias, conv1d)
        self.register_buffer("q", torch.empty(out_features, in_features, dtype=torch.int8))
        self.register_buffer("scale_bits", torch.empty(out_features, in_features // INT8_BLOCK, dtype=torch.int16))

    @classmethod
    def check_spec(cls, **spec) -> str | None:
        if spec["in_features"] % INT8_BLOCK:
            return f"in_features={spec['in_features']} is not a multiple of its {INT8_BLOCK}-weight blocks"
        return super().check_spec(**spec)

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None, conv1d: bool = False) -> Int8Linear:
        """The layer for a dense (out, in) ``weight`` (in a multiple of ``INT8_BLOCK``) and ``bias``, in their dtype and device."""
        out, inp = weight.shape
        blocks = weight.detach().float().reshape(out, inp // INT8_BLOCK, INT8_BLOCK)
        scale = (blocks.abs().amax(-1) / 127).to(torch.float16)  # as stored: the values are rounded against it
        s = scale.float()[..., None]
        layer = cls(inp, out, bias is not None, conv1d)
        layer.q = torch.where(s > 0, blocks / s, 0).round().clamp(-127, 127).to(torch.int8).reshape(out, inp)
        layer.scale_bits = scale.view(torch.int16)
        return layer._finish(weight, bias)

    @property
    def scale16(self) -> torch.Tensor:
        return self.scale_bits.view(torch.float16)

    def stored(self) -> tuple[torch.Tensor, ...]:
        return self.q, self.scale16

    def parameter_count(self) -> int:  # its weights, not also their scales
        return self.out_features * self.in_features + (self.out_features if self.bias is not None else 0)

    def decode(self, rows: slice | torch.Tensor) -> torch.Tensor:
        q = self.q[rows].float()  # exact in float32: 8 significant bits times 11
        return (q.unflatten(-1, (-1, INT8_BLOCK)) * self.scale16[rows].float()[..., None]).flatten(-2)


@register_layer
class PalettizedEmbedding(CompressedLayer, nn.Module):
    """An embedding whose (vocab, hidden) table is a compressed linear with ``rows`` (``table``: a
    ``PalettizedLinear`` or a ``NarrowLinear``): a lookup decodes only the rows it reads. With tied
    embeddings the LM head *is* that table module, so the matrix is stored once and the head's
    matmul runs the table's kernel."""

    CHILDREN = ("table",)

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int | None = None, scale: float = 1.0):
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.padding_idx, self.scale = num_embeddings, embedding_dim, padding_idx, scale
        self.register_module("table", None)  # set by ``around`` or, on loading, by ``build``

    @classmethod
    def around(cls, table: PalettizedLinear | NarrowLinear, embedding: nn.Embedding) -> PalettizedEmbedding:
        new = cls(table.out_features, table.in_features, embedding.padding_idx, float(getattr(embedding, "embed_scale", 1.0)))
        new.table = table
        return new

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = self.table.rows(ids)
        return out if self.scale == 1.0 else out * self.scale  # e.g. Gemma's sqrt(H) embedding scale

    @property
    def weight(self) -> torch.Tensor:
        """The dense table, for code that reads ``get_input_embeddings().weight`` (dtype, device, values)."""
        return self.table.dense_weight()

    def spec(self) -> dict:
        return {"num_embeddings": self.num_embeddings, "embedding_dim": self.embedding_dim,
                "padding_idx": self.padding_idx, "scale": self.scale}

    def to_dense(self) -> nn.Embedding:
        w = self.table.dense_weight().detach()
        emb = nn.Embedding(self.num_embeddings, self.embedding_dim, padding_idx=self.padding_idx, device=w.device,
                           dtype=w.dtype)
        with torch.no_grad():
            emb.weight.copy_(w)
        return emb


@register_layer
class FactorizedEmbedding(CompressedLayer, nn.Module):
    """ALBERT's factorised embedding: lookup in a (V, E) table followed by an (E -> H) projection."""

    CHILDREN = ("embed", "proj")

    def __init__(self, num_embeddings: int, embedding_dim: int, rank: int, padding_idx: int | None = None,
                 scale: float = 1.0):
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.rank, self.scale = num_embeddings, embedding_dim, rank, scale
        self.embed = nn.Embedding(num_embeddings, rank, padding_idx=padding_idx)
        self.proj = nn.Linear(rank, embedding_dim, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = self.proj(self.embed(ids))
        return out if self.scale == 1.0 else out * self.scale  # e.g. Gemma's sqrt(H) embedding scale

    def dense_weight(self) -> torch.Tensor:
        """The (V, H) table (unscaled, as a tied head reads it)."""
        return self.embed.weight @ self.proj.weight.T

    @property
    def weight(self) -> torch.Tensor:
        """Dense table for code that reads ``get_input_embeddings().weight`` (dtype, device, values)."""
        return self.dense_weight()

    def spec(self) -> dict:
        return {"num_embeddings": self.num_embeddings, "embedding_dim": self.embedding_dim, "rank": self.rank,
                "padding_idx": self.embed.padding_idx, "scale": self.scale}

    def to_dense(self) -> nn.Embedding:
        """The dense table; a scale is the model's own (its embedding class applies it on export)."""
        w = self.dense_weight().detach()
        emb = nn.Embedding(self.num_embeddings, self.embedding_dim, padding_idx=self.embed.padding_idx,
                           device=w.device, dtype=w.dtype)
        with torch.no_grad():
            emb.weight.copy_(w)
        return emb

    def trainable_parameters(self) -> list[nn.Parameter]:
        return list(self.parameters())


@register_layer
class FactorizedLMHead(CompressedLinear):
    """LM head tied to a FactorizedEmbedding: logits = h P E^T. Its ``embed`` and ``proj``
    are the embedding's own modules (the same objects), so the factors are stored once."""

    CHILDREN = ("embed", "proj")

    def __init__(self, num_embeddings: int, embedding_dim: int, rank: int, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features, self.rank = embedding_dim, num_embeddings, rank
        self.embed = nn.Embedding(num_embeddings, rank)  # replaced by the embedding's own when built or loaded
        self.proj = nn.Linear(rank, embedding_dim, bias=False)
        self.bias = nn.Parameter(torch.empty(num_embeddings)) if bias else None

    @classmethod
    def tied_to(cls, embedding: FactorizedEmbedding, bias: nn.Parameter | None) -> FactorizedLMHead:
        head = cls(embedding.num_embeddings, embedding.embedding_dim, embedding.rank, bias is not None)
        head.embed, head.proj, head.bias = embedding.embed, embedding.proj, bias
        return head

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(h @ self.proj.weight, self.embed.weight, self.bias)

    def dense_weight(self) -> torch.Tensor:
        return self.embed.weight @ self.proj.weight.T

    def spec(self) -> dict:
        return {"num_embeddings": self.out_features, "embedding_dim": self.in_features, "rank": self.rank,
                "bias": self.bias is not None}


# ----------------------------------------------------------------------------- structure of a model


def _get(root: nn.Module, name: str) -> nn.Module:
    return root.get_submodule(name) if name else root


def _set(root: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(_get(root, parent), leaf, module)


def module_aliases(model: nn.Module) -> dict[str, str]:
    """alias name -> canonical (first) name, for modules reachable under several names."""
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        if any(name.startswith(a + ".") for a in aliases):
            continue  # inside an aliased module: covered by the alias itself
        if id(module) in first:
            aliases[name] = first[id(module)]
        else:
            first[id(module)] = name
    return aliases


def tensor_aliases(model: nn.Module) -> dict[str, str]:
    """alias -> first name of every state-dict entry reached under several names (a module
    shared between layers, an LM head tied to the embedding): the file holds each tensor once."""
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for mname, module in model.named_modules(remove_duplicate=False):
        own = [*module._parameters.items(),
               *((k, b) for k, b in module._buffers.items() if k not in module._non_persistent_buffers_set)]
        for leaf, t in own:
            if t is None:
                continue
            name = f"{mname}.{leaf}" if mname else leaf
            if first.setdefault(id(t), name) != name:
                aliases[name] = first[id(t)]
    return aliases


def describe(model: nn.Module) -> dict:
    """The ``compression`` section of config.json: what ``build`` needs to rebuild ``model``'s
    structure from its base architecture, and which names the file does not hold."""
    aliases = module_aliases(model)
    layers = {name: {"type": type(m).__name__, "spec": m.spec()} for name, m in model.named_modules()
              if type(m).__name__ in LAYERS and name not in aliases}
    return {"format": "wscompress", "version": FORMAT_VERSION, "modules": layers, "module_aliases": aliases,
            "tensor_aliases": tensor_aliases(model), "trains": list(model.__dict__.get("wscompress_trains", []))}


def build(model: nn.Module, compression: dict) -> None:
    """Swap the base model's modules for the compressed layers ``compression`` names (empty
    tensors, to be loaded) and make shared modules shared again. Every name, type, constructor
    argument and alias is checked against the base structure first (``check_entry``,
    ``check_aliases``): a crafted section never reaches a constructor or ``setattr`` unchecked."""
    sections = {"modules": dict, "module_aliases": dict, "tensor_aliases": dict, "trains": list}
    for key, kind in sections.items():
        if not isinstance(compression.get(key, kind()), kind):
            raise corrupt(f"config.json: compression.{key} is not a JSON {'object' if kind is dict else 'array'}")
    for name, entry in compression.get("modules", {}).items():
        parent, leaf, cls = check_entry(model, name, entry)
        setattr(parent, leaf, cls(**entry["spec"]))
    module_aliases = compression.get("module_aliases", {})
    check_aliases(module_aliases, "module_aliases")
    for alias, canonical in module_aliases.items():
        parent, leaf = _slot(model, alias, "module_aliases")
        try:
            target = model.get_submodule(canonical)
        except AttributeError:
            raise corrupt(f"config.json: module_aliases names {canonical!r}, which the model does not have") from None
        setattr(parent, leaf, target)
    tensor_aliases = compression.get("tensor_aliases", {})
    check_aliases(tensor_aliases, "tensor_aliases")
    names = {n for n, _ in model.named_parameters(remove_duplicate=False)} | {n for n, _ in model.named_buffers(remove_duplicate=False)}
    unknown = sorted(n for pair in tensor_aliases.items() for n in pair if n not in names)
    if unknown:
        raise corrupt(f"config.json: tensor_aliases names {unknown[0]!r}, which the model does not have")
    trains = compression.get("trains", [])
    if not all(isinstance(n, str) for n in trains):
        raise corrupt("config.json: compression.trains holds something other than module names")
    model.__dict__["wscompress_trains"] = list(trains)


# ----------------------------------------------------------------------------- checks on what a folder holds

def corrupt(problem: str) -> ValueError:
    """The error for a folder whose contents do not hold together (damaged, or crafted)."""
    return ValueError(f"{problem}; the folder is damaged, or was not written by wscompress: write it again "
                      "(wscompress compress, or wscompress export --format hf)")


_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_]*(\.[A-Za-z0-9][A-Za-z0-9_]*)*")  # module paths; no dunders, no leading _


def _slot(model: nn.Module, name: Any, section: str) -> tuple[nn.Module, str]:
    """(parent, leaf) of an existing module slot ``name`` of ``model``: compression only ever
    replaces modules the base structure has (a slot may hold None: a compressed layer's own
    child, filled next)."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise corrupt(f"config.json: {section} names {name!r}, which is not a module path")
    parent_name, _, leaf = name.rpartition(".")
    try:
        parent = model.get_submodule(parent_name)
    except AttributeError:
        parent = None
    if parent is None or leaf not in parent._modules:
        raise corrupt(f"config.json: {section} names {name!r}, which the base model ({type(model).__name__}) does not have")
    return parent, leaf


def _dense_shape(module: nn.Module | None) -> tuple[int, int] | None:
    """(out, in) of a linear, (rows, width) of an embedding table; None for other modules."""
    if isinstance(module, Conv1D):
        return module.weight.shape[1], module.weight.shape[0]
    if isinstance(module, CompressedLayer):  # a compressed layer's own child slot, filled next (a table)
        return type(module).dense_shape(module.spec())
    if isinstance(module, nn.Linear):
        return module.out_features, module.in_features
    if isinstance(module, nn.Embedding):
        return module.num_embeddings, module.embedding_dim
    return None


def check_entry(model: nn.Module, name: str, entry: Any) -> tuple[nn.Module, str, type]:
    """(parent, leaf, class) of one ``compression.modules`` entry, after checking that its type
    is known, its arguments are those of the class (``ARGUMENTS``) with sane values (``check_spec``)
    and its shape is that of the module it replaces."""
    if not isinstance(entry, dict) or not isinstance(entry.get("spec"), dict):
        raise corrupt(f"config.json: compression.modules[{name!r}] is not {{type, spec}}")
    cls = LAYERS.get(entry.get("type"))  # type: ignore[arg-type]
    if cls is None:
        raise ValueError(f"compressed layer type {entry.get('type')!r} is unknown to this modeling_wscompress.py: "
                         "the folder was written by a newer wscompress; upgrade wscompress (pip install -U "
                         "wscompress), or load the folder with trust_remote_code=True to use the code it carries")
    parent, leaf = _slot(model, name, "compression.modules")
    spec, arguments = entry["spec"], cls.ARGUMENTS
    for key, value in spec.items():
        if key not in arguments or not arguments[key].accepts(value):
            raise corrupt(f"config.json: {name} ({cls.__name__}) has argument {key}={value!r}, which it does not take")
        if type(value) is int and not 0 <= value < 2**40:
            raise corrupt(f"config.json: {name} ({cls.__name__}) has {key}={value}, out of range")
    missing = {key for key, argument in arguments.items() if argument.required} - set(spec)
    problem = f"arguments {sorted(missing)} are missing" if missing else cls.check_spec(**spec)
    shape, slot = cls.dense_shape(spec), parent._modules[leaf]
    expected = _dense_shape(slot if slot is not None else parent)
    if problem is None and expected is not None and shape != expected:
        problem = f"its shape {shape} is not that of the module it replaces {expected}"
    if problem:
        raise corrupt(f"config.json: {name} ({cls.__name__}): {problem}")
    return parent, leaf, cls


def check_aliases(aliases: dict, section: str) -> None:
    """Alias maps are acyclic and name paths: no alias is a canonical name, and no name lies
    inside another (a module aliased to its own child or parent would contain itself)."""
    for alias, canonical in aliases.items():
        for n in (alias, canonical):
            if not isinstance(n, str) or not _NAME.fullmatch(n):
                raise corrupt(f"config.json: {section} names {n!r}, which is not a module or tensor path")
        inside = [a for a in aliases if canonical == a or canonical.startswith(a + ".") or a.startswith(canonical + ".")]
        if inside or alias.startswith(canonical + "."):
            raise corrupt(f"config.json: {section} maps {alias!r} to {canonical!r}, which is itself aliased or contains it "
                          "(a cycle)")


_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                       "BOOL": torch.bool}


def read_header(path: str | os.PathLike) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """name -> (shape, dtype) of a safetensors file, reading only its header, after checking
    that every tensor's bytes lie inside the file (a truncated file is refused here)."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if n < 2 or 8 + n > size:
            raise corrupt(f"{os.fspath(path)}: truncated, or not a safetensors file")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError):
            header = None
    if not isinstance(header, dict):
        raise corrupt(f"{os.fspath(path)}: its safetensors header is not a JSON object")
    body, out = size - 8 - n, {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype = _SAFETENSORS_DTYPES.get(entry.get("dtype")) if isinstance(entry, dict) else None
        shape, offsets = (entry.get("shape"), entry.get("data_offsets")) if isinstance(entry, dict) else (None, None)
        if (dtype is None or not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape)
                or not isinstance(offsets, list) or len(offsets) != 2 or not all(isinstance(o, int) for o in offsets)):
            raise corrupt(f"{os.fspath(path)}: tensor {name!r} has an unreadable header entry")
        if not 0 <= offsets[0] <= offsets[1] <= body or offsets[1] - offsets[0] != math.prod(shape) * dtype.itemsize:
            raise corrupt(f"{os.fspath(path)}: tensor {name!r} lies outside the file (truncated?)")
        out[name] = tuple(shape), dtype
    return out


def expected_tensors(model: nn.Module) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """name -> (shape, dtype) of every state-dict entry of ``model`` (built on the meta device:
    nothing is allocated), aliases included."""
    return {k: (tuple(t.shape), t.dtype) for k, t in model.state_dict().items()}


def check_weight_files(files: list, expected: dict[str, tuple[tuple[int, ...], torch.dtype]],
                       aliases: dict[str, str]) -> None:
    """The weight files hold every expected tensor once (under any name of its alias group:
    transformers' own save may keep another name than the first) and nothing else, with its
    shape, integer tensors in their own dtype and values in a floating one: checked on the
    headers, before anything is allocated for them (absurd shapes never reach an allocation)."""
    found: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for f in files:
        if not os.path.isfile(f):
            raise corrupt(f"weight file {os.fspath(f)} is missing")
        found.update(read_header(f))
    groups: dict[str, list[str]] = {}
    for name in expected:
        groups.setdefault(aliases.get(name, name), []).append(name)
    missing = sorted(c for c, names in groups.items() if not any(n in found for n in names))
    unexpected = sorted(found.keys() - expected.keys())
    if missing or unexpected:
        raise corrupt(f"the weight files do not match config.json's compression section (missing {missing[:3]}, "
                      f"unexpected {unexpected[:3]})")
    for name, (got_shape, got_dtype) in found.items():
        shape, dtype = expected[name]
        if got_shape != shape or (got_dtype != dtype if not dtype.is_floating_point else not got_dtype.is_floating_point):
            raise corrupt(f"tensor {name!r} is {list(got_shape)} {got_dtype} in the weight files, "
                          f"where config.json implies {list(shape)} {dtype}")


def validate(model: nn.Module) -> None:
    """Check the loaded values every kernel will index with (each layer's ``check_values``)."""
    for name, module in model.named_modules():
        if isinstance(module, CompressedLayer):
            module.check_values(name)


def tie(model: nn.Module, aliases: dict[str, str]) -> None:
    """Make every aliased tensor name point at its canonical tensor again (after loading)."""
    for alias, canonical in aliases.items():
        owner, _, leaf = alias.rpartition(".")
        target = model.get_parameter(canonical) if canonical in dict(model.named_parameters()) else model.get_buffer(canonical)
        if getattr(_get(model, owner), leaf) is not target:
            setattr(_get(model, owner), leaf, target)


def settle(model: nn.Module, dtype: torch.dtype | None) -> None:
    """After the tensors are loaded: check them all (``validate``), then let each compressed layer
    settle (``CompressedLayer.settle``: decode what the file held coded, bring values stored in a
    dtype of their own to the one the model computes in, as ``load_state_dict`` does)."""
    validate(model)
    floating = dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else None
    for module in model.modules():
        if isinstance(module, CompressedLayer):
            module.settle(floating)


def weight_files(folder: str | os.PathLike) -> list[str]:
    """The weight files of a compressed folder: one file, or the shards its index names (this
    format's names, else those of format 2 and before)."""
    for index in (SHARD_INDEX, LEGACY_SHARD_INDEX):
        path = os.path.join(folder, index)
        if os.path.isfile(path):
            try:
                with open(path) as f:
                    names = sorted(set(json.load(f)["weight_map"].values()))
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                raise corrupt(f"{path} is not a shard index") from None
            if not all(isinstance(n, str) and n and os.path.basename(n) == n for n in names):
                raise corrupt(f"{path} names a weight file outside the folder")
            return [os.path.join(folder, n) for n in names]
    present = [n for n in (WEIGHTS, LEGACY_WEIGHTS) if os.path.isfile(os.path.join(folder, n))]
    return [os.path.join(folder, (present or [WEIGHTS])[0])]


def legacy_layout(folder: str | os.PathLike) -> bool:
    """Whether a local folder holds its weights under the plain names (format 2 and before)."""
    has = lambda name: os.path.isfile(os.path.join(folder, name))  # noqa: E731
    return not (has(WEIGHTS) or has(SHARD_INDEX)) and (has(LEGACY_WEIGHTS) or has(LEGACY_SHARD_INDEX))


def write_code(folder: str | os.PathLike) -> None:
    """Copy this module into ``folder``, where ``auto_map`` finds it (trust_remote_code)."""
    shutil.copyfile(__file__, os.path.join(folder, CODE_FILE))


# ----------------------------------------------------------------------------- transformers classes

_FAMILY: dict[str, tuple[type, type]] = {}  # base model type -> (config class, model class) made for it


def _stored_dtype(data: dict) -> str | None:
    """The dtype config.json records: ``dtype``, or in format 2 (whose ``dtype`` was a sentence
    that stopped stock classes) ``torch_dtype``."""
    dtype = data.get("dtype")
    if isinstance(dtype, str) and isinstance(getattr(torch, dtype, None), torch.dtype):
        return dtype
    legacy = data.get("torch_dtype")
    return legacy if isinstance(legacy, str) and isinstance(getattr(torch, legacy, None), torch.dtype) else None


def _stale_quantization(quantization: Any) -> bool:
    """Whether a base config's ``quantization_config`` no longer describes the weights: a GGUF
    source's (transformers de-quantizes GGUF weights as it loads them), which would make
    transformers treat the folder as GGUF again (a warning on load, ``save_pretrained`` refused)."""
    return isinstance(quantization, dict) and quantization.get("quant_method") == "gguf"


def writer_version() -> str | None:
    """The installed wscompress's version (None where only this file is: a folder re-saved
    through trust_remote_code), recorded in config.json beside transformers' own."""
    try:
        return importlib.metadata.version("wscompress")
    except importlib.metadata.PackageNotFoundError:
        return None


class WSCompressConfig(PretrainedConfig):
    """``config.json`` of a compressed folder. On disk the base model's config is nested under
    ``base_config`` (so no stock class reads it as its own); in memory a config is an instance of
    a subclass of the base config's class made for it (``family``), so the base model's code
    finds every field it reads, plus ``compression`` (see ``describe``)."""

    model_type = "wscompress"
    base_model_type: ClassVar[str | None] = None  # set on the classes made for each base model type
    base_architecture: ClassVar[str | None] = None
    compression: dict | None = None

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], **kwargs):
        data = dict(config_dict)
        if "base_config" in data:  # config.json's layout
            if not isinstance(data["base_config"], dict) or not isinstance(data.get("compression"), dict):
                raise ValueError("config.json: base_config and compression must be JSON objects; the folder is damaged: "
                                 "write it again with wscompress")
            data = {**data["base_config"], "dtype": _stored_dtype(data), "compression": data["compression"]}
        data.pop("wscompress_version", None)  # the writer's, not this config's: saving records its own
        if _stale_quantization(data.get("quantization_config")):
            del data["quantization_config"]
        base_type = data.pop("model_type", None)
        if base_type in (None, cls.model_type):  # flat, from another config of this family
            base_type = cls.base_model_type
        if base_type is None:
            raise ValueError("a wscompress config needs the base model's type (base_config.model_type)")
        data.pop("auto_map", None)
        config_class = family(base_type)[0]
        return super(WSCompressConfig, config_class).from_dict(data, **kwargs)

    @classmethod
    def wrapping(cls, config: PretrainedConfig, compression: dict) -> WSCompressConfig:
        """A compressed model's config from its base model's (or a compressed one's) config."""
        base_type = getattr(config, "base_model_type", None) or config.model_type
        data = {**config.to_dict(), "model_type": base_type, "compression": compression}
        return family(base_type)[0].from_dict(data)

    def base_config(self) -> PretrainedConfig:
        """The base model's config alone (what a dense export of this model carries)."""
        data = self.to_dict()
        for key in ("compression", "model_type", "auto_map", "architectures"):
            data.pop(key, None)
        return AutoConfig.for_model(self.base_model_type, **data)

    def to_json_string(self, use_diff: bool = True) -> str:
        flat = self.to_diff_dict() if use_diff else self.to_dict()
        compression = flat.pop("compression", None)
        version = flat.pop("transformers_version", None)
        dtype = flat.pop("dtype", None)
        for key in ("model_type", "architectures", "auto_map", "torch_dtype", "wscompress_version"):
            flat.pop(key, None)
        if _stale_quantization(flat.get("quantization_config")):
            del flat["quantization_config"]
        # a plain valid config at both levels (real dtype): readers that only read config.json work
        nested = {"model_type": WSCompressConfig.model_type, "architectures": ["WSCompressForCausalLM"], "auto_map": AUTO_MAP,
                  "dtype": dtype,
                  "base_config": {"model_type": self.base_model_type, "architectures": [self.base_architecture], **flat,
                                  "dtype": dtype},
                  "compression": compression, "transformers_version": version, "wscompress_version": writer_version()}
        return json.dumps(nested, indent=2, sort_keys=False) + "\n"


class WSCompressForCausalLM(PreTrainedModel, GenerationMixin):
    """A causal LM whose layers are stored compressed. ``WSCompressForCausalLM(config)`` and
    ``from_pretrained`` give an instance of the subclass made for the base architecture
    (``WSCompressLlamaForCausalLM`` is a ``LlamaForCausalLM``): the base class builds its
    modules, ``build`` swaps in the compressed layers, transformers loads the tensors."""

    config_class = WSCompressConfig

    def __new__(cls, config: PretrainedConfig | None = None, *args, **kwargs):
        if cls is WSCompressForCausalLM:  # the name config.json gives: become the class of its base architecture
            cls = family(config.base_model_type)[1]
        return super().__new__(cls)

    def __init__(self, config: WSCompressConfig, *args, **kwargs):
        super().__init__(config, *args, **kwargs)  # the base class: its dense modules (empty, on the meta device when loading)
        build(self, config.compression or {})
        self._tied_weights_keys = self.all_tied_weights_keys = self.get_expanded_tied_weights_keys()

    def get_expanded_tied_weights_keys(self, all_submodels: bool = False) -> dict:
        """Every name the file does not hold -> the name it holds (transformers ties them when
        loading, leaves them out when saving), as far as this structure has both names yet."""
        aliases = (self.config.compression or {}).get("tensor_aliases", {})
        names = {n for n, _ in self.named_parameters(remove_duplicate=False)} | {n for n, _ in self.named_buffers(remove_duplicate=False)}
        return {a: c for a, c in aliases.items() if a in names and c in names}

    def get_parameter(self, target: str) -> torch.Tensor:
        """A parameter, or else a buffer of that name: transformers ties names through this, and a
        palettized module shared by several names (the table behind a tied head) has buffers too."""
        try:
            return super().get_parameter(target)
        except AttributeError:
            return self.get_buffer(target)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        if cls is WSCompressForCausalLM:
            config = kwargs.get("config")
            if not isinstance(config, WSCompressConfig):
                hub = {k: kwargs[k] for k in ("cache_dir", "force_download", "local_files_only", "token", "revision",
                                              "subfolder", "proxies") if k in kwargs}
                config = WSCompressConfig.from_pretrained(config or pretrained_model_name_or_path, **hub)
            return family(config.base_model_type)[1].from_pretrained(pretrained_model_name_or_path, *model_args, **kwargs)
        with_info = kwargs.pop("output_loading_info", False)
        folder = os.path.join(os.fspath(pretrained_model_name_or_path), kwargs.get("subfolder") or "")
        if kwargs.get("variant") is None:  # the weights are this format's variant (format 2 and before: plain names)
            kwargs["variant"] = None if legacy_layout(folder) else VARIANT
        if os.path.isdir(folder):  # checked on the headers before transformers allocates anything for them
            config = kwargs.get("config")
            config = config if isinstance(config, WSCompressConfig) else cls.config_class.from_pretrained(folder)
            with torch.device("meta"):
                expected = expected_tensors(cls(config))
            check_weight_files(weight_files(folder), expected, config.compression.get("tensor_aliases", {}))
        model, info = super().from_pretrained(pretrained_model_name_or_path, *model_args, output_loading_info=True, **kwargs)
        wrong = {k: sorted(info[k])[:3] for k in ("missing_keys", "unexpected_keys", "mismatched_keys") if info.get(k)}
        if wrong:  # transformers would fill the gaps with random weights: refuse instead
            raise corrupt(f"{pretrained_model_name_or_path}: the weight files do not match config.json's compression "
                          f"section ({wrong})")
        settle(model, model.config.dtype)
        return (model, info) if with_info else model

    def generate(self, *args, **kwargs):
        """transformers' ``generate``; with wscompress installed, decoding on CPU goes through a
        compiled step kept across processes where it qualifies (``KERNELS["generate"]``)."""
        prepare = KERNELS.get("generate")
        return super().generate(*args, **(kwargs if prepare is None else prepare(self, args, kwargs)))

    def get_compiled_call(self, compile_config):
        """What ``generate`` calls each decoded token when it compiles: wscompress's cached step on
        CPU (``KERNELS["decode_step"]``), transformers' ``torch.compile`` elsewhere."""
        step = KERNELS.get("decode_step")
        call = None if step is None else step(self, compile_config)
        return super().get_compiled_call(compile_config) if call is None else call

    def save_pretrained(self, save_directory, *args, **kwargs) -> None:
        """transformers' save, with the structure described as it is now, the weights as this
        format's variant and this code beside them."""
        adopt(self)  # the structure as it is now
        if kwargs.get("variant") is None:
            kwargs["variant"] = VARIANT
        os.makedirs(save_directory, exist_ok=True)
        if kwargs.get("is_main_process", True):
            write_code(save_directory)  # first: a push_to_hub inside the save uploads it too
        super().save_pretrained(save_directory, *args, **kwargs)


def family(base_type: str) -> tuple[type[WSCompressConfig], type[WSCompressForCausalLM]]:
    """The (config, model) classes of compressed models of one base model type, made once:
    subclasses of the base config and causal-LM classes transformers has for ``base_type``,
    registered with ``AutoModelForCausalLM`` so their configs find them."""
    if base_type not in _FAMILY:
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

        if base_type not in CONFIG_MAPPING:
            raise ValueError(f"the compressed model's base type {base_type!r} is not one this transformers knows: "
                             "upgrade transformers")
        base_config = CONFIG_MAPPING[base_type]
        base_model = MODEL_FOR_CAUSAL_LM_MAPPING[base_config]
        config_class = type(f"WSCompress{base_config.__name__}", (WSCompressConfig, base_config),
                            {"model_type": WSCompressConfig.model_type, "base_model_type": base_type,
                             "base_architecture": base_model.__name__, "__module__": __name__})
        model_class = type(f"WSCompress{base_model.__name__}", (WSCompressForCausalLM, base_model),
                           {"config_class": config_class, "__module__": __name__})
        AutoModelForCausalLM.register(config_class, model_class, exist_ok=True)
        _FAMILY[base_type] = config_class, model_class
    return _FAMILY[base_type]


def adopt(model: nn.Module) -> None:
    """Make a model whose modules were swapped in memory (``wscompress.compress``) an instance of
    its compressed-model class, and its config of the matching config class, describing the
    structure it has now: transformers' own ``save_pretrained`` then writes a compressed folder,
    never a base config over compressed weights."""
    if not isinstance(model, WSCompressForCausalLM):
        config_class, model_class = family(model.config.model_type)
        if not isinstance(model, model_class.__mro__[2]):
            raise ValueError(f"{type(model).__name__} is not the causal LM class transformers has for "
                             f"{model.config.model_type!r} ({model_class.__mro__[2].__name__})")
        model.config.__class__ = config_class  # the same object: every submodule holding it sees the change
        model.config.__dict__.pop("model_type", None)  # a GGUF source's config sets its own: the class says it now
        model.__class__ = model_class
    model.config.compression = describe(model)
    if model.config.dtype is None:  # say it: "auto" would otherwise take the first tensor's, maybe a codebook's float16
        model.config.dtype = model.dtype
    model._tied_weights_keys = model.all_tied_weights_keys = model.get_expanded_tied_weights_keys()


def register() -> None:
    """Let ``AutoConfig``/``AutoModelForCausalLM`` load compressed folders without
    trust_remote_code (wscompress calls this on import)."""
    AutoConfig.register(WSCompressConfig.model_type, WSCompressConfig, exist_ok=True)
