"""Compact storage of cluster indices: fixed-width bit-packing and Huffman coding.

``pack``/``unpack`` store integers in [0, 2^bits) at exactly ``bits`` bits each (8 values in
``bits`` bytes), for any width 1-8, on any device. ``huffman_encode``/``huffman_decode``
entropy-code a symbol stream with a canonical Huffman code; the stream is cut into blocks of
``BLOCK`` symbols whose bit lengths are stored, so decoding runs all blocks in parallel
(vectorised numpy) instead of one symbol at a time. Both round-trip exactly.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

import numpy as np
import torch

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
    groups = torch.nn.functional.pad(flat, (0, (-flat.numel()) % 8)).view(-1, 8)
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
    """Inverse of ``huffman_encode``: the symbols as int64."""
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
