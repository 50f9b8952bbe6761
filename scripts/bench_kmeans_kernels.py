"""k-means' compiled inner loops (wscompress/kernels/kmeans.cpp) against the torch path, in one
run: the nearest-centroid search and k-means++ seeding on the shapes the shipped recipes' layouts
give SmolLM2's MLP matrices (2-d vectors, 256 centroids a group of 64 rows: 24 groups of 18 432
points; 4-d vectors, one codebook a matrix: 221 184 points). Prints milliseconds (best of
``--rounds``) and the ratio, with the CPU's vector flags.

Usage: python scripts/bench_kmeans_kernels.py [--rounds 5] [--threads 2]
       python scripts/bench_kmeans_kernels.py --dry-run   (toy shapes, one round: the suite runs it)
"""

from __future__ import annotations

import time

import torch

from _common import cpu_line, parse, parser
from wscompress import kernels
from wscompress.maths import clustering

SHAPES = {"2-d, 256 a group of 64 rows (4-bit recipe)": (24, 18432, 256, 2),
          "4-d, 256 a matrix (2-bit recipe)": (1, 221184, 256, 4)}
TOY_SHAPES = {"2-d, 256 a group (toy)": (2, 2048, 256, 2), "4-d, 256 a matrix (toy)": (1, 4096, 256, 4)}


def best_ms(fn, rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main() -> None:
    ap = parser(__doc__, threads=None)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dry-run", action="store_true", help="toy shapes, one round: checks the script in seconds")
    args = parse(ap)
    shapes, rounds = (TOY_SHAPES, 1) if args.dry_run else (SHAPES, args.rounds)
    compiled = kernels.kmeans()
    if compiled is None:
        raise SystemExit(f"the k-means kernels are not available here: {kernels.status()}")
    gen = torch.Generator().manual_seed(0)
    rows = []
    for label, (b, m, k, d) in shapes.items():
        points, weights = torch.randn(b, m, d, generator=gen), torch.rand(b, m, generator=gen)
        centroids = clustering._kmeans_pp(points, weights, k, torch.Generator().manual_seed(1))
        jobs = {"nearest centroid": lambda: clustering._nearest(points, centroids, distances=True),
                "k-means++ seeding": lambda: clustering._kmeans_pp(points, weights, k, torch.Generator().manual_seed(1))}
        for job, fn in jobs.items():
            fast = best_ms(fn, rounds)
            kernels.kmeans = lambda: None  # the torch path
            slow = best_ms(fn, rounds)
            kernels.kmeans = lambda: compiled
            rows.append((label, job, slow, fast))
    print(f"{torch.get_num_threads()} thread(s), best of {rounds}; CPU: {cpu_line()}\n")
    print("| layout | loop | torch ms | compiled ms | x faster |\n|---|---|---|---|---|")
    for label, job, slow, fast in rows:
        print(f"| {label} | {job} | {slow:.1f} | {fast:.1f} | {slow / fast:.1f} |")


if __name__ == "__main__":
    main()
