"""Benchmark: plain SVD vs SVD-LLM vs Basis Sharing on SmolLM2-135M (wiki text).

1. `wscompress calibrate` and `wscompress compress` (Basis Sharing, group 2, 20 %) run as
   subprocesses with configs/basis_sharing.yaml: their reports give the time and peak memory
   a user sees, the saved checkpoint's size is checked against its parameter count, and its
   load time is measured.
2. The Gram matrices written by step 1 are reused (ctx.grams reads them) for every method
   and ratio in this process: perplexity on wiki.test.txt, compression time, parameters.
3. Prefill tokens/s (batch 1 and 8) of the original and of each method at the first ratio.

Writes outputs/bench_basis_sharing/results.{json,md} and prints the tables.
Usage: python scripts/experiments/bench_basis_sharing.py [--ratios 0.2 0.3 0.4 0.5] [--windows 16] [--refit 0.5] [--reuse]
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: the benchmarks' shared helpers
from _common import REPO, compressed_copy, markdown, parser, step, write_results  # noqa: E402

from wscompress.evaluation.perplexity import perplexity  # noqa: E402
from wscompress.io import data, storage  # noqa: E402
from wscompress.io.checkpoints import load_model  # noqa: E402
from wscompress.recipe.load import load_recipe  # noqa: E402

CONFIG = REPO / "configs" / "basis_sharing.yaml"
METHODS = {  # label -> stage (the ratio is filled in per run)
    "SVD": {"method": "svd", "whitening": False},
    "SVD-LLM": {"method": "svd", "whitening": True, "allocation": "uniform"},
    "Basis Sharing g2": {"method": "basis_sharing", "group_size": 2, "allocation": "uniform"},
    "Basis Sharing g4": {"method": "basis_sharing", "group_size": 4, "allocation": "uniform"},
    "svd (fisher allocation)": {"method": "svd"},
    "basis_sharing g2 (fisher allocation)": {"method": "basis_sharing", "group_size": 2},
}


@torch.inference_mode()
def prefill_tokens_per_s(models: dict[str, torch.nn.Module], batch: int, seq_len: int = 128, repeats: int = 5) -> dict[str, float]:
    """Best-of-``repeats`` prefill throughput of each model; the models take turns in every
    round so that load from other processes hits them alike."""
    device = next(next(iter(models.values())).parameters()).device
    x = torch.randint(0, 1000, (batch, seq_len), device=device)
    best = {label: float("inf") for label in models}
    for round_ in range(repeats + 1):  # round 0 warms up
        for label, model in models.items():
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            model(input_ids=x, use_cache=False)
            if device.type == "cuda":
                torch.cuda.synchronize()
            if round_:
                best[label] = min(best[label], time.perf_counter() - start)
    return {label: batch * seq_len / t for label, t in best.items()}


def write(out: Path, args, recipe, rows: list[dict], steps: list[dict], speed: list[dict], labels: list[str]) -> str:
    """Write results.{json,md} (after every row, so an interrupted run keeps what it measured)."""
    ppl = {(x["method"], x["ratio"]): x["ppl"] for x in rows}
    table = [{"method": label, **{f"{round(r * 100)} %": ppl.get((label, r), "-") for r in args.ratios}} for label in labels]
    md = "\n\n".join([
        f"Perplexity on wiki.test.txt ({args.windows} windows of 512), original {rows[0]['ppl']}; "
        f"calibration {recipe.calibration.num_samples}x{recipe.calibration.seq_len} tokens of wiki.train.txt",
        markdown(table, ["method"] + [f"{round(r * 100)} %" for r in args.ratios]),
        markdown(rows, ["method", "ratio", "ppl", "params", "compress_s", "remainder"]),
        markdown(steps, ["step", "seconds", "peak_memory_mb", "params", "file_bytes", "params_x4_bytes"]),
        f"Prefill tokens/s (seq 128) at ratio {args.ratios[0]}, {torch.get_num_threads()} threads",
        markdown(speed, ["model", "prefill tok/s b1", "prefill tok/s b8"]),
    ])
    write_results(out, {"rows": rows, "table": table, "steps": steps, "speed": speed}, md)
    return md


def main() -> None:
    ap = parser(__doc__, out="bench_basis_sharing")
    ap.add_argument("--ratios", type=float, nargs="+", default=[0.2, 0.3, 0.4, 0.5])
    ap.add_argument("--windows", type=int, default=16, help="perplexity windows of 512 tokens")
    ap.add_argument("--refit", type=float, nargs="*", default=[],
                    help="ratios at which to add Basis Sharing g2 with coefficient refit (the paper uses it from 40 %%)")
    ap.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS), help="the rows to measure")
    ap.add_argument("--reuse", action="store_true", help="reuse the calibrate/compress reports already in --out")
    args = ap.parse_args()
    methods = {label: (stage, args.ratios) for label, stage in METHODS.items() if label in args.methods}
    if args.refit:
        methods["Basis Sharing g2 + refit"] = ({"method": "basis_sharing", "group_size": 2, "refit": True,
                                                "allocation": "uniform"}, args.refit)
    out = args.out.resolve()

    # 1. the CLI steps: statistics once, one compression saved to disk
    reports = {step: out / "reports" / f"{step}.json" for step in ("calibrate", "compress")}
    calib, comp = (json.loads(path.read_text()) if args.reuse and path.is_file() else step(command, CONFIG, out)
                   for command, path in reports.items())
    saved = comp["compressed"]
    steps = [{"step": "calibrate", "seconds": calib["seconds"], "peak_memory_mb": calib["peak_memory_mb"]},
             {"step": "compress (BS g2, 20 %)", "seconds": comp["stages"][0]["seconds"],
              "peak_memory_mb": comp["peak_memory_mb"], "params": saved["params"], "file_bytes": saved["file_bytes"],
              "params_x4_bytes": saved["params"] * 4}]
    for when in ("first", "second"):  # the first also pays for imports and a cold file cache
        start = time.perf_counter()
        storage.load(out / "model")
        steps.append({"step": f"wscompress.load of that checkpoint ({when})", "seconds": round(time.perf_counter() - start, 2)})

    # 2. every method and ratio in process, reusing the saved Gram matrices
    recipe = load_recipe(CONFIG, [f"output.dir={out}"])
    original, tok = load_model(recipe.model)
    ids = data.tokenize(tok, recipe.eval.perplexity[0], max_tokens=args.windows * 512 + 512)
    base = perplexity(original, ids, 512, batch_size=4, max_windows=args.windows, label="ppl original")
    rows = [{"method": "original", "ratio": 0, "ppl": round(base["ppl"], 2), "params": storage.stats(original)["params"]}]
    speed: list[dict] = []
    for ratio in sorted({r for _, ratios in methods.values() for r in ratios}):  # whole columns first
        compressed = {"original": original}
        for label, (stage, ratios) in methods.items():
            if ratio not in ratios:
                continue
            model, (report,), seconds = compressed_copy(original, tok, recipe, [{**stage, "ratio": ratio}])
            result = perplexity(model, ids, 512, batch_size=4, max_windows=args.windows, label=f"ppl {label} {ratio}")
            rows.append({"method": label, "ratio": ratio, "ppl": round(result["ppl"], 2), "params": report["params_after"],
                         "compress_s": round(seconds, 1), "remainder": report.get("remainder") or ""})
            print(rows[-1], flush=True)
            compressed[label] = model
            write(out, args, recipe, rows, steps, speed, list(methods))
        if ratio == args.ratios[0]:  # 3. prefill throughput, original vs each method at the first ratio
            tps = {b: prefill_tokens_per_s(compressed, b) for b in (1, 8)}
            speed = [{"model": label, **{f"prefill tok/s b{b}": round(tps[b][label]) for b in tps}} for label in compressed]
        del compressed
    print(write(out, args, recipe, rows, steps, speed, list(methods)))


if __name__ == "__main__":
    main()
