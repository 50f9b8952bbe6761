"""A decoded token's palettized products in place: every decoder projection of a model shape, each
a different layer in a recipe's layout (random values: the speed does not depend on them), one
input row each, in the order a token runs them, so that the indices come from memory as in a real
step (one layer repeated, or a dozen, stays partly in L2 or L3). Prints milliseconds a token and
GB/s of indices for each shipped recipe's layout, at one thread.

The record behind docs/runtime.md's "in a token the 154 products read 8.4 GB/s" (TinyLlama's
shape, the 4-bit recipe, 2026-12-02).
Usage: python scripts/experiments/token_products.py [--shape tinyllama] [--rounds 5] [--tiny]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import cpu_line, markdown  # noqa: E402
from bench_prefill import projections  # noqa: E402
from bench_runtime import MODELS, RECIPES, random_palettized  # noqa: E402
from peers_llamacpp import SHAPES, TINY  # noqa: E402
from wscompress import kernels  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="tinyllama", choices=list(SHAPES))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tiny", action="store_true", help="the shape at toy size, one round (the suite runs it)")
    args = ap.parse_args()
    dims = {**SHAPES[args.shape], **(TINY if args.tiny else {})}
    rounds = 1 if args.tiny else args.rounds
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for recipe in RECIPES:
        stage = MODELS[RECIPES[recipe]][0]
        layers = [random_palettized(o, i, stage, gen).eval()
                  for _ in range(dims["layers"])
                  for o, i in projections(dims["hidden"], dims["ffn"], dims["kv_heads"] * dims["head_dim"])]
        inputs = {n: torch.randn(1, n, generator=gen) for n in (dims["hidden"], dims["ffn"])}
        with torch.no_grad():
            for layer in layers:
                layer(inputs[layer.in_features])  # layouts prepared, kernels loaded
            best = float("inf")
            for _ in range(rounds):
                start = time.perf_counter()
                for layer in layers:
                    layer(inputs[layer.in_features])
                best = min(best, time.perf_counter() - start)
        indices = sum(layer.kernel_layout().indices.numel() for layer in layers)
        rows.append({"layout": recipe, "products": len(layers), "index MB": round(indices / 1e6, 1),
                     "ms a token": round(1e3 * best, 2), "GB/s of indices": round(indices / best / 1e9, 2)})
    print(f"A token's palettized products at {args.shape}'s shape{' (toy size)' if args.tiny else ''}, one thread, "
          f"best of {rounds}; {cpu_line()}; kernels: {kernels.status()}.\n")
    print(markdown(rows))


if __name__ == "__main__":
    main()
