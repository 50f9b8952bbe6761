"""Run-time speed of compressed SmolLM2 models on CPU: decode and prefill, batch 1 and 8, one and
two threads, dense fp32 vs palettized (kmeans 2/3/4 bits per channel, 4 bits grouped) vs
low-rank (svd 20 / 40 %), with the memory-bandwidth bound for decode as a column.

The models are built in this process (data-free options: the speed does not depend on the
quality), take turns in every round, and each figure is the best of ``--rounds``. The decode
bound is resident weight bytes / measured copy bandwidth (every weight is read once per
decoded token at batch 1), so ``of bound`` says how close a path comes to the memory limit.

Writes outputs/bench_runtime/results.{json,md} and prints the table.
Usage: python scripts/bench_runtime.py [--threads 1 2] [--rounds 5] [--models dense kmeans-4 ...]
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import torch

from wscompress import kernels, storage
from wscompress.evaluate.bench import kernel_path
from wscompress.model import load_model
from wscompress.workflow import apply_stages
from wscompress.recipe import load_recipe

REPO = Path(__file__).resolve().parents[1]
PLAIN = {"method": "kmeans", "sensitivity": "none", "error_feedback": False, "refit": False, "outliers": 0,
         "codebook_dtype": "float32"}
MODELS = {  # label -> compress stages (empty: the dense model)
    "dense fp32": [],
    "kmeans 4-bit per channel": [{**PLAIN, "bits": 4}],
    "kmeans 4-bit + 0.25 % outliers": [{**PLAIN, "bits": 4, "outliers": 0.0025}],
    "kmeans 4-bit + tied embedding/head": [{**PLAIN, "bits": 4, "targets": [r"model\.layers\.", "lm_head"]}],
    "kmeans 3-bit per channel": [{**PLAIN, "bits": 3}],
    "kmeans 2-bit per channel": [{**PLAIN, "bits": 2}],
    "kmeans 4-bit grouped 64": [{**PLAIN, "bits": 4, "granularity": "grouped", "group_size": 64}],
    "svd 20 %": [{"method": "svd", "whitening": False, "ratio": 0.2}],
    "svd 40 %": [{"method": "svd", "whitening": False, "ratio": 0.4}],
}


def copy_bandwidth(threads: int, mb: int = 512) -> float:
    """Bytes per second moved by a large tensor copy (read + write) with ``threads`` threads."""
    torch.set_num_threads(threads)
    src, dst = torch.ones(mb * 2**18), torch.empty(mb * 2**18)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 2 * src.numel() * 4 / best


@torch.inference_mode()
def timings(model, batch: int, prompt: int, decode: int) -> dict[str, float]:
    """Seconds of one prefill of ``prompt`` tokens (no cache) and of ``decode`` greedy steps after it."""
    x = torch.randint(0, model.config.vocab_size, (batch, prompt), generator=torch.Generator().manual_seed(0))
    start = time.perf_counter()
    model(input_ids=x, use_cache=False)
    prefill = time.perf_counter() - start
    out = model(input_ids=x[:, :32], use_cache=True)
    past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
    start = time.perf_counter()
    for _ in range(decode):
        out = model(input_ids=token, past_key_values=past, use_cache=True)
        past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
    return {"prefill": prefill, "decode": time.perf_counter() - start}


def markdown(rows: list[dict], cols: list[str]) -> str:
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(r.get(c, "")) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prefill", type=int, default=128, help="prompt tokens timed without a cache")
    ap.add_argument("--decode", type=int, default=16, help="tokens decoded after a 32-token prompt")
    ap.add_argument("--out", type=Path, default=REPO / "outputs" / "bench_runtime")
    args = ap.parse_args()

    recipe = load_recipe(data={"model": {"path": "builtin:smollm2-135m-instruct"}})
    original, tok = load_model(recipe.model)
    models = {}
    for label in args.models:
        model = copy.deepcopy(original)
        if MODELS[label]:
            run = recipe.model_copy()
            run.compress = load_recipe(data={"compress": MODELS[label]}).compress
            apply_stages(model, tok, run)
        models[label] = model.eval()
    for m in models.values():  # prepare kernel layouts before counting what stays resident
        timings(m, 1, 8, 1)
    resident = {label: storage.resident_bytes(m) for label, m in models.items()}

    rows = []
    for threads in args.threads:
        bandwidth = copy_bandwidth(threads)
        torch.set_num_threads(threads)
        for batch in args.batches:
            best = {label: {"prefill": float("inf"), "decode": float("inf")} for label in models}
            for round_ in range(args.rounds + 1):  # round 0 warms up; then the models take turns
                for label, model in models.items():
                    t = timings(model, batch, args.prefill, args.decode)
                    if round_:
                        best[label] = {k: min(best[label][k], t[k]) for k in t}
            dense = best.get("dense fp32")
            for label in models:
                decode_tps = batch * args.decode / best[label]["decode"]
                prefill_tps = batch * args.prefill / best[label]["prefill"]
                row = {"threads": threads, "batch": batch, "model": label, "resident MB": round(resident[label] / 2**20, 1),
                       "decode tok/s": round(decode_tps, 1), "prefill tok/s": round(prefill_tps, 1)}
                if dense is not None:
                    row["decode x dense"] = round(dense["decode"] / best[label]["decode"], 2)
                    row["prefill x dense"] = round(dense["prefill"] / best[label]["prefill"], 2)
                if batch == 1:
                    bound = bandwidth / resident[label]
                    row["decode bound tok/s"] = round(bound, 1)
                    row["of bound"] = f"{decode_tps / bound:.0%}"
                rows.append(row)
                print(row, flush=True)
    paths = {label: kernel_path(m) for label, m in models.items()}
    cols = ["threads", "batch", "model", "resident MB", "decode tok/s", "decode x dense", "decode bound tok/s", "of bound",
            "prefill tok/s", "prefill x dense"]
    md = "\n\n".join([f"SmolLM2-135M-Instruct on CPU; decode {args.decode} tokens after a 32-token prompt, prefill "
                      f"{args.prefill} tokens; best of {args.rounds} rounds, models interleaved; kernels: {kernels.status()}",
                      markdown(rows, cols), markdown([{"model": k, "path": v} for k, v in paths.items()], ["model", "path"])])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps({"rows": rows, "paths": paths}, indent=1))
    (args.out / "results.md").write_text(md + "\n")
    print(md)


if __name__ == "__main__":
    main()
