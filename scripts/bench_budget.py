"""Perplexity against size: k-means under a size budget (configs/kmeans_budget_3bit.yaml at each
budget) beside the shipped uniform layouts (configs/kmeans_{2,3,4}bit.yaml), and the trellis code
after rotations under a budget (configs/trellis_budget_3bit.yaml, `--trellis`) beside its uniform
recipes (configs/trellis_{2,3}bit.yaml, `--trellis-uniform`), one-shot, on the protocol (SmolLM2-135M, 64 x 512 calibration tokens of wiki.train drawn GPTQ-style with seed
2023, the first 40 windows of 512 tokens of wiki.test and brown).

The calibration statistics are collected once (`wscompress calibrate`) and copied into each
run; each run is `wscompress run <recipe> --set finetune.enabled=false` into
outputs/budget/<name>; the budget runs share one measurement (kept by the first, see
docs/clustering.md). `wscompress report` then merges them (comparison.md, and comparison.png:
perplexity against size, the budget's curve and the uniform layouts on the same axes).

`--bench` adds each folder's decode and prefill speed against the dense model (`wscompress
bench`, batch 1, median of 5, both timed in one process; the CPU's vector flags are printed).
`--finetune` runs each recipe with its training (the shipped 30 minutes) into
outputs/budget/<name>-trained instead of one-shot.

Usage: python scripts/bench_budget.py [--budgets 2.5 3.0 3.5 4.0] [--uniform 2 3 4] [--trellis 2.5 3.0]
       [--trellis-uniform 2 3] [--out outputs/budget] [--bench] [--finetune]
       python scripts/bench_budget.py --dry-run [--bench]   (one budget and one uniform recipe on a toy model: the
       suite runs it)
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from _common import REPO, cpu_line, markdown, parser, toy_model, toy_sets, wscompress

BUDGET_RECIPE = REPO / "configs" / "kmeans_budget_3bit.yaml"
TRELLIS_RECIPE = REPO / "configs" / "trellis_budget_3bit.yaml"


def run(recipe: Path, out: Path, calibration: Path | None, *sets: str, trained: bool = False, speed: bool = False) -> dict:
    """One run from the shared calibration (None: its own; one-shot unless ``trained``); its row
    of the table, with the folder's speed against the dense model where ``speed``."""
    if not (out / "reports" / "eval.json").is_file():
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        if calibration is not None:
            shutil.copytree(calibration, out / "calibration")
        seconds = wscompress("run", str(recipe), "-o", str(out), *(() if trained else ("--set", "finetune.enabled=false")),
                             *(a for s in sets for a in ("--set", s)))
        (out / "seconds").write_text(f"{seconds:.0f}")
    if speed:
        wscompress("bench", str(recipe), "-o", str(out), *(a for s in sets for a in ("--set", s)),
                   "--set", "bench.batch_sizes=[1]", "--set", "bench.repeats=5", "--set", "bench.breakdown=false")
    compress = json.loads((out / "reports" / "compress.json").read_text())
    evaluation = json.loads((out / "reports" / "eval.json").read_text())
    stage = next(s for s in compress["stages"] if s["method"] in ("kmeans", "trellis"))  # after a rotate
    rotated = sum(s.get("sign_bytes", 0) for s in compress["stages"])
    ppl = {(r["model"], Path(r["source"]).stem): r["ppl"] for r in evaluation["results"]}
    texts = sorted({t for _, t in ppl})
    bits = stage["budget"]["bits_per_weight"] if "budget" in stage else \
        stage["bits_per_weight"] + 8 * rotated / stage["weights"]  # the rotations' signs counted
    return {"run": out.name, "bits a weight": round(bits, 3),
            **{f"ppl {t}": round(ppl["compressed", t], 2) for t in texts},
            **{f"x dense {t}": round(ppl["compressed", t] / ppl["original", t], 3) for t in texts},
            "seconds": int((out / "seconds").read_text()), "stage s": round(stage["seconds"]),
            "measure s": stage.get("budget", {}).get("measure_seconds"), "solve s": stage.get("budget", {}).get("solve_seconds"),
            **(speed_columns(out) if speed else {})}


def speed_columns(out: Path) -> dict:
    """Decode and prefill tokens/s against the dense model, from the folder's bench report."""
    table = {r["measure"]: r for r in json.loads((out / "reports" / "bench.json").read_text())["table"]}
    return {f"{kind} x dense": round(row["compressed/original"], 2) for kind in ("decode", "prefill")
            for measure, row in table.items() if measure.startswith(f"{kind} tok/s")}


def main() -> None:
    ap = parser(__doc__, out="budget")
    ap.add_argument("--budgets", type=float, nargs="*", default=[2.5, 3.0, 3.5, 4.0])
    ap.add_argument("--uniform", type=int, nargs="*", default=[2, 3, 4], help="shipped k-means recipes (bits) beside them")
    ap.add_argument("--trellis", type=float, nargs="*", default=[2.5, 3.0], help="budgets of the rotated trellis recipe")
    ap.add_argument("--trellis-uniform", type=int, nargs="*", default=[2, 3], help="shipped trellis recipes (bits)")
    ap.add_argument("--bench", action="store_true", help="also each folder's speed against the dense model")
    ap.add_argument("--finetune", action="store_true", help="with the recipes' training instead of one-shot")
    ap.add_argument("--dry-run", action="store_true", help="a 3.0-bit budget and the 3-bit recipe on a toy model with "
                    "4 calibration windows of 64 tokens, one window a text: checks the script in a minute")
    args = ap.parse_args()
    # every step's recipe on the toy model, k-means quick (its quality is not what the dry run checks)
    toy = [*toy_sets(toy_model(args.out / "toy")), "compress.0.iterations=5", "compress.0.n_init=1",
           "compress.0.error_feedback=false"] if args.dry_run else []
    trellis_toy = [*toy_sets(toy_model(args.out / "toy")), "compress.1.state_bits=6"] if args.dry_run else []
    if args.dry_run:
        args.budgets, args.uniform, args.trellis, args.trellis_uniform, args.finetune = [3.0], [3], [3.0], [2], False
    if args.bench:
        print("CPU:", cpu_line(), flush=True)
    calibration = args.out / "calibration"
    if not (calibration / "calibration").is_dir():
        wscompress("calibrate", str(BUDGET_RECIPE), "-o", str(calibration), *(a for s in toy for a in ("--set", s)))
    suffix, options = ("-trained" if args.finetune else ""), {"trained": args.finetune, "speed": args.bench}
    rows = [run(BUDGET_RECIPE, args.out / f"budget-{b}{suffix}", calibration / "calibration", *toy,
                f"compress.0.budget.bits_per_weight={b}", **options) for b in args.budgets]
    rows += [run(REPO / "configs" / f"kmeans_{b}bit.yaml", args.out / f"uniform-{b}bit{suffix}", calibration / "calibration",
                 *toy, **options) for b in args.uniform]
    # the rotated recipes see the turned model, whose statistics the run computes after its rotate stage
    rows += [run(TRELLIS_RECIPE, args.out / f"trellis-budget-{b}{suffix}", None, *trellis_toy,
                 f"compress.1.budget.bits_per_weight={b}", **options) for b in args.trellis]
    rows += [run(REPO / "configs" / f"trellis_{b}bit.yaml", args.out / f"trellis-{b}bit{suffix}", None, *trellis_toy,
                 **options) for b in args.trellis_uniform]
    wscompress("report", *(str(args.out / r["run"]) for r in rows), "--out", str(args.out / "comparison"))
    table = markdown(rows)
    (args.out / "results.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
