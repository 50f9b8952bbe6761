"""What OpenBLAS's spinning threads cost the layer forwards between two Gram updates: a bfloat16
linear and a float32 symmetric product (`ssyrk`, as `linalg.add_gram` forms a bfloat16 batch's
Gram matrix) in turn, with OpenBLAS's default thread timeout and with the one `import wscompress` sets
(`memory.idle_blas_threads`). Each setting runs in its own process, since OpenBLAS reads it
when it loads.

Usage: python scripts/experiments/bench_blas_threads.py [--rounds 40]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

CHILD = """
import sys, time, torch
import torch.nn.functional as F
from scipy.linalg.blas import ssyrk
torch.manual_seed(0)
x, w = torch.randn(4096, 576).bfloat16(), torch.randn(1536, 576).bfloat16()  # SmolLM2's up projection
h, w2 = torch.randn(4096, 1536).bfloat16(), torch.randn(576, 1536).bfloat16()  # and its down projection
linear = gram = 0.0
rounds = int(sys.argv[1])
for i in range(rounds + 5):  # 5 warm-up rounds
    a = time.perf_counter()
    F.linear(x, w), F.linear(h, w2)
    b = time.perf_counter()
    for t in (x, h):
        ssyrk(1.0, t.float().numpy().T)
    c = time.perf_counter()
    if i >= 5:
        linear, gram = linear + b - a, gram + c - b
print(linear / rounds * 1e3, gram / rounds * 1e3)
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=40)
    args = ap.parse_args()
    print("| OpenBLAS thread timeout | two linears, ms | two Gram updates, ms |")
    print("|---|---|---|")
    for label, timeout in (("default (2^28 cycles)", None), ("4 (2^4 cycles, the CLI's)", "4")):
        env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_THREAD_TIMEOUT"}
        if timeout:
            env["OPENBLAS_THREAD_TIMEOUT"] = timeout
        out = subprocess.run([sys.executable, "-c", CHILD, str(args.rounds)], env=env, capture_output=True,
                             text=True, check=True).stdout.split()
        print(f"| {label} | {float(out[0]):.1f} | {float(out[1]):.1f} |")


if __name__ == "__main__":
    main()
