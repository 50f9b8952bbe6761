"""Look-up-table matrix-vector product for palettized weights on CUDA, in Triton: the GPU twin
of ``lut.cpp``'s decoding path. Each program owns a block of output rows and a stretch of the
input: it reads the packed indices (half a byte a weight at 4 bits), looks each one up in its
row group's table and accumulates in float32, so the dense weight is never formed and decoding
reads a quarter of the bytes a float16 weight takes. The tables:
- 16 entries at 4 bits, held in registers.
- Up to 256 at 8 bits, each entry a weight or a vector of 2 or 4 (the shipped recipes' pairs
  and fours; a float16 vector is one integer, read with one load). They are read through the
  cache, or, where a program's rows share one table, gathered from a copy the program holds.
The weights kept aside from the codebook (outliers, by row) are added by the programs of the
first stretch while their sums are in registers, as the CPU kernel does, and the row scales
multiply the sums before they are stored.

A decode-sized product has few output rows for a GPU: one program per row block would leave
most of it idle while each program walks the whole input with one dependent load after another.
So the input is also split into a few stretches whose partial sums are added afterwards (in a
fixed order: results do not depend on scheduling). Which blocking and split is fastest depends
on the GPU and the shape; the first call at a shape times a few (``_pick``) and later calls
launch the kernel straight away, without an autotuner's per-call dispatch.

Imported only where Triton is installed; with ``TRITON_INTERPRET=1`` it runs on CPU tensors,
which is how the tests check it on machines without a GPU.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.testing import do_bench


class Launch(NamedTuple):
    """One way to run the kernel: rows per program, inputs per step, warps, input stretches, and
    whether a program holds its rows' one table and gathers from it (``shared``) instead of
    loading each look-up through the cache."""
    block_n: int
    block_k: int
    warps: int
    split: int
    shared: bool = False


# Few rows per program give more programs; longer steps fewer loop trips; splits more programs
# still, at one extra reduction. The interpreter (tests, on CPU) has nothing to time and runs
# the ones ``_pick`` gives it (unsplit, split, and a shared table where one applies).
CANDIDATES = [Launch(n, k, w, s) for n, k, w in [(32, 256, 4), (16, 256, 4), (8, 256, 2), (16, 512, 4), (64, 128, 4)]
              for s in (1, 2, 4, 8)]
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
_picked: dict[tuple, Launch] = {}
PACK = {2: torch.int16, 4: torch.int32, 8: torch.int64}  # a vector of this many bytes read as one integer
TL_FLOAT = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def launches(width: int, tables: torch.Tensor, group_size: int) -> list[Launch]:
    """The candidates for this layout: CANDIDATES, and at width 8 where a program's rows all read
    one table (row blocks within a group) held as one value a look-up (scalars or packed
    vectors), each of them again with that table gathered from (``shared``): a 256-entry table
    read through the cache costs a transaction per distinct line a warp touches, and which way
    wins is the GPU's to say."""
    one_value = _vector_len(tables) == 1 or _packed(tables)
    return CANDIDATES + [c._replace(shared=True) for c in CANDIDATES
                         if width == 8 and one_value and group_size % c.block_n == 0]


def _vector_len(tables: torch.Tensor) -> int:
    """Weights an index names: 1 for scalar tables (groups, K), d for vectors (groups, K, d)."""
    return tables.shape[2] if tables.dim() == 3 else 1


def _packed(tables: torch.Tensor) -> bool:
    """Whether a vector table's entries are read as one integer each (2 or 4 floats of 16 or 32 bits)."""
    return tables.dim() == 3 and tables.dtype in TL_FLOAT and tables.shape[2] * tables.dtype.itemsize in (4, 8)


