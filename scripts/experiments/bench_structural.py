"""Benchmark: structural sharing methods on SmolLM2-135M (wiki text).

For each method (cross_layer FFN groups of 2, merge_drop n=2/4 on the last layers, soft_share
window 4 at rank 8/32, tie_embeddings, factorize_embeddings E=128, GQA 3 -> 1 kv heads) on a
fresh copy of the model: unique parameters, the size of the saved safetensors file (checked
against the unique parameter count), perplexity on wiki.test.txt before and after a short
recovery fine-tune, and prefill latency (batch 1, no KV cache) timed in turn with the original
so that a loaded machine slows both alike. The original model is fine-tuned the same way as a
reference, since fine-tuning on wiki text alone lowers wiki perplexity.

Writes outputs/bench_structural/results.{json,md} and prints the table.
Usage: python scripts/experiments/bench_structural.py [--windows 8] [--steps 20] [--only merge_drop_n2 ...]
(on a busy 2-core CPU: --windows 4 --steps 10 --ft-batch 2 --ft-seq-len 128 --calib-samples 4
--prefill-len 256 --rounds 3 keeps it near 15 minutes when the machine is otherwise idle)
"""

from __future__ import annotations

import copy
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: the benchmarks' shared helpers
from _common import markdown, parse, parser, write_results  # noqa: E402

from wscompress import load  # noqa: E402
from wscompress.evaluation.perplexity import perplexity  # noqa: E402
from wscompress.io import data, storage  # noqa: E402
from wscompress.io.checkpoints import builtin_dir  # noqa: E402
from wscompress.recipe.load import load_recipe  # noqa: E402
from wscompress.recovery.finetune import finetune  # noqa: E402
from wscompress.workflow import apply_stages  # noqa: E402

LAST_MEAN = {"init": "mean", "search": False, "refit": False}  # merge_drop's data-free options (the mean of the last layers)
# label -> (stages, finetune mode, learning rate): `method` trains only what the method made
# (soft_share deltas, embedding factors); models with plain shared/merged modules train `full`
CONFIGS = {
    "original": ([], "full", 5e-5),
    "cross_layer_ffn_g2": ([{"method": "cross_layer", "what": "ffn", "group_size": 2, "init": "best", "refit": False}],
                           "full", 5e-5),
    "merge_drop_n2": ([{"method": "merge_drop", "n": 2, **LAST_MEAN}], "full", 5e-5),
    "merge_drop_n4": ([{"method": "merge_drop", "n": 4, **LAST_MEAN}], "full", 5e-5),
    "soft_share_w4_r8": ([{"method": "soft_share", "window": 4, "rank": 8, "search_stride": 3}], "method", 1e-3),
    "soft_share_w4_r32": ([{"method": "soft_share", "window": 4, "rank": 32, "search_stride": 3}], "method", 1e-3),
    "tie_embeddings": ([{"method": "tie_embeddings"}], None, 0.0),
    "factorize_E128": ([{"method": "factorize_embeddings", "rank": 128}], "method", 1e-3),
    "gqa_kv1": ([{"method": "gqa", "groups": 1}], "full", 5e-5),
}
COLUMNS = ["method", "layers", "params", "params_saved", "file_mb", "file_vs_params", "ppl", "ppl_ft", "ft_mode",
           "prefill_ms", "latency_ratio", "prefill_cpu_ms", "cpu_time_ratio", "depth_ratio", "compress_s", "ft_s"]


@torch.inference_mode()
def paired_prefill_ms(models: list, seq_len: int, rounds: int) -> list[tuple[float, float]]:
    """(wall ms, CPU ms) of one prefill (batch 1, no KV cache) of each model.

    The models run in turn for ``rounds`` rounds after a warm-up and each keeps its fastest
    run, so load from other processes hits all of them alike. On a CPU the process time
    (summed over torch's threads) is reported too: it counts this process's own work only,
    so it stays proportional to the compute even when a shared machine is oversubscribed.
    """
    device = next(models[0].parameters()).device
    x = torch.randint(0, models[0].config.vocab_size, (1, seq_len), generator=torch.Generator().manual_seed(0)).to(device)
    best = [(float("inf"), float("inf"))] * len(models)
    for r in range(rounds + 1):
        for k, model in enumerate(models):
            if device.type == "cuda":
                torch.cuda.synchronize()
            wall, cpu = time.perf_counter(), time.process_time()
            model(input_ids=x, use_cache=False)
            if device.type == "cuda":
                torch.cuda.synchronize()
            if r:  # round 0 warms up
                took = (1000 * (time.perf_counter() - wall), 1000 * (time.process_time() - cpu))
                best[k] = (min(best[k][0], took[0]), min(best[k][1], took[1]))
    return best


def depth_latency(base, args) -> list[dict]:
    """Prefill latency of the original and of merge_drop n=2/4 (no calibration, no fine-tune),
    timed in turn over many rounds: the latency should drop with the removed depth."""
    models = [base]
    for n in (2, 4):
        model = copy.deepcopy(base)
        apply_stages(model, None, load_recipe(data={"compress": [{"method": "merge_drop", "n": n, **LAST_MEAN}]}))
        models.append(model)
    times = paired_prefill_ms(models, args.prefill_len, args.rounds)
    (wall, cpu) = times[0]
    return [{"model": f"merge_drop_n{n}" if n else "original", "layers": m.config.num_hidden_layers,
             "depth_ratio": m.config.num_hidden_layers / base.config.num_hidden_layers,
             "prefill_ms": t[0], "latency_ratio": t[0] / wall, "prefill_cpu_ms": t[1], "cpu_time_ratio": t[1] / cpu}
            for n, m, t in zip((0, 2, 4), models, times)]


