"""Record: what bounds decoding on two threads here, and what an eager call adds around its
operator (issue 64, 2026-11-29, night; docs/runtime.md's goals):

1. memory: a read of 1 GiB (two tensors in turn, larger than the L3) at one and two threads;
2. per call: a 576 x 576 product in the 4-bit recipe's layout as the bare operator and through
   the module (random values: speed does not depend on them), one thread;
3. ``--wait-policy``: the TinyLlama-shape 4-bit recipe model's eager decode step on two
   threads, one process per ``OMP_WAIT_POLICY`` (unset, PASSIVE, ACTIVE): with PASSIVE each
   product wakes the sleeping thread.

Usage: python scripts/experiments/two_threads_and_calls.py [--wait-policy]
"""
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_runtime import MODELS, best_seconds, random_layout, random_palettized  # noqa: E402

CPU = torch.device("cpu")

LAYOUT = "configs/kmeans_4bit.yaml layout + int8 tied embedding/head"


def step_ms() -> float:
    """The eager static-cache decode step of the TinyLlama-shape model, two threads."""
    from peers_llamacpp import SHAPES, random_model

    from wscompress import compress
    from wscompress.evaluation.decode import StaticDecoder

    model = random_model(SHAPES["tinyllama"])
    random_layout(model, MODELS[LAYOUT][0])
    compress(model, MODELS[LAYOUT][1:])
    model.eval()
    ids = torch.randint(0, model.config.vocab_size, (1, 32), generator=torch.Generator().manual_seed(0))
    torch.set_num_threads(2)
    decoder = StaticDecoder(model, ids, 40)
    times = []
    with torch.no_grad():
        for _ in range(3):
            decoder.reset()
            start = time.perf_counter()
            for _ in range(8):
                decoder.step()
            times.append((time.perf_counter() - start) / 8)
    return min(times) * 1e3


if "--step" in sys.argv:
    print(f"{step_ms():.1f}")
elif "--wait-policy" in sys.argv:
    print("| OMP_WAIT_POLICY | eager step ms, two threads |\n|---|---|")
    for policy in ("unset", "PASSIVE", "ACTIVE"):
        env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
        env.update({} if policy == "unset" else {"OMP_WAIT_POLICY": policy})
        run = subprocess.run([sys.executable, __file__, "--step"], env=env, capture_output=True, text=True, check=True)
        print(f"| {policy} | {run.stdout.split()[-1]} |", flush=True)
else:
    a, b = torch.randn(2**28), torch.randn(2**28)
    print("| threads | read of 1 GiB, GB/s |\n|---|---|")
    for threads in (1, 2):
        torch.set_num_threads(threads)
        print(f"| {threads} | {4 * a.numel() / min(best_seconds(a.sum, CPU, 3), best_seconds(b.sum, CPU, 3)) / 1e9:.1f} |", flush=True)
    from wscompress import kernels

    kernels.lut()
    torch.set_num_threads(1)
    layer = random_palettized(576, 576, MODELS[LAYOUT][0], torch.Generator().manual_seed(0))
    x = torch.randn(1, 1, 576)
    with torch.no_grad():
        plan = layer.kernel_layout()
        args = (x.reshape(1, -1), plan.indices, *plan.rounded, plan.width, layer.group_size, layer.out_features,
                *plan.outliers, layer.scale)
        op = best_seconds(lambda: [torch.ops.wscompress.lut_linear_q8(*args) for _ in range(1000)], CPU, 6) / 1000
        module = best_seconds(lambda: [layer(x) for _ in range(1000)], CPU, 6) / 1000
    print(f"\n576 x 576, one thread: operator {op * 1e6:.1f} µs, module {module * 1e6:.1f} µs a call")
