"""Wall time and peak memory of each CLI step (calibrate, compress, finetune, eval) of the standard
recipes on this machine, then `bench` (original vs compressed, prefill and decode, batch 1 and 8)
of the Basis Sharing and k-means models. ``model.device`` stays ``auto``: the GPU where there is
one, so the same command gives the CPU and the GPU columns. Each step is a fresh `wscompress`
process, as a user runs it: its seconds include start-up and loading the model. Peak memory is
the step's own report: CUDA's peak allocation on a GPU, the process's peak RSS on CPU.

Writes outputs/bench_steps/results.{json,md} and prints the table.
Usage: python scripts/bench_steps.py [--recipes basis_sharing svd_llm kmeans recovery] [--finetune-steps 100]
       python scripts/bench_steps.py --dry-run   (the recovery recipe's steps and bench on a toy model: the suite runs it)
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from _common import markdown, parser, step, toy_model, toy_sets, write_results

RECIPES = {  # key -> (label, recipe, steps)
    "basis_sharing": ("Basis Sharing 20 %, group 2", "configs/basis_sharing.yaml", ["calibrate", "compress", "eval"]),
    "svd_llm": ("SVD-LLM 20 %", "configs/svd_llm.yaml", ["calibrate", "compress", "eval"]),
    "kmeans": ("kmeans 4-bit per channel", "configs/kmeans.yaml", ["calibrate", "compress", "eval"]),
    "recovery": ("recovery: Basis Sharing 20 % + distillation", "configs/recovery.yaml",
                 ["calibrate", "compress", "finetune", "eval"]),
}
BENCHED = ["basis_sharing", "kmeans"]


def result_of(step: str, rep: dict) -> str:
    if step == "compress":
        return f"{rep['param_ratio']:.1%} of the parameters, file {rep['compressed']['file_bytes'] / 2**20:.0f} MB"
    if step == "finetune":
        return f"{len(rep['history'])} steps, loss {rep['history'][0]['loss']:.3g} -> {rep['final_loss']:.3g}"
    if step == "eval":
        return ", ".join(f"{r['model']} {Path(r['source']).stem} {r['ppl']:.2f}" for r in rep["results"])
    return f"{rep['gram_matrices']} Gram matrices, {rep['tokens']:,} tokens"


def main() -> None:
    ap = parser(__doc__, out="bench_steps")
    ap.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=list(RECIPES))
    ap.add_argument("--finetune-steps", type=int, default=100, help="the recovery recipe's training steps (its own "
                    "budget is 30 minutes)")
    ap.add_argument("--dry-run", action="store_true", help="the recovery recipe through every step and bench on a toy "
                    "model, a few short calibration windows and training sequences: checks the script in a minute")
    args = ap.parse_args()
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"CPU ({os.cpu_count()} cores)"
    toy, benched = [], BENCHED
    if args.dry_run:  # one recipe through every step, then bench
        folder = toy_model(args.out / "toy")
        toy = [*toy_sets(folder), f"finetune.dataset={folder / 'calibration.txt'}", "finetune.seq_len=64",
               "finetune.batch_size=2", "finetune.eval_every=1", "finetune.eval_windows=1",
               "finetune.distill.layerwise_steps=2", "finetune.distill.layerwise_samples=4", "bench.batch_sizes=[1]",
               "bench.repeats=1", "bench.breakdown=false"]
        args.recipes, args.finetune_steps, benched = ["recovery"], 2, ["recovery"]
    sets = [f"finetune.steps={args.finetune_steps}", "finetune.max_minutes=null"]

    rows, bench, timing = [], [], ""
    for key in args.recipes:
        label, recipe, steps = RECIPES[key]
        run = args.out / key
        for command in steps:
            rep = step(command, recipe, run, toy + (sets if key == "recovery" else []))
            rows.append({"recipe": label, "step": command, "seconds": round(rep["wall_s"], 1),
                         "peak MB": rep.get("peak_memory_mb"), "result": result_of(command, rep)})
            print(rows[-1], flush=True)
        if key in benched:
            rep = step("bench", recipe, run, toy)
            timing = rep["timing"]
            for row in rep["table"]:
                bench.append({"model": label, **row})
            bench.append({"model": label, "measure": "kernel path", "original": rep["kernels"]["original"],
                          "compressed": rep["kernels"]["compressed"]})
    md = "\n\n".join([f"Each step as a fresh `wscompress` process on {device}; seconds include start-up and loading",
                      markdown(rows), f"`wscompress bench` on {device} (prefill 128 tokens, decode 16, timing: {timing})",
                      markdown(bench)]) if bench else markdown(rows)
    write_results(args.out, {"device": device, "steps": rows, "bench": bench}, md)
    print(md)


if __name__ == "__main__":
    main()