@triton.jit
def _lut_gemv(x_ptr, idx_ptr, tab_ptr, y_ptr, row_ptr, out_pos, out_delta, scale_ptr, n_out, n_in, group_size,
              k_split, WIDTH: tl.constexpr, D: tl.constexpr, PACKED: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr, OUTLIERS: tl.constexpr, SCALED: tl.constexpr, SHARED: tl.constexpr,
              TABLE: tl.constexpr):
    """y[s, m, rows] = scale[rows] * (sum over stretch s of tables[row // group_size, idx[row, k]] * x[m, k]
    (+ the outliers of these rows in stretch 0)); grid (row blocks, stretches, m). At width 8 an
    index names a vector of D consecutive weights; PACKED (a float type) says the table holds a
    vector as one integer of D such floats, read with one load; TABLE is the values a table
    holds; SHARED says the program's rows share one table, which it loads once and gathers from."""
    m = tl.program_id(2).to(tl.int64)
    s = tl.program_id(1)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < n_out
    table = tab_ptr + (rows // group_size) * TABLE
    x_row = x_ptr + m * n_in
    k_lo = s * k_split  # every stretch takes the same trips; the last one's past n_in are masked
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    if WIDTH == 4:  # two indices a byte, the even input in the low nibble (k_split is even)
        # the rows' 16-entry tables live in registers: a look-up gathers among them instead of
        # issuing a load per weight (on an H200, 7B-sized layers: 13.5-34.7 -> 9.7-20.2 us a call)
        tab = tl.load(table[:, None] + tl.arange(0, 16)[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
        row_bytes = n_in // 2
        for k0 in range(0, k_split // 2, BLOCK_K // 2):
            j = k_lo // 2 + k0 + tl.arange(0, BLOCK_K // 2)
            in_range = j < row_bytes
            ok = row_ok[:, None] & in_range[None, :]
            b = tl.load(idx_ptr + rows[:, None] * row_bytes + j[None, :], mask=ok, other=0).to(tl.int32)
            lo = tl.gather(tab, b & 15, axis=1)
            hi = tl.gather(tab, b >> 4, axis=1)
            xe = tl.load(x_row + 2 * j, mask=in_range, other=0.0).to(tl.float32)
            xo = tl.load(x_row + 2 * j + 1, mask=in_range, other=0.0).to(tl.float32)
            acc += tl.sum(lo * xe[None, :] + hi * xo[None, :], axis=1)
    else:  # one index a byte, naming a vector of D weights: a step covers BLOCK_K inputs, BLOCK_K // D indices
        n_vec = n_in // D
        if SHARED:  # the block's rows lie in one group (group_size % BLOCK_N == 0)
            shared = tl.load(tab_ptr + (tl.program_id(0).to(tl.int64) * BLOCK_N // group_size) * TABLE
                             + tl.arange(0, TABLE))
        for k0 in range(0, k_split // D, BLOCK_K // D):
            j = k_lo // D + k0 + tl.arange(0, BLOCK_K // D)
            in_range = j < n_vec
            ok = row_ok[:, None] & in_range[None, :]
            b = tl.load(idx_ptr + rows[:, None] * n_vec + j[None, :], mask=ok, other=0).to(tl.int32)
            if SHARED:
                v = tl.reshape(tl.gather(shared, tl.reshape(b, [BLOCK_N * (BLOCK_K // D)]), 0), [BLOCK_N, BLOCK_K // D])
            elif PACKED is not None or D == 1:
                v = tl.load(table[:, None] + b, mask=ok, other=0)
            if PACKED is not None:  # the vector in one look-up (the look-ups, not the bytes, bound this loop)
                bits: tl.constexpr = PACKED.primitive_bitwidth
                for c in tl.static_range(D):
                    part = ((v >> (c * bits)) & ((1 << bits) - 1)).to(tl.int16 if bits == 16 else tl.int32)
                    w = part.to(PACKED, bitcast=True).to(tl.float32)
                    xv = tl.load(x_row + j * D + c, mask=in_range, other=0.0).to(tl.float32)
                    acc += tl.sum(w * xv[None, :], axis=1)
            elif D == 1:
                xv = tl.load(x_row + j, mask=in_range, other=0.0).to(tl.float32)
                acc += tl.sum(v.to(tl.float32) * xv[None, :], axis=1)
            else:  # vectors of more bytes than an integer: a load a component
                for c in tl.static_range(D):
                    w = tl.load(table[:, None] + b * D + c, mask=ok, other=0.0).to(tl.float32)
                    xv = tl.load(x_row + j * D + c, mask=in_range, other=0.0).to(tl.float32)
                    acc += tl.sum(w * xv[None, :], axis=1)
    if OUTLIERS:
        if s == 0:  # a row block's outliers are one contiguous run of the CSR arrays
            first = tl.load(row_ptr + rows, mask=row_ok, other=0)
            last = tl.load(row_ptr + rows + 1, mask=row_ok, other=0)
            start = tl.load(row_ptr + tl.program_id(0).to(tl.int64) * BLOCK_N)
            end = tl.load(row_ptr + tl.minimum(tl.program_id(0).to(tl.int64) * BLOCK_N + BLOCK_N, n_out))
            for e0 in range(start, end, 64):
                e = e0 + tl.arange(0, 64)
                e_ok = e < end
                col = tl.load(out_pos + e, mask=e_ok, other=0).to(tl.int64) % n_in  # flat positions
                part = (tl.load(out_delta + e, mask=e_ok, other=0.0).to(tl.float32)
                        * tl.load(x_row + col, mask=e_ok, other=0.0).to(tl.float32))
                mine = (e[None, :] >= first[:, None]) & (e[None, :] < last[:, None])
                acc += tl.sum(tl.where(mine, part[None, :], 0.0), axis=1)
    if SCALED:  # the row scales, here rather than as one more kernel after this one (each launch costs ~2 us)
        acc *= tl.load(scale_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + (s * tl.num_programs(2) + m) * n_out + rows, acc.to(y_ptr.dtype.element_ty), mask=row_ok)


def _run(launch: Launch, x: torch.Tensor, indices: torch.Tensor, width: int, tables: torch.Tensor, group_size: int,
         out_features: int, outliers, scale: torch.Tensor | None = None) -> torch.Tensor:
    rows, n_in = x.shape
    d = _vector_len(tables)
    packed = _packed(tables)
    flat = tables.reshape(tables.shape[0], -1)
    if packed:  # (groups, K) integers, each a vector of d floats
        flat = flat.view(PACK[d * tables.dtype.itemsize])
    # each stretch a whole number of steps, so no step straddles two stretches
    k_split = triton.cdiv(triton.cdiv(n_in, launch.split), launch.block_k) * launch.block_k
    split = triton.cdiv(n_in, k_split)
    y = torch.empty(split, rows, out_features, dtype=x.dtype if split == 1 else torch.float32, device=x.device)
    row_ptr, pos, delta = outliers if outliers is not None else (y, y, y)  # unused pointers when there are none
    _lut_gemv[(triton.cdiv(out_features, launch.block_n), split, rows)](
        x, indices, flat, y, row_ptr, pos, delta, y if scale is None else scale, out_features, n_in, group_size,
        k_split, WIDTH=width, D=d, PACKED=TL_FLOAT[tables.dtype] if packed else None,
        BLOCK_N=launch.block_n, BLOCK_K=launch.block_k, OUTLIERS=outliers is not None, SCALED=scale is not None,
        SHARED=launch.shared, TABLE=flat.shape[1], num_warps=launch.warps)
    return y[0] if split == 1 else y.sum(0).to(x.dtype)


def _pick(x: torch.Tensor, indices: torch.Tensor, width: int, tables: torch.Tensor, group_size: int,
          out_features: int, outliers, scale: torch.Tensor | None) -> Launch:
    """The fastest candidate at this shape on this GPU, timed once (Triton's ``do_bench``:
    GPU time, cache flushed between runs) and remembered for the process."""
    key = (x.device, x.dtype, x.shape, out_features, width, group_size, tables.shape[1:], tables.dtype,
           outliers is not None, scale is not None)
    if key not in _picked:
        options = launches(width, tables, group_size)
        if INTERPRETED:  # odd rows unsplit (from the shared table where it applies), even rows split: every path
            unsplit = options[-1]._replace(split=1) if options[-1].shared else CANDIDATES[0]
            _picked[key] = unsplit if x.shape[0] % 2 else CANDIDATES[1]
        else:
            useful = [c for c in options if c.split == 1 or x.shape[1] >= 2 * c.split * c.block_k]
            times = [do_bench(lambda c=c: _run(c, x, indices, width, tables, group_size, out_features, outliers, scale),
                              warmup=2, rep=10) for c in useful]
            _picked[key] = useful[min(range(len(useful)), key=times.__getitem__)]
    return _picked[key]


def lut_linear(x: torch.Tensor, indices: torch.Tensor, width: int, tables: torch.Tensor, group_size: int,
               out_features: int, outliers: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
               scale: torch.Tensor | None = None) -> torch.Tensor:
    """x (rows, in) @ Wᵀ for the palettized W that ``indices`` (``width`` 4 or 8, as
    ``kernels.palettized_linear`` takes them) and ``tables`` (groups, K) or, at width 8, vectors
    (groups, K, d) describe, plus the ``outliers``' corrections (``SparseRows``: CSR by row,
    flat positions int32, delta float16 or float32), times the row ``scale`` where given, in x's dtype.
    The first call at a shape times the candidate launches; call it once before capturing a CUDA graph."""
    launch = _pick(x, indices, width, tables, group_size, out_features, outliers, scale)
    return _run(launch, x, indices, width, tables, group_size, out_features, outliers, scale)
