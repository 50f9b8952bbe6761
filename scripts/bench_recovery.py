"""Recovery at equal wall time: perplexity against training seconds for each compression method
and each way of recovering it (issue 12).

Each method is applied once to SmolLM2 with the protocol's calibration (configs/protocol.yaml:
64 x 512 GPTQ-sampled windows of wiki.train.txt; `wscompress calibrate` runs once). Then, on a
copy per recovery, `finetune` (mode: method, so each method trains what it made) runs for the
same time budget (`finetune.max_minutes`: the schedule decays over it) on wiki.train.txt with
  - LM: the language-model loss on the text,
  - KD: KL to the original model's next-token distributions,
  - layer-wise + KD: first each decoder layer learns to reproduce the original layer on its own
    inputs (its steps count against the budget), then KD,
and is scored on the first windows of wiki.test.txt and of brown.txt (never trained on). The
curve (perplexity on a few wiki.test windows every --eval-every steps, against training
seconds) goes to results.json; results.md has the table.

Usage: python scripts/bench_recovery.py [--minutes 2] [--methods bs20 kmeans3 ...]
                                        [--recoveries lm kd layerwise+kd] [--windows 40]
       python scripts/bench_recovery.py --dry-run   (bs20's recoveries on a toy model, 3 s each: the suite runs it)
"""

from __future__ import annotations

import copy
import json

import torch

from _common import (REPO, compressed_copy, markdown, parse, parser, perplexities, step, toy_model, toy_sets,
                     write_results)
from wscompress.io.checkpoints import load_model
from wscompress.recipe.load import load_recipe
from wscompress.recovery.finetune import finetune

CONFIG = REPO / "configs" / "protocol.yaml"
METHODS = {  # key -> (label, stages, learning rate of mode: method)
    "bs20": ("basis_sharing g2 20 %", [{"method": "basis_sharing", "ratio": 0.2, "group_size": 2}], 1e-4),
    "bs40": ("basis_sharing g2 40 %", [{"method": "basis_sharing", "ratio": 0.4, "group_size": 2}], 1e-4),
    "kmeans3": ("kmeans 3-bit per channel", [{"method": "kmeans", "bits": 3}], 1e-4),
    "merge_drop2": ("merge_drop n=2 (last layers, mean: the data-free options)",
                    [{"method": "merge_drop", "n": 2, "init": "mean", "search": False, "refit": False}], 5e-5),
    "cross_layer_ffn2": ("cross_layer FFN group 2", [{"method": "cross_layer", "what": "ffn", "group_size": 2}], 5e-5),
    "gqa1": ("gqa 3 -> 1 kv heads", [{"method": "gqa", "groups": 1}], 5e-5),
}
RECOVERIES = {
    "lm": None,
    "kd": {"kl": 1.0},
    "layerwise+kd": {"kl": 1.0, "layerwise_steps": 40, "layerwise_lr": 1e-5, "layerwise_samples": 32},
}


def main() -> None:
    ap = parser(__doc__, out="bench-recovery", threads=None)
    ap.add_argument("--minutes", type=float, default=2.0, help="training budget of every recovery run")
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    ap.add_argument("--recoveries", nargs="+", default=list(RECOVERIES), choices=list(RECOVERIES))
    ap.add_argument("--windows", type=int, default=40, help="512-token windows scored per text at the end")
    ap.add_argument("--eval-every", type=int, default=20, help="steps between the curve's points")
    ap.add_argument("--dry-run", action="store_true", help="bs20 with each recovery on a toy model, 3 seconds of "
                    "training each, one window a text: checks the script in a minute")
    args = parse(ap)
    out = args.out.resolve()
    sets = toy_sets(toy_model(out / "toy")) if args.dry_run else []
    if args.dry_run:
        args.methods, args.minutes, args.windows, args.eval_every = ["bs20"], 0.05, 1, 2
    recipe = load_recipe(CONFIG, [f"output.dir={out}", *sets])
    calibrated = any(s["method"] in ("basis_sharing", "kmeans") for m in args.methods for s in METHODS[m][1])
    if calibrated and not (out / "calibration" / "stats.json").is_file():  # Grams and sensitivities, once
        step("calibrate", CONFIG, out, sets)
    original, tok = load_model(recipe.model)
    teacher = copy.deepcopy(original).eval().requires_grad_(False)
    texts = ["builtin:wiki.test", "builtin:brown"]

    def scores(model) -> dict[str, float]:
        return perplexities(model, tok, texts, args.windows, recipe.eval.bos)

    done = out / "results.json"  # rows of an earlier invocation with the same budget are kept
    saved = json.loads(done.read_text()) if done.is_file() else {}
    rows = saved.get("rows", []) if saved.get("minutes") == args.minutes and saved.get("windows") == args.windows else []
    if not rows:
        rows.append({"method": "dense", "recovery": "-", **scores(original)})
    cols = ["method", "recovery", "steps", "train_s", "wiki.test", "brown", "compress_s", "note"]

    def table() -> str:
        return (f"{recipe.model.path}, {args.minutes:g} training minutes per run on {torch.get_num_threads()} threads "
                f"(evaluation excluded), {args.windows} windows of 512 tokens per text; brown.txt never trained on\n\n"
                + markdown(rows, cols))
    for key in args.methods:
        label, stages, lr = METHODS[key]
        if all(any(r["method"] == label and r["recovery"] == rec for r in rows) for rec in args.recoveries):
            continue
        compressed, _, seconds = compressed_copy(original, tok, recipe, stages)
        one_shot = {"method": label, "recovery": "none (one-shot)", "compress_s": round(seconds, 1), **scores(compressed)}
        print(one_shot, flush=True)
        if not any(r["method"] == label and r["recovery"] == one_shot["recovery"] for r in rows):
            rows.append(one_shot)
        for rec in args.recoveries:
            if any(r["method"] == label and r["recovery"] == rec for r in rows):
                continue
            distill = RECOVERIES[rec]
            if distill and distill.get("layerwise_steps") and compressed.config.num_hidden_layers != original.config.num_hidden_layers:
                rows.append({"method": label, "recovery": rec, "note": "n/a: the method removed layers"})
                continue
            ft = load_recipe(data={
                "finetune": {"mode": "method", "dataset": recipe.calibration.dataset, "seq_len": 256, "batch_size": 4,
                             "steps": 100_000, "max_minutes": args.minutes, "lr": lr, "warmup_steps": 10,
                             "eval_every": args.eval_every, "eval_windows": 4, "distill": distill},
                "eval": {"perplexity": [texts[0]]}, "output": {"dir": str(out / "ft")}})
            model, report = finetune(copy.deepcopy(compressed), tok, ft, teacher=teacher if distill else None)
            rows.append({"method": label, "recovery": rec, "steps": report["steps"],
                         "train_s": report["history"][-1]["seconds"], **scores(model),
                         "curve": [(h["seconds"], round(h["ppl"], 2)) for h in report["history"] if "ppl" in h]})
            print({k: v for k, v in rows[-1].items() if k != "curve"}, flush=True)
            write_results(out, {"minutes": args.minutes, "windows": args.windows, "rows": rows}, table())
            del model
    write_results(out, {"minutes": args.minutes, "windows": args.windows, "rows": rows}, table())
    print(table())


if __name__ == "__main__":
    main()
