"""Matmul speed by dtype on the shapes calibration runs (one batch of 8 x 512 tokens through
SmolLM2-135M's projections), to see what `calibration.dtype: auto` buys on this machine:
bfloat16 is only worth it where the hardware multiplies it (``model.native_bfloat16``).

Usage: python scripts/experiments/bench_matmul_dtype.py [--tokens 4096] [--repeats 20]
"""

from __future__ import annotations

import argparse
import time

import torch

from wscompress.io.hardware import native_bfloat16

SHAPES = {"q/o (576 -> 576)": (576, 576), "k/v (576 -> 192)": (576, 192),
          "gate/up (576 -> 1536)": (576, 1536), "down (1536 -> 576)": (1536, 576)}


def gflops(tokens: int, d_in: int, d_out: int, dtype: torch.dtype, repeats: int) -> float:
    x, w = torch.randn(tokens, d_in).to(dtype), torch.randn(d_out, d_in).to(dtype)
    for _ in range(3):  # warm-up: oneDNN picks and caches its kernel
        x @ w.T
    start = time.perf_counter()
    for _ in range(repeats):
        x @ w.T
    return 2 * tokens * d_in * d_out * repeats / (time.perf_counter() - start) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    dtypes = [torch.float32, torch.bfloat16, torch.float16]
    print(f"{torch.get_num_threads()} threads; native bfloat16: {native_bfloat16(torch.device('cpu'))}\n")
    print("| shape | " + " | ".join(f"{str(d).removeprefix('torch.')} GFLOP/s" for d in dtypes) + " | bfloat16 / float32 |")
    print("|---|" + "---|" * (len(dtypes) + 1))
    for label, (d_in, d_out) in SHAPES.items():
        speed = [gflops(args.tokens, d_in, d_out, d, args.repeats) for d in dtypes]
        print(f"| {label} | " + " | ".join(f"{s:.0f}" for s in speed) + f" | {speed[1] / speed[0]:.2f}x |")


if __name__ == "__main__":
    main()