def table(rows: list[dict], cols: list[str]) -> str:
    def cell(v):
        return f"{v:.3g}" if isinstance(v, float) and abs(v) < 1000 else (f"{v:,}" if isinstance(v, int | float) else v)

    return markdown([{c: cell(r[c]) for c in cols if c in r} for r in rows], cols)


def run_one(name: str, base, tokenizer, test_ids, args, out: Path) -> dict:
    stages, mode, lr = CONFIGS[name]
    model = copy.deepcopy(base)
    start = time.perf_counter()
    calibration = {"dataset": "builtin:wiki.train", "num_samples": args.calib_samples, "seq_len": 256, "batch_size": 4}
    recipe = load_recipe(data={"compress": stages, "calibration": calibration})
    stage_rows = apply_stages(model, tokenizer, recipe)
    row = {"method": name, "compress_s": round(time.perf_counter() - start, 1), "layers": model.config.num_hidden_layers}
    row["details"] = [{k: v for k, v in r.items() if k != "search_nll"} for r in stage_rows]
    with tempfile.TemporaryDirectory(dir=out) as tmp:
        saved = storage.save(model, tokenizer, Path(tmp) / "m")
    row.update(params=saved["params"], file_mb=saved["file_bytes"] / 2**20,
               file_vs_params=saved["file_bytes"] / (saved["params"] * 4))  # float32: 1.0 = every tensor once
    row["ppl"] = perplexity(model, test_ids, 512, batch_size=4, max_windows=args.windows, label=f"{name} ppl")["ppl"]
    (row["prefill_ms"], row["prefill_cpu_ms"]), original = paired_prefill_ms([model, base], args.prefill_len, args.rounds)
    row["latency_ratio"], row["cpu_time_ratio"] = row["prefill_ms"] / original[0], row["prefill_cpu_ms"] / original[1]
    if any(r.get("applicable") is False for r in stage_rows):
        row["ft_mode"] = "n/a: " + next(r["reason"] for r in stage_rows if r.get("applicable") is False)
        return row
    if args.steps and (name != "original" or args.reference_ft):
        ft = load_recipe(data={
            "finetune": {"mode": mode, "steps": args.steps, "seq_len": args.ft_seq_len, "batch_size": args.ft_batch,
                         "lr": lr, "warmup_steps": 2,
                         "eval_windows": 1, "dataset": "builtin:wiki.train",
                         "penalty": 1e-4 if name.startswith("soft_share") else 0.0},
            "eval": {"perplexity": ["builtin:wiki.test"]}, "output": {"dir": str(out / "ft")}})
        model, report = finetune(model, tokenizer, ft)
        row.update(ft_mode=f"{mode} ({report['trainable_params']:,} trained)", ft_s=round(report["seconds"], 1))
        row["ppl_ft"] = perplexity(model, test_ids, 512, batch_size=4, max_windows=args.windows, label=f"{name} ppl ft")["ppl"]
    return row


def main() -> None:
    ap = parser(__doc__, out="bench_structural", threads=None)
    ap.add_argument("--windows", type=int, default=8, help="perplexity windows of 512 tokens")
    ap.add_argument("--steps", type=int, default=20, help="recovery fine-tune steps; 0: none")
    ap.add_argument("--ft-batch", type=int, default=4, help="fine-tune sequences per step")
    ap.add_argument("--ft-seq-len", type=int, default=256, help="fine-tune sequence length")
    ap.add_argument("--calib-samples", type=int, default=8, help="calibration sequences of 256 tokens")
    ap.add_argument("--prefill-len", type=int, default=512, help="prompt length of the prefill latency")
    ap.add_argument("--rounds", type=int, default=5, help="timed prefill rounds (fastest kept)")
    ap.add_argument("--only", nargs="+", choices=list(CONFIGS), help="run only these (the original always runs)")
    ap.add_argument("--no-reference-ft", dest="reference_ft", action="store_false",
                    help="skip fine-tuning the original (the reference for the fine-tuned perplexities)")
    ap.add_argument("--depth-latency", action="store_true",
                    help="only time original vs merge_drop n=2/4 (use many --rounds on a busy machine)")
    args = parse(ap)  # --threads 1 keeps timings stable on an oversubscribed machine
    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)

    base, tokenizer = load(str(builtin_dir("smollm2-135m-instruct")))
    base.to("cuda" if torch.cuda.is_available() else "cpu")
    if args.depth_latency:
        rows = depth_latency(base, args)
        md = table(rows, list(rows[0]))
        write_results(args.out, {"setup": {k: str(v) for k, v in vars(args).items()}, "rows": rows},
                      f"# merge_drop prefill latency vs depth\n\n{md}", stem="depth_latency")
        print(md)
        return
    test_ids = data.tokenize(tokenizer, "builtin:wiki.test", max_tokens=args.windows * 512 + 1)
    names = ["original"] + [n for n in CONFIGS if n != "original" and (not args.only or n in args.only)]
    setup = {"device": str(next(base.parameters()).device), "threads": torch.get_num_threads(),
             **{k: v for k, v in vars(args).items() if k != "out"}}
    rows = []
    for name in names:
        rows.append(run_one(name, base, tokenizer, test_ids, args, args.out))
        ref = rows[0]
        rows[-1].update(params_saved=ref["params"] - rows[-1]["params"], depth_ratio=rows[-1]["layers"] / ref["layers"])
        print(table(rows[-1:], COLUMNS).splitlines()[-1], flush=True)
        md = table(rows, COLUMNS)  # written after every method: an interrupted run keeps what it measured
        write_results(args.out, {"setup": setup, "rows": rows}, f"# Structural sharing on SmolLM2-135M\n\nSetup: {setup}\n\n{md}")
    print(f"\nSetup: {setup}\n\n{md}")


if __name__ == "__main__":
    main()
