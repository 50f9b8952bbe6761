"""The quality protocol: every one-shot method and option on SmolLM2, side by side with the
official figures, on configs/protocol.yaml (64x512 GPTQ-sampled calibration windows of
wiki.train.txt; perplexity on the first 40 windows of wiki.test.txt and of brown.txt, which no
default was tuned on).

1. `wscompress calibrate` and then `wscompress compress` (the recipe's Basis Sharing stage) run
   once each as subprocesses, as a user runs them (their reports give time and peak memory);
   the statistics calibrate saves (Gram matrices, output sensitivities) serve every row. The
   same pair runs again in the official code's configuration (one ratio per matrix, no refit),
   the like-for-like comparison for its time (in outputs/protocol/official-configuration).
2. Each row applies its stage(s) to a fresh copy of the model in this process: perplexity on
   both texts, the size (parameters or bits per weight) and the compression time. Each row is
   also written as a run folder (outputs/protocol/runs/<row>/reports), so
   `wscompress report outputs/protocol/runs` plots every method and combination by size.

Writes outputs/protocol/results.{json,md} after every row and prints the tables.
Usage: python scripts/bench_protocol.py [--rows svd-llm bs-g2 ...] [--ratios 0.2 0.4] [--bits 3 4] [--windows 40]
       [--set calibration.dtype=float32 --out outputs/protocol-float32]  (the same with float32 passes)
       python scripts/bench_protocol.py --dry-run   (DRY_ROWS on a toy model, one window: the suite runs it)
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from _common import REPO, compressed_copy, markdown, parser, perplexities, step, toy_model, toy_sets, write_results
from wscompress.evaluation import report as reports
from wscompress.io import storage
from wscompress.io.checkpoints import load_model
from wscompress.recipe.load import load_recipe

CONFIG = REPO / "configs" / "protocol.yaml"
UNIFORM = {"allocation": "uniform"}
FAST = {"sensitivity": "none", "error_feedback": False, "refit": False, "outliers": 0, "codebook_dtype": "float32"}
LOW_RANK = {  # label -> stage; the ratio is filled in per column
    "SVD-LLM (svd, uniform)": {"method": "svd", "refit": False, **UNIFORM},
    "svd fisher, refit: false": {"method": "svd", "refit": False},
    "svd fisher + refit, refit_target: function (the official update)": {"method": "svd", "refit_target": "function"},
    "svd (default: fisher + refit, refit_target: layer)": {"method": "svd"},
    "Basis Sharing g2 (uniform)": {"method": "basis_sharing", "group_size": 2, "refit": False, **UNIFORM},
    "Basis Sharing g2 + the official update (uniform)": {"method": "basis_sharing", "group_size": 2,
                                                         "refit_target": "function", **UNIFORM},
    "basis_sharing g2 fisher, no refit": {"method": "basis_sharing", "group_size": 2, "refit": False},
    "basis_sharing g2 fisher + refit, refit_target: function": {"method": "basis_sharing", "group_size": 2,
                                                                "refit_target": "function"},
    "basis_sharing g2 (default: fisher + refit, refit_target: layer)": {"method": "basis_sharing", "group_size": 2},
    "basis_sharing g2, refit_samples: 16": {"method": "basis_sharing", "group_size": 2, "refit_samples": 16},
    "basis_sharing g2, refit_samples: 32": {"method": "basis_sharing", "group_size": 2, "refit_samples": 32},
    "basis_sharing g2 refit_target: model": {"method": "basis_sharing", "group_size": 2, "refit_target": "model"},
}
CLUSTERING = {  # label -> stage; the bits are filled in per column
    "k-means per channel (plain)": {"method": "kmeans", **FAST},
    "kmeans + sensitivity": {"method": "kmeans", "error_feedback": False, "refit": False, "outliers": 0},
    "kmeans + sensitivity + feedback": {"method": "kmeans", "refit": False, "outliers": 0},
    "kmeans + outliers, fp16 codebooks (refit: false)": {"method": "kmeans", "refit": False},
    "kmeans (default: + refit)": {"method": "kmeans"},
}
COMBINED = {  # label -> stages, at fixed settings: low-rank factors palettized in turn; soft sharing
    "soft_share, plain-SVD deltas, base: mean, refit: false":
        [{"method": "soft_share", "whitening": False, "base": "mean", "refit": False}],
    "soft_share, base: mean, refit: false": [{"method": "soft_share", "base": "mean", "refit": False}],
    "soft_share, base: mean": [{"method": "soft_share", "base": "mean"}],
    "soft_share (defaults: window 4 searched, rank 16)": [{"method": "soft_share"}],
    "soft_share layers 13-16, base: mean, refit: false": [{"method": "soft_share", "starts": [13], "base": "mean", "refit": False}],
    "soft_share layers 13-16, base: mean": [{"method": "soft_share", "starts": [13], "base": "mean"}],
    "soft_share layers 13-16, base: fit, refit: false": [{"method": "soft_share", "starts": [13], "refit": False}],
    "soft_share layers 13-16 (defaults)": [{"method": "soft_share", "starts": [13]}],
    "basis_sharing g2 20 % + kmeans 4-bit": [{"method": "basis_sharing", "group_size": 2, "ratio": 0.2, "refit": False},
                                            {"method": "kmeans", "bits": 4}],
    "basis_sharing g2 20 % + kmeans 3-bit": [{"method": "basis_sharing", "group_size": 2, "ratio": 0.2, "refit": False},
                                            {"method": "kmeans", "bits": 3}],
    "cross_layer FFN, layers 13-16 share one, init: mean (ALBERT-style; merge)":
        [{"method": "cross_layer", "groups": [[13, 14, 15, 16]], "init": "mean", "refit": False}],
    "cross_layer FFN, layers 13-16 share one, init: fit, refit: false":
        [{"method": "cross_layer", "groups": [[13, 14, 15, 16]], "refit": False}],
    "cross_layer FFN, layers 13-16 share one (default: init: fit + refit)":
        [{"method": "cross_layer", "groups": [[13, 14, 15, 16]]}],
    "cross_layer attention, layers 13-16 share one, init: mean": [{"method": "cross_layer", "what": "attn",
                                                                   "groups": [[13, 14, 15, 16]], "init": "mean",
                                                                   "refit": False}],
    "cross_layer attention, layers 13-16 share one (default: init: fit + refit)":
        [{"method": "cross_layer", "what": "attn", "groups": [[13, 14, 15, 16]]}],
    "cross_layer FFN, every pair of layers, init: best": [{"method": "cross_layer", "group_size": 2, "init": "best",
                                                          "refit": False}],
    "cross_layer FFN, every pair of layers (default: init: fit + refit)": [{"method": "cross_layer", "group_size": 2}],
    "gqa 3 -> 1 kv heads, init: mean (Ainslie et al.)": [{"method": "gqa", "groups": 1, "init": "mean"}],
    "gqa 3 -> 1 kv heads, init: pca, refit: false": [{"method": "gqa", "groups": 1, "refit": False}],
    "gqa 3 -> 1 kv heads, init: pca (default: + o_proj refit)": [{"method": "gqa", "groups": 1}],
    "merge_drop n=2, before the last layer, mean (the earlier default)":
        [{"method": "merge_drop", "n": 2, "search": False, "refit": False}],
    "merge_drop n=2, search (Gromov et al.), mean": [{"method": "merge_drop", "n": 2, "init": "mean", "refit": False}],
    "merge_drop n=2, search, first (ShortGPT-style drop)": [{"method": "merge_drop", "n": 2, "refit": False}],
    "merge_drop n=2, search, mean + refit": [{"method": "merge_drop", "n": 2, "init": "mean"}],
    "merge_drop n=2 (default: search, first + refit)": [{"method": "merge_drop", "n": 2}],
    "merge_drop n=4, search, first": [{"method": "merge_drop", "n": 4, "refit": False}],
    "merge_drop n=4 (default: search, first + refit)": [{"method": "merge_drop", "n": 4}],
}
# Published figures of the reference implementations on this protocol (measured by running the
# official code on this machine, issue 11): label -> {ratio: wiki.test perplexity}
OFFICIAL = {"official Basis Sharing g2 (q/gate/up shared)": {0.2: 89.53, 0.4: 297.2},
            "official SVD-LLM (whitening)": {0.2: 90.40, 0.4: 311.5}}
# The official Basis Sharing code's own configuration, in wscompress's terms (its time target, issue 11)
OFFICIAL_CONFIGURATION = ["compress.0.allocation=uniform", "compress.0.refit=false"]
# the dry run's rows: the quickest of each table (the script's path is the same for every row)
DRY_ROWS = ["SVD-LLM (svd, uniform)", "k-means per channel (plain)", "gqa 3 -> 1 kv heads, init: mean (Ainslie et al.)"]


def write(out: Path, rows: list[dict], steps: list[dict], args) -> str:
    texts = list(rows[0]["ppl"])
    dense = rows[0]["ppl"]
    table = []
    for r in rows:
        entry = {"method": r["method"], "size": r["size"], "bytes": r.get("bytes", ""), **{t: r["ppl"][t] for t in texts},
                 **{f"{t} / dense": round(r["ppl"][t] / dense[t], 3) for t in texts}, "compress_s": r.get("compress_s", "")}
        table.append(entry)
    official = [{"method": label, **{f"{round(k * 100)} %": v for k, v in figures.items()}} for label, figures in OFFICIAL.items()]
    ours = {}
    for r in rows:
        if "ratio" in r:
            ours.setdefault(r["method"], {"method": r["method"]})[f"{round(r['ratio'] * 100)} %"] = r["ppl"]["wiki.test"]
    cols = ["method"] + [f"{round(x * 100)} %" for x in sorted({r["ratio"] for r in rows if "ratio" in r} | {0.2, 0.4})]
    md = "\n\n".join([
        f"SmolLM2-135M-Instruct, {args.windows} windows of 512 tokens per text, {torch.get_num_threads()} threads",
        markdown(steps, ["step", "seconds", "peak_memory_mb"]),
        "wiki.test perplexity by parameters removed (official rows: the reference code on this protocol)",
        markdown(official + list(ours.values()), cols),
        markdown(table, ["method", "size", "bytes"] + texts + [f"{t} / dense" for t in texts] + ["compress_s"]),
    ])
    write_results(out, {"rows": rows, "steps": steps, "official": OFFICIAL}, md)
    return md


def main() -> None:
    ap = parser(__doc__, out="protocol")
    ap.add_argument("--rows", nargs="+", default=list(LOW_RANK) + list(CLUSTERING) + list(COMBINED),
                    help="labels of the rows to run")
    ap.add_argument("--ratios", type=float, nargs="+", default=[0.2, 0.3, 0.4, 0.5])
    ap.add_argument("--bits", type=int, nargs="+", default=[2, 3, 4])
    ap.add_argument("--windows", type=int, default=40)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="recipe override for both steps and every row, e.g. calibration.dtype=float32")
    ap.add_argument("--dry-run", action="store_true", help="DRY_ROWS at one ratio and 4 bits on a toy model with "
                    "4 calibration windows of 64 tokens, one window a text, the recipe's steps only in their default "
                    "configuration: checks the script in a minute")
    args = ap.parse_args()
    out = args.out.resolve()
    if args.dry_run:
        args.set += toy_sets(toy_model(out / "toy"))
        args.rows, args.ratios, args.bits, args.windows = DRY_ROWS, [0.2], [4], 1
    recipe = load_recipe(CONFIG, [f"output.dir={out}", *args.set])

    def cli(command: str, folder: Path, done: Path, sets: list[str]) -> dict:
        """One step as a user runs it (a fresh process), unless an earlier invocation did; its report."""
        if done.is_file():
            return json.loads((folder / "reports" / f"{command}.json").read_text())
        return step(command, CONFIG, folder, args.set + sets)

    steps = []
    # the recipe's stage (the defaults), then the official code's configuration (one ratio per
    # matrix, no refit: no sensitivities to calibrate either) in a folder of its own
    configurations = [(out, [], "Grams + sensitivities", "defaults: fisher + refit"),
                      (out / "official-configuration", OFFICIAL_CONFIGURATION, "Grams", "allocation: uniform, refit: false")]
    for folder, sets, gathered, stage in configurations[:1] if args.dry_run else configurations:
        calib = cli("calibrate", folder, folder / "calibration" / "stats.json", sets)
        comp = cli("compress", folder, folder / "reports" / "compress.json", sets)  # statistics reused
        steps += [{"step": f"wscompress calibrate ({gathered})", "seconds": calib["seconds"],
                   "peak_memory_mb": calib["peak_memory_mb"]},
                  {"step": f"wscompress compress (Basis Sharing g2 20 %, {stage})",
                   "seconds": round(sum(s["seconds"] for s in comp["stages"]), 1), "peak_memory_mb": comp["peak_memory_mb"]}]

    original, tok = load_model(recipe.model)

    def scores(model) -> dict[str, float]:
        return perplexities(model, tok, recipe.eval.perplexity, args.windows, recipe.eval.bos)

    done = out / "results.json"  # rows measured by an earlier invocation are kept, not rerun
    rows = json.loads(done.read_text())["rows"] if done.is_file() else \
        [{"method": "dense", "size": "100 %", "bytes": "100 %", "ppl": scores(original)}]
    print(rows[0], flush=True)
    runs = [(label, [{**stage, "ratio": r}]) for r in args.ratios for label, stage in LOW_RANK.items() if label in args.rows]
    runs += [(label, [{**stage, "bits": b}]) for b in args.bits for label, stage in CLUSTERING.items() if label in args.rows]
    runs += [(label, stages) for label, stages in COMBINED.items() if label in args.rows]
    dense_stats = storage.stats(original)
    for label, stages in runs:
        setting = {k: stages[0][k] for k in ("ratio", "bits") if k in stages[0]} if len(stages) == 1 else {}
        if any(r["method"] == label and all(r.get(k) == v for k, v in setting.items()) for r in rows):
            continue
        model, report, seconds = compressed_copy(original, tok, recipe, stages)
        last = report[-1]
        size = (f"{last['bits_per_weight']:.3f} bits/weight" if "bits_per_weight" in last
                else f"{last['params_after'] / report[0]['params_before']:.1%} params")
        ppl, stats = scores(model), storage.stats(model)
        rows.append({"method": label, **setting, "size": size, "bytes": f"{stats['tensor_bytes'] / dense_stats['tensor_bytes']:.1%}",
                     "ppl": ppl, "compress_s": round(seconds, 1)})
        print(rows[-1], flush=True)
        slug = "".join(c if c.isalnum() else "-" for c in f"{label} {setting}").strip("-")
        run_dir = out / "runs" / slug
        reports.write(run_dir, "compress", {"original": dense_stats, "compressed": stats, "stages": report},
                      {"name": label, "compress": stages})
        reports.write(run_dir, "eval", {"results": [
            {"model": name, "source": text, "ppl": value, "params": st["params"]}
            for name, values, st in (("compressed", ppl, stats), ("original", rows[0]["ppl"], dense_stats))
            for text, value in values.items()]}, {"name": label, "compress": stages})
        write(out, rows, steps, args)
        del model
    print(write(out, rows, steps, args))


if __name__ == "__main__":
    main()
