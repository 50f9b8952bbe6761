"""Calibration's bfloat16 kernels against the paths they replace, on SmolLM2-135M's shapes
(a batch of 8 x 512 tokens): a Gram matrix XᵀX (`kernels/products.cpp` vs OpenBLAS's `ssyrk`
on the batch cast to float32, both into a float64 sum as `linalg.add_gram` keeps it), a cross
product XᵀY (vs torch's float32 matmul) and an RMSNorm (`kernels/norms.cpp` vs transformers'
LlamaRMSNorm). Prints a table of milliseconds a call (median of `--rounds`).

Usage: python scripts/bench_calibration_kernels.py [--rounds 20]
       python scripts/bench_calibration_kernels.py --dry-run   (256 tokens, one round: the suite runs it)
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Callable

# OpenBLAS's threads sleep between calls, as in the wscompress command's process (io.memory.idle_blas_threads,
# which importing wscompress no longer does): read when scipy loads OpenBLAS, so before any import loads it
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")

import torch  # noqa: E402
from scipy.linalg.blas import ssyrk  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaRMSNorm  # noqa: E402

from _common import parser  # noqa: E402
from wscompress import kernels  # noqa: E402


def median_ms(fn: Callable[[], object], rounds: int) -> float:
    fn()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def blas_gram(acc: torch.Tensor, x: torch.Tensor) -> None:
    part = torch.zeros_like(acc, dtype=torch.float32)
    ssyrk(1.0, x.float().numpy().T, beta=0.0, c=part.numpy().T, overwrite_c=1)
    acc.add_(part)


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--dry-run", action="store_true", help="256 tokens, one round: checks the script in seconds")
    args = ap.parse_args()
    rounds, tokens = (1, 256) if args.dry_run else (args.rounds, 4096)  # 4096: a batch of 8 x 512
    products, norms = kernels.products(), kernels.norms()
    if products is None or norms is None:
        raise SystemExit(f"the kernels are not available here: {kernels.calibration_status()}")
    torch.manual_seed(0)
    rows = []
    for d in (576, 1536):  # attention / MLP input, down-projection input
        x, acc = torch.randn(tokens, d).bfloat16(), torch.zeros(d, d, dtype=torch.float64)
        rows.append((f"Gram {d}x{d}", median_ms(lambda: blas_gram(acc, x), rounds),
                     median_ms(lambda: products.add_gram(acc, x), rounds)))
    x, y = torch.randn(tokens, 576).bfloat16(), torch.randn(tokens, 1536).bfloat16()
    acc = torch.zeros(576, 1536, dtype=torch.float64)
    rows.append(("cross 576x1536", median_ms(lambda: acc.add_(x.float().T @ y.float()), rounds),
                 median_ms(lambda: products.add_product(acc, x, y), rounds)))
    norm, h = LlamaRMSNorm(576).bfloat16(), torch.randn(tokens // 512 or 1, min(tokens, 512), 576).bfloat16()
    with torch.no_grad():
        rows.append((f"RMSNorm {'x'.join(map(str, h.shape))}", median_ms(lambda: norm(h), rounds),
                     median_ms(lambda: norms.rms_norm(h, norm.weight, norm.variance_epsilon), rounds)))
    print(f"{torch.get_num_threads()} threads, median of {rounds} calls")
    print("| operation | before (ms) | kernel (ms) | speed-up |\n|---|---|---|---|")
    for name, before, after in rows:
        print(f"| {name} | {before:.2f} | {after:.2f} | {before / after:.1f}x |")


if __name__ == "__main__":
    main()
