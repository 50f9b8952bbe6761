"""Benchmark weight clustering on SmolLM2-135M-Instruct.

1. Speed and error of our scalar per-tensor k-means vs ``sklearn.cluster.KMeans(n_init=10)``
   on the same real weight matrices, both limited to the same number of threads, in one run.
2. Time to palettize every decoder-layer linear at 4 bits per channel; bits per weight and
   compression ratio by formula and by the real size of the saved files.
3. Perplexity on wiki.test.txt for bits x granularity.
4. Peak memory of a few DKM fine-tuning steps (in a child process, next to plain full
   fine-tuning with the same settings).

Writes outputs/bench_kmeans/results.json and results.md and prints the tables.
Example: python scripts/experiments/bench_kmeans.py --windows 8 --threads 2
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[2]
WIKI_TRAIN = "builtin:wiki.train"
WIKI_TEST = "builtin:wiki.test"
MATRICES = ["model.layers.3.self_attn.q_proj", "model.layers.10.mlp.down_proj", "model.layers.20.mlp.gate_proj"]


def timed(fn, *args):
    """(result, wall seconds, CPU seconds of this process): CPU time is what the work costs
    even when other jobs share the cores."""
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn(*args)
    return out, time.perf_counter() - wall, time.process_time() - cpu


def sklearn_comparison(model, bits: int) -> list[dict]:
    from sklearn.cluster import KMeans

    from wscompress.maths.clustering import cluster
    from wscompress.model.arch import get_module

    rows = []
    for name in MATRICES:
        w = get_module(model, name).weight.detach().float().reshape(-1)
        cluster(w.view(1, -1, 1), bits)  # warm-up (allocator, kernels)
        (codebook, idx), ours_wall, ours_cpu = timed(cluster, w.view(1, -1, 1), bits)
        ours_mse = ((codebook[0, idx[0], 0] - w) ** 2).mean().item()
        km, sk_wall, sk_cpu = timed(KMeans(n_clusters=2 ** bits, n_init=10, random_state=0).fit, w.numpy().reshape(-1, 1))
        sk_mse = float(((km.cluster_centers_[km.labels_, 0] - w.numpy().astype(np.float64)) ** 2).mean())
        rows.append({"matrix": name, "weights": w.numel(), "bits": bits, "ours_wall_s": round(ours_wall, 3),
                     "sklearn_wall_s": round(sk_wall, 2), "speedup_wall": round(sk_wall / ours_wall, 1),
                     "ours_cpu_s": round(ours_cpu, 3), "sklearn_cpu_s": round(sk_cpu, 2),
                     "speedup_cpu": round(sk_cpu / ours_cpu, 1), "ours_mse": ours_mse, "sklearn_mse": sk_mse,
                     "mse_ratio": round(ours_mse / sk_mse, 5)})
        print(rows[-1], flush=True)
    return rows


def palettize_all(model, tokenizer, stage: dict) -> dict:
    import wscompress
    from wscompress.io import storage

    dense = copy.deepcopy(model)
    (report,), wall, cpu = timed(wscompress.compress, dense, [stage])
    with tempfile.TemporaryDirectory() as tmp:
        orig = storage.save(model, tokenizer, Path(tmp) / "dense")["file_bytes"]
        comp = storage.save(dense, tokenizer, Path(tmp) / "pal")["file_bytes"]
    linear_bytes = report["weights"] * 4  # the fp32 matrices the stage replaced
    pal_bytes = report["bits_per_weight"] * report["weights"] / 8
    return {"stage": json.dumps(stage), "wall_s": round(wall, 1), "cpu_s": round(cpu, 1), "bits_per_weight": round(report["bits_per_weight"], 4),
            "ratio_formula": round(report["ratio_formula"], 3), "ratio_storage": round(report["ratio_storage"], 3),
            "file_mb_dense": round(orig / 2**20, 1), "file_mb_palettized": round(comp / 2**20, 1),
            "ratio_real_linears": round(linear_bytes / (linear_bytes - (orig - comp)), 3),
            "ratio_real_file": round(orig / comp, 3), "claimed_mb_linears": round(pal_bytes / 2**20, 2),
            "mse": report["mse"], **({"entropy_bits": report["entropy_bits"], "huffman_bits": report["huffman_bits"]}
                                     if "entropy_bits" in report else {})}


def perplexity_table(model, ids, windows: int, bits_list: list[int], grans: list[str]) -> list[dict]:
    import wscompress
    from wscompress.evaluation.perplexity import perplexity

    rows = [{"bits": "dense", "granularity": "-", "ppl": round(perplexity(model, ids, 512, max_windows=windows)["ppl"], 3)}]
    print(rows[-1], flush=True)
    for bits in bits_list:
        for gran in grans:
            stage = {"method": "kmeans", "bits": bits, "granularity": gran}
            if gran == "grouped":
                stage["group_size"] = 64
            m = copy.deepcopy(model)
            start = time.perf_counter()
            (report,) = wscompress.compress(m, [stage])
            rows.append({"bits": bits, "granularity": gran + (" (64)" if gran == "grouped" else ""),
                         "bits_per_weight": round(report["bits_per_weight"], 3), "cluster_s": round(time.perf_counter() - start, 1),
                         "ppl": round(perplexity(m, ids, 512, max_windows=windows)["ppl"], 3)})
            print(rows[-1], flush=True)
            del m
    return rows


DKM_CHILD = """
import json, sys, torch
torch.set_num_threads({threads})
from wscompress.evaluation.report import peak_memory_mb
from wscompress.io.checkpoints import load_model
from wscompress.recipe.load import load_recipe
from wscompress.recipe.schema import ModelConfig
from wscompress.recovery.finetune import finetune
model, tok = load_model(ModelConfig())
recipe = load_recipe(data={{"output": {{"dir": "{out}"}}, "eval": {{"perplexity": ["{test}"]}},
    "finetune": {{"mode": "{mode}", "steps": {steps}, "seq_len": 128, "batch_size": 1, "lr": 1e-5, "eval_windows": 1,
                 "dataset": "{train}", "dkm": {{"bits": 4, "iterations": 1}}}}}})
