"""What-if for the budget's estimate (docs/clustering.md): each matrix's estimated cost scaled by
a factor for its projection type, then one budget run on the protocol (one-shot, finetune off),
to see whether correcting the estimate's bias by type changes the result. The default factors
are the medians of true / estimated loss by type that ``bench_budget_estimate.py`` measured on
pydoc (48 pairs, 2026-11-28), a text neither the calibration nor the evaluation reads.

The measurements are kept under the cache like any budget's, so this runs with its own cache
(``--cache``, holding links to the real cache's model and kernels): the scaled costs must not
be kept where normal budget runs would read them.

Usage: python scripts/experiments/bench_budget_type_factors.py [--bits 3.0] [--factor o_proj=28.8 ...] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from wscompress.io.files import cache_dir  # reads WSCOMPRESS_CACHE when called, not when imported

REPO = Path(__file__).resolve().parents[2]
FACTORS = {"q_proj": 5.9, "k_proj": 13.5, "v_proj": 3.0, "o_proj": 28.8, "gate_proj": 10.5, "up_proj": 7.9,
           "down_proj": 9.5}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bits", type=float, default=3.0, help="the budget, bits a weight")
    ap.add_argument("--factor", nargs="*", default=[], help="TYPE=FACTOR, overriding the defaults")
    ap.add_argument("--out", type=Path, default=REPO / "outputs" / "budget-type-factors")
    ap.add_argument("--cache", type=Path, default=REPO / "outputs" / "budget-type-factors-cache")
    args = ap.parse_args()
    factors = FACTORS | {k: float(v) for k, v in (f.split("=") for f in args.factor)}
    real = cache_dir()
    args.cache.mkdir(parents=True, exist_ok=True)
    for entry in real.iterdir():  # the model and kernels, not the kept budget measurements
        if entry.name != "budget" and not (args.cache / entry.name).exists():
            (args.cache / entry.name).symlink_to(entry)
    os.environ["WSCOMPRESS_CACHE"] = str(args.cache)  # before wscompress reads it

    import wscompress.methods.kmeans as km
    from wscompress.recipe.load import load_recipe
    from wscompress.workflow import step_run

    measure = km.measure

    def scaled(model, cfg, menu, layers, by_layer, ctx):
        costs, sizes = measure(model, cfg, menu, layers, by_layer, ctx)
        for k, name in enumerate(n for group in by_layer.values() for n in group):
            costs[k] *= factors.get(name.rsplit(".", 1)[-1], 1.0)
        return costs, sizes

    km.measure = scaled
    recipe = load_recipe(REPO / "configs" / "kmeans_budget_3bit.yaml",
                         [f"output.dir={args.out}", "finetune.enabled=false",
                          f"compress.0.budget.bits_per_weight={args.bits}"])
    report = step_run(recipe)
    json.dump(report, sys.stdout, default=str)
    print()


if __name__ == "__main__":
    main()
