"""Wall time and peak memory of each CLI step (calibrate, compress, finetune, eval) of the standard
recipes on this machine, then `bench` (original vs compressed, prefill and decode, batch 1 and 8)
of the Basis Sharing and k-means models. ``model.device`` stays ``auto``: the GPU where there is
one, so the same command gives the CPU and the GPU columns. Each step is a fresh `wscompress`
process, as a user runs it: its seconds include start-up and loading the model. Peak memory is
the step's own report: CUDA's peak allocation on a GPU, the process's peak RSS on CPU.

Writes outputs/bench_steps/results.{json,md} and prints the table.
Usage: python scripts/bench_steps.py [--recipes basis_sharing svd_llm kmeans recovery] [--finetune-steps 100]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from wscompress.io.ui import markdown_table

REPO = Path(__file__).resolve().parents[1]
RECIPES = {  # key -> (label, recipe, steps)
    "basis_sharing": ("Basis Sharing 20 %, group 2", "configs/basis_sharing.yaml", ["calibrate", "compress", "eval"]),
    "svd_llm": ("SVD-LLM 20 %", "configs/svd_llm.yaml", ["calibrate", "compress", "eval"]),
    "kmeans": ("kmeans 4-bit per channel", "configs/kmeans.yaml", ["calibrate", "compress", "eval"]),
    "recovery": ("recovery: Basis Sharing 20 % + distillation", "configs/recovery.yaml",
                 ["calibrate", "compress", "finetune", "eval"]),
}
BENCHED = ["basis_sharing", "kmeans"]


def cli(step: str, recipe: str, out: Path, sets: list[str]) -> tuple[float, dict]:
    """Run one step in a fresh process; (wall seconds, its report)."""
    cmd = [sys.executable, "-m", "wscompress.cli", step, recipe, "-o", str(out), "-q"]
    for s in sets:
        cmd += ["--set", s]
    start = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=REPO, env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"})
    return time.perf_counter() - start, json.loads((out / "reports" / f"{step}.json").read_text())


def result_of(step: str, rep: dict) -> str:
    if step == "compress":
        return f"{rep['param_ratio']:.1%} of the parameters, file {rep['compressed']['file_bytes'] / 2**20:.0f} MB"
    if step == "finetune":
        return f"{len(rep['history'])} steps, loss {rep['history'][0]['loss']:.3g} -> {rep['final_loss']:.3g}"
    if step == "eval":
        return ", ".join(f"{r['model']} {Path(r['source']).stem} {r['ppl']:.2f}" for r in rep["results"])
    return f"{rep['gram_matrices']} Gram matrices, {rep['tokens']:,} tokens"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=list(RECIPES))
    ap.add_argument("--finetune-steps", type=int, default=100, help="the recovery recipe's training steps (its own "
                    "budget is 30 minutes)")
    ap.add_argument("--out", type=Path, default=REPO / "outputs" / "bench_steps")
    args = ap.parse_args()
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"CPU ({os.cpu_count()} cores)"
    sets = [f"finetune.steps={args.finetune_steps}", "finetune.max_minutes=null"]

    rows, bench, timing = [], [], ""
    for key in args.recipes:
        label, recipe, steps = RECIPES[key]
        run = args.out / key
        for step in steps:
            seconds, rep = cli(step, recipe, run, sets if key == "recovery" else [])
            rows.append({"recipe": label, "step": step, "seconds": round(seconds, 1),
                         "peak MB": rep.get("peak_memory_mb"), "result": result_of(step, rep)})
            print(rows[-1], flush=True)
        if key in BENCHED:
            _, rep = cli("bench", recipe, run, [])
            timing = rep["timing"]
            for row in rep["table"]:
                bench.append({"model": label, **row})
            bench.append({"model": label, "measure": "kernel path", "original": rep["kernels"]["original"],
                          "compressed": rep["kernels"]["compressed"]})
    md = "\n\n".join([f"Each step as a fresh `wscompress` process on {device}; seconds include start-up and loading",
                      markdown_table(rows), f"`wscompress bench` on {device} (prefill 128 tokens, decode 16, timing: {timing})",
                      markdown_table(bench)]) if bench else markdown_table(rows)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps({"device": device, "steps": rows, "bench": bench}, indent=1))
    (args.out / "results.md").write_text(md + "\n")
    print(md)


if __name__ == "__main__":
    main()
