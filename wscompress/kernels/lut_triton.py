"""Look-up-table matrix-vector product for palettized weights on CUDA, in Triton: the GPU twin
of ``lut.cpp``'s decoding path. Each program owns a block of output rows and walks the input
in steps: it reads the packed indices (half a byte a weight at 4 bits), looks each one up in
its row group's table (small enough to stay in cache) and accumulates in float32, so the dense
weight is never formed and decoding reads a quarter of the bytes a float16 weight takes.

Imported only where Triton is installed; with ``TRITON_INTERPRET=1`` it runs on CPU tensors,
which is how the tests check it on machines without a GPU.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# Rows per program x inputs per step: few rows give more programs on small layers, long steps
# fewer loop trips on wide ones. The best depends on the GPU and the layer's shape, so the first
# call at each shape times these on the user's GPU (Triton's autotuner) and keeps the fastest.
# The interpreter (tests, on CPU) runs the first only: it has nothing to time.
CONFIGS = [triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w)
           for n, k, w in [(32, 256, 4), (8, 256, 2), (16, 256, 4), (16, 512, 4), (64, 128, 4), (32, 512, 8)]]


@triton.autotune(configs=CONFIGS[:1] if os.environ.get("TRITON_INTERPRET") == "1" else CONFIGS,
                 key=["n_out", "n_in", "WIDTH"])
@triton.jit
def _lut_gemv(x_ptr, idx_ptr, tab_ptr, y_ptr, n_out, n_in, group_size, table_len,
              WIDTH: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """y[m, rows] = sum_k tables[row // group_size, idx[row, k]] * x[m, k]; grid (row blocks, m)."""
    m = tl.program_id(1).to(tl.int64)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < n_out
    table = tab_ptr + (rows // group_size) * table_len
    x_row = x_ptr + m * n_in
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    if WIDTH == 4:  # two indices a byte, the even input in the low nibble
        row_bytes = n_in // 2
        for k0 in range(0, row_bytes, BLOCK_K // 2):
            j = k0 + tl.arange(0, BLOCK_K // 2)
            ok = row_ok[:, None] & (j < row_bytes)[None, :]
            b = tl.load(idx_ptr + rows[:, None] * row_bytes + j[None, :], mask=ok, other=0).to(tl.int32)
            lo = tl.load(table[:, None] + (b & 15), mask=ok, other=0.0).to(tl.float32)
            hi = tl.load(table[:, None] + (b >> 4), mask=ok, other=0.0).to(tl.float32)
            xe = tl.load(x_row + 2 * j, mask=j < row_bytes, other=0.0).to(tl.float32)
            xo = tl.load(x_row + 2 * j + 1, mask=j < row_bytes, other=0.0).to(tl.float32)
            acc += tl.sum(lo * xe[None, :] + hi * xo[None, :], axis=1)
    else:  # one index a byte
        for k0 in range(0, n_in, BLOCK_K):
            j = k0 + tl.arange(0, BLOCK_K)
            ok = row_ok[:, None] & (j < n_in)[None, :]
            b = tl.load(idx_ptr + rows[:, None] * n_in + j[None, :], mask=ok, other=0).to(tl.int32)
            w = tl.load(table[:, None] + b, mask=ok, other=0.0).to(tl.float32)
            xv = tl.load(x_row + j, mask=j < n_in, other=0.0).to(tl.float32)
            acc += tl.sum(w * xv[None, :], axis=1)
    tl.store(y_ptr + m * n_out + rows, acc.to(y_ptr.dtype.element_ty), mask=row_ok)


def lut_linear(x: torch.Tensor, indices: torch.Tensor, width: int, tables: torch.Tensor, group_size: int,
               out_features: int) -> torch.Tensor:
    """x (rows, in) @ Wᵀ for the palettized W that ``indices`` (``width`` 4 or 8, as
    ``kernels.palettized_linear`` takes them) and ``tables`` (groups, K) describe, in x's dtype."""
    rows, n_in = x.shape
    y = torch.empty(rows, out_features, dtype=x.dtype, device=x.device)
    grid = lambda meta: (triton.cdiv(out_features, meta["BLOCK_N"]), rows)  # noqa: E731 - Triton's grid form
    _lut_gemv[grid](x, indices, tables, y, out_features, n_in, group_size, tables.shape[1], WIDTH=width)
    return y
