"""Record: where a decoded token's time goes at TinyLlama-1.1B's shape, one and two threads, for
the 4-bit recipe's layout with the int8 head (random values: speed does not depend on them),
by ``evaluation.profile.decode_breakdown`` (eager static-cache steps, each part's hooked time,
and its bytes against the measured copy bandwidth). Behind docs/runtime.md's two-thread line
(2026-11-29).

Usage: python scripts/experiments/decode_breakdown_1b.py [LABEL]   (LABEL: a bench_runtime model)
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_runtime import MODELS, random_layout  # noqa: E402
from peers_llamacpp import SHAPES, random_model  # noqa: E402

from wscompress import compress  # noqa: E402
from wscompress.evaluation.profile import copy_bandwidth, decode_breakdown  # noqa: E402

stages = MODELS[sys.argv[1] if len(sys.argv) > 1 else "configs/kmeans_4bit.yaml layout + int8 tied embedding/head"]
model = random_model(SHAPES["tinyllama"])
random_layout(model, stages[0])
compress(model, stages[1:])
for threads in (1, 2):
    torch.set_num_threads(threads)
    bandwidth = copy_bandwidth(torch.device("cpu"))
    result = decode_breakdown(model, bandwidth, steps=4)
    print(f"\n{threads} thread(s): step {result['ms']:.1f} ms, copy {bandwidth / 1e9:.1f} GB/s")
    print("| part | ms | MB | of bandwidth |\n|---|---|---|---|")
    for row in result["rows"]:
        share = "" if row["of bandwidth"] is None else f"{row['of bandwidth']:.2f}"
        print(f"| {row['part']} | {row['ms']:.1f} | {row['MB']:.0f} | {share} |", flush=True)
