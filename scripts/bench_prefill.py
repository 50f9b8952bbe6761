"""Prefill's products of palettized layers, in one process: float32 (``WSCOMPRESS_INT8_PREFILL=0``:
the weight decoded to float32, the BLAS), integers in every layer (``=1``: ``lut_linear_i8``, one
16-bit product a weight for 12-bit tables where the build has AVX-512 VNNI, else three 8-bit
ones through ``torch._int_mm``) and the default (unset: integers in layers of
``kernels.INTEGER_PREFILL_WEIGHTS`` weights or more, where the build decodes them vectorised; where
the CPU has AMX, ``lut_linear_bf16`` in every layer: bfloat16 tiles, float32 sums).

For each model shape (a decoder layer's q, k/v, o, gate/up and down projections, as many times
as the model has layers; k/v and gate/up counted twice) and each shipped recipe's layout (random
values: the speed does not depend on them), it times a ``--tokens``-token prefill of every
projection, the paths alternating, best of ``--rounds``, at each thread count, and prints
each path's tokens/s and speed-up over float32, with the CPU's model and vector flags. Attention,
norms and the head are not included: this is the part the integer path changes.

Writes outputs/bench_prefill/results.{json,md}.
Usage: python scripts/bench_prefill.py [--shapes tinyllama smollm2] [--threads 1 2] [--rounds 3]
       python scripts/bench_prefill.py --dry-run   (the first shape at toy size, one round: the suite runs it)
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch

from _common import REPO, cpu_line, markdown, write_results
from bench_runtime import MODELS, RECIPES, random_palettized
from peers_llamacpp import SHAPES, TINY
from wscompress import kernels


def projections(hidden: int, ffn: int, kv: int) -> list[tuple[int, int]]:
    """(out, in) of one decoder layer's projections: q, k, v, o, gate, up, down."""
    return [(hidden, hidden), (kv, hidden), (kv, hidden), (hidden, hidden), (ffn, hidden), (ffn, hidden), (hidden, ffn)]


PATHS = {"float32": "0", "integer": "1", "default": None}  # WSCOMPRESS_INT8_PREFILL for each


@torch.no_grad()
def seconds(layers: list, inputs: dict[int, torch.Tensor], repeat: int, path: str) -> float:
    """One prefill through ``layers`` (a decoder layer's projections), ``repeat`` times (the layers)."""
    os.environ.pop("WSCOMPRESS_INT8_PREFILL", None)
    if PATHS[path] is not None:
        os.environ["WSCOMPRESS_INT8_PREFILL"] = PATHS[path]
    start = time.perf_counter()
    for _ in range(repeat):
        for layer in layers:
            layer(inputs[layer.in_features])
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["tinyllama", "smollm2"], choices=list(SHAPES))
    ap.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=list(RECIPES))
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=REPO / "outputs" / "bench_prefill")
    ap.add_argument("--dry-run", action="store_true", help="the first shape at toy size, one round, one thread")
    args = ap.parse_args()
    shapes = {name: SHAPES[name] for name in args.shapes}
    if args.dry_run:
        shapes = {f"{args.shapes[0]} at toy size": {**shapes[args.shapes[0]], **TINY}}
        args.threads, args.rounds = [1], 1
    gen = torch.Generator().manual_seed(0)
    rows = []
    default = ("AMX tiles" if kernels.lut() is not None and torch.ops.wscompress.lut_amx()
               else f"integers from {kernels.INTEGER_PREFILL_WEIGHTS} weights")
    for shape, dims in shapes.items():
        hidden, ffn, repeat, kv = dims["hidden"], dims["ffn"], dims["layers"], dims["kv_heads"] * dims["head_dim"]
        inputs = {n: torch.randn(args.tokens, n, generator=gen) for n in (hidden, ffn)}
        for recipe in args.recipes:
            stage = MODELS[RECIPES[recipe]][0]
            layers = [random_palettized(o, i, stage, gen) for o, i in projections(hidden, ffn, kv)]
            for threads in args.threads:
                torch.set_num_threads(threads)
                best = dict.fromkeys(PATHS, float("inf"))
                for _ in range(args.rounds + 1):  # round 0 warms up (layouts, oneDNN's kernels)
                    for path in PATHS:
                        best[path] = min(best[path], seconds(layers, inputs, repeat, path))
                row = {"shape": shape, "layout": recipe, "threads": threads, "default path": default,
                       **{f"{path} tok/s": round(args.tokens / best[path], 1) for path in PATHS},
                       **{f"{path} x float32": round(best["float32"] / best[path], 2) for path in ("integer", "default")}}
                rows.append(row)
                print(row, flush=True)
    os.environ.pop("WSCOMPRESS_INT8_PREFILL", None)
    md = (f"Prefill of {args.tokens} tokens through every decoder projection (attention, norms and head "
          f"excluded), best of {args.rounds} rounds, the paths alternating in one process; {cpu_line()}.\n\n"
          + markdown(rows))
    write_results(args.out, {"rows": rows, "cpu": cpu_line()}, md)
    print(md)


if __name__ == "__main__":
    main()
