"""Record: what a second thread adds on this machine, for the two bounds a decode step meets:
torch's float32 matmul (compute: 4096 x 4096 x 512, GFLOP/s) and a read of a 256 MB tensor
(memory, GB/s), at one and two threads taking turns. Behind issue 64's two-thread note
(2026-11-29): whether the two vCPUs are separate cores (the matmul scales ~2x), and the read
bandwidth the palettized products are measured against.

Usage: python scripts/experiments/thread_scaling.py [--rounds 2]
"""
import sys
import time

import torch

rounds = int(sys.argv[sys.argv.index("--rounds") + 1]) if "--rounds" in sys.argv else 2
a, b = torch.randn(4096, 4096), torch.randn(4096, 512)
data = torch.ones(64 * 2**20)  # 256 MB of float32
print("| threads | matmul GFLOP/s | read GB/s |\n|---|---|---|")
for threads in (1, 2) * rounds:
    torch.set_num_threads(threads)
    torch.mm(a, b), data.sum()  # warm-up
    start = time.perf_counter()
    for _ in range(5):
        torch.mm(a, b)
    flops = 5 * 2 * a.shape[0] * a.shape[1] * b.shape[1] / (time.perf_counter() - start)
    start = time.perf_counter()
    for _ in range(5):
        data.sum()
    read = 5 * data.numel() * data.element_size() / (time.perf_counter() - start)
    print(f"| {threads} | {flops / 1e9:.1f} | {read / 1e9:.1f} |", flush=True)