model, report = finetune(model, tok, recipe)
print(json.dumps({{"peak_rss_mb": peak_memory_mb(torch.device("cpu")),
                  "seconds": report["seconds"], "final_loss": report["final_loss"]}}))
"""


def dkm_memory(steps: int, threads: int) -> list[dict]:
    rows = []
    for mode in ("full", "dkm"):
        with tempfile.TemporaryDirectory() as out:
            code = DKM_CHILD.format(threads=threads, out=out, test=WIKI_TEST, train=WIKI_TRAIN, mode=mode, steps=steps)
            # glibc otherwise keeps freed multi-MB chunk temporaries on its heap, and the peak
            # RSS would measure its fragmentation rather than what the training holds
            env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
            proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env=env, check=False)
        if proc.returncode:
            raise RuntimeError(proc.stderr[-2000:])
        rows.append({"mode": mode, "steps": steps, **json.loads(proc.stdout.strip().splitlines()[-1])})
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--windows", type=int, default=8, help="perplexity windows of 512 tokens")
    parser.add_argument("--bits", type=int, nargs="+", default=[2, 3, 4, 6, 8])
    parser.add_argument("--granularity", nargs="+", default=["per_tensor", "per_channel", "grouped"])
    parser.add_argument("--threads", type=int, default=1, help="torch and sklearn threads")
    parser.add_argument("--sklearn-bits", type=int, nargs="+", default=[4])
    parser.add_argument("--dkm-steps", type=int, default=2)
    parser.add_argument("--skip", nargs="*", default=[], choices=["sklearn", "all", "ppl", "dkm"])
    parser.add_argument("--out", default="outputs/bench_kmeans")
    args = parser.parse_args()

    from threadpoolctl import threadpool_limits

    from wscompress.evaluation import report
    from wscompress.io import data, ui
    from wscompress.io.checkpoints import load_model
    from wscompress.recipe.schema import ModelConfig

    ui.set_quiet(True)
    torch.set_num_threads(args.threads)
    threadpool_limits(args.threads)
    model, tokenizer = load_model(ModelConfig())
    results: dict = {"threads": args.threads, "machine": report.environment()}
    if "sklearn" not in args.skip:
        results["sklearn"] = [r for bits in args.sklearn_bits for r in sklearn_comparison(model, bits)]
    if "all" not in args.skip:
        results["palettize_all"] = [palettize_all(model, tokenizer, {"method": "kmeans", "bits": 4, "granularity": "per_channel",
                                                                     "entropy_coding": coded}) for coded in (False, True)]
        print(results["palettize_all"], flush=True)
    if "ppl" not in args.skip:
        ids = data.tokenize(tokenizer, WIKI_TEST, max_tokens=args.windows * 512 + 1)
        results["perplexity"] = perplexity_table(model, ids, args.windows, args.bits, args.granularity)
    if "dkm" not in args.skip:
        results["dkm_memory"] = dkm_memory(args.dkm_steps, args.threads)
    out = REPO / args.out
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    md = [f"# kmeans benchmark ({args.threads} threads)"]
    for key in ("sklearn", "palettize_all", "perplexity", "dkm_memory"):
        if key in results:
            md += [f"\n## {key}\n", ui.markdown_table(results[key])]
            ui.set_quiet(False)
            ui.show(key, results[key])
    (out / "results.md").write_text("\n".join(md) + "\n")
    print(f"wrote {out / 'results.md'}")


if __name__ == "__main__":
    main()
