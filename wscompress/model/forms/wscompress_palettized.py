"""Palettized layers: weights stored as packed cluster indices into codebooks (k-means), with
Huffman-coded indices, weights kept aside (outliers) and row scales as options, and the layout
the look-up-table kernels read. Travels with the folders that use it (``wscompress_format``)."""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Literal, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .wscompress_format import DECODE_ROWS, KERNELS, CompressedLinear, corrupt, register_layer

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
    KERNEL = "palettized"
    TORCH_PATH = "weight materialised per forward (torch)"

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
        fast = KERNELS.get(self.KERNEL)
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


