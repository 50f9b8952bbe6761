"""How the 4-bit Triton LUT kernel looks its tables up, timed on LLaMA-7B-sized layers: one
decode-sized product (batch 1, float16), calls replayed from a CUDA graph so the figure is GPU
time, not Python's launches. Rows: cuBLAS on the dense weight; the shipped kernel
(``wscompress/kernels/lut_triton.py``: each row's 16-entry table held in registers, looked up
with ``tl.gather``), best over its candidate launches; and the variant it was chosen against,
a 256-entry table of index pairs per row (one load per byte instead of two lookups). The
shipped kernel's figures in docs/gpu.md (9.7 / 19.1 / 20.2 us on an H200) came from this
comparison. Needs a CUDA GPU.

Usage: python scripts/experiments/bench_lut_variants.py
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from wscompress.kernels import lut_triton

SHAPES = [(4096, 4096), (11008, 4096), (4096, 11008)]  # (out, in) of LLaMA-7B's q/o, gate/up, down


@triton.jit
def _pair_gemv(x_ptr, idx_ptr, pair_ptr, y_ptr, n_out, n_in, k_split, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The rejected variant: pair[row, byte] holds both nibbles' float16 values in one int32."""
    s = tl.program_id(1)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < n_out
    row_bytes = n_in // 2
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, k_split // 2, BLOCK_K // 2):
        j = s * k_split // 2 + k0 + tl.arange(0, BLOCK_K // 2)
        in_range = j < row_bytes
        ok = row_ok[:, None] & in_range[None, :]
        b = tl.load(idx_ptr + rows[:, None] * row_bytes + j[None, :], mask=ok, other=0).to(tl.int32)
        p = tl.load(pair_ptr + rows[:, None] * 256 + b, mask=ok, other=0)
        lo = (p & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        hi = ((p >> 16) & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        xe = tl.load(x_ptr + 2 * j, mask=in_range, other=0.0).to(tl.float32)
        xo = tl.load(x_ptr + 2 * j + 1, mask=in_range, other=0.0).to(tl.float32)
        acc += tl.sum(lo * xe[None, :] + hi * xo[None, :], axis=1)
    tl.store(y_ptr + s * n_out + rows, acc, mask=row_ok)


def graph_us(fn, calls: int = 100) -> float:
    """GPU microseconds per call of ``fn``, best of 5 replays of ``calls`` captured calls."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    best = float("inf")
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) * 1000 / calls)
    return best


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("bench_lut_variants.py times CUDA kernels: run it on a machine with a CUDA GPU")
    dev = torch.device("cuda")
    print("| layer (out x in) | cuBLAS fp16 us | shipped (tables in registers) us | pair table us |")
    print("|---|---|---|---|")
    for out_f, in_f in SHAPES:
        idx = torch.randint(0, 16, (out_f, in_f), device=dev)
        tables = torch.randn(out_f, 16, device=dev).half()
        packed = (idx[:, 0::2] | idx[:, 1::2] << 4).to(torch.uint8).contiguous()
        x = torch.randn(1, in_f, device=dev).half()
        dense = tables.gather(1, idx).contiguous()
        want = x.float() @ dense.float().T
        bits = tables.view(torch.int16).to(torch.int32) & 0xFFFF
        byte = torch.arange(256, device=dev)
        pairs = (bits[:, byte & 15] | (bits[:, byte >> 4] << 16)).contiguous()
        times = {"cublas": graph_us(lambda: torch.nn.functional.linear(x, dense)), "shipped": [], "pairs": []}
        for launch in lut_triton.CANDIDATES:
            k_split = triton.cdiv(triton.cdiv(in_f, launch.split), launch.block_k) * launch.block_k
            split = triton.cdiv(in_f, k_split)
            y = torch.empty(split, out_f, device=dev)

            def pair_run(launch=launch, k_split=k_split, split=split, y=y):
                _pair_gemv[(triton.cdiv(out_f, launch.block_n), split)](
                    x, packed, pairs, y, out_f, in_f, k_split, BLOCK_N=launch.block_n, BLOCK_K=launch.block_k,
                    num_warps=launch.warps)
                return y.sum(0)

            def shipped_run(launch=launch):
                return lut_triton._run(launch, x, packed, 4, tables, 1, out_f, None)

            for name, run in (("shipped", shipped_run), ("pairs", pair_run)):
                torch.testing.assert_close(run().float().view(-1), want.view(-1), rtol=1e-2, atol=1e-1)
                times[name].append(graph_us(run))
        print(f"| {out_f} x {in_f} | {times['cublas']:.1f} | {min(times['shipped']):.1f} | {min(times['pairs']):.1f} |")


if __name__ == "__main__":
    main()
