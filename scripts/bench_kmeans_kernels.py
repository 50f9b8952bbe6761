"""k-means' compiled inner loops (wscompress/kernels/kmeans.cpp) against the torch path, in one
run: the nearest-centroid search and k-means++ seeding on the shapes the shipped recipes' layouts
give SmolLM2's MLP matrices (2-d vectors, 256 centroids a group of 64 rows: 24 groups of 18 432
points; 4-d vectors, one codebook a matrix: 221 184 points). Prints milliseconds (best of
``--rounds``) and the ratio, with the CPU's vector flags.

Usage: python scripts/bench_kmeans_kernels.py [--rounds 5] [--threads 2]
"""

from __future__ import annotations

import argparse
import time

import torch

from wscompress import kernels
from wscompress.io.hardware import cpu_flags
from wscompress.maths import clustering

SHAPES = {"2-d, 256 a group of 64 rows (4-bit recipe)": (24, 18432, 256, 2),
          "4-d, 256 a matrix (2-bit recipe)": (1, 221184, 256, 4)}


def best_ms(fn, rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    compiled = kernels.kmeans()
    if compiled is None:
        raise SystemExit(f"the k-means kernels are not available here: {kernels.status()}")
    gen = torch.Generator().manual_seed(0)
    rows = []
    for label, (b, m, k, d) in SHAPES.items():
        points, weights = torch.randn(b, m, d, generator=gen), torch.rand(b, m, generator=gen)
        centroids = clustering._kmeans_pp(points, weights, k, torch.Generator().manual_seed(1))
        jobs = {"nearest centroid": lambda: clustering._nearest(points, centroids, distances=True),
                "k-means++ seeding": lambda: clustering._kmeans_pp(points, weights, k, torch.Generator().manual_seed(1))}
        for job, fn in jobs.items():
            fast = best_ms(fn, args.rounds)
            kernels.kmeans = lambda: None  # the torch path
            slow = best_ms(fn, args.rounds)
            kernels.kmeans = lambda: compiled
            rows.append((label, job, slow, fast))
    flags = " ".join(sorted(f for f in cpu_flags() if f.startswith(("avx", "fma"))))
    print(f"{args.threads} thread(s), best of {args.rounds}; CPU flags: {flags}\n")
    print("| layout | loop | torch ms | compiled ms | x faster |\n|---|---|---|---|---|")
    for label, job, slow, fast in rows:
        print(f"| {label} | {job} | {slow:.1f} | {fast:.1f} | {slow / fast:.1f} |")


if __name__ == "__main__":
    main()
