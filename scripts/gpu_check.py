"""Every GPU measurement of issue 55 in one run of at most 8 minutes, one Markdown table a part
(docs/gpu.md records them with the GPU's name and the date):

1. ``products``: one decode-sized product (batch 1, float16) on LLaMA-7B's layer shapes, the
   shipped layouts against cuBLAS, eager and replayed from a CUDA graph, with the fraction of
   the weight bytes' bound each reaches (``bench_runtime.layer_rows``).
2. ``eager``: where one eager call of the 4-bit recipe's layer spends its time, each level of
   the call stack (layer, dispatcher, Triton wrapper, the launch alone) timed by itself:
   what decoding without a CUDA graph pays per product.
3. ``decode``: whole-model greedy decoding at batch 1 replayed from a CUDA graph on a static KV
   cache (``StaticDecoder``): a 7B-shaped LLaMA and SmolLM2-135M's shape, random weights built
   on the device from configs (the speed does not depend on the values), dense float16 against
   the 4-bit recipe's layout and svd 40 %.
4. ``pipeline``: ``calibrate`` + ``compress`` (one-shot, in this process) of a 7B-shaped LLaMA cut
   to 2 and 4 layers with ``offload: cpu``, for Basis Sharing 20 %, SVD-LLM 20 % and the 4-bit
   k-means recipe (``--methods`` picks and orders them): seconds (and seconds a layer from the
   difference, extrapolated to 32 layers) and peak GPU memory against one decoder layer's bytes.

Parts run in that order; one that would start after ``--minutes`` is listed as skipped, so the
table comes back whatever happens; a part that fails is listed with its traceback and the
next one runs; pipeline runs print their rows as they end and none starts after
``--pipeline-minutes``. ``--dry-run`` runs the same code on the CPU with tiny shapes
(seconds; the test suite runs it, so the script cannot rot between GPU sessions).

Usage: python scripts/gpu_check.py [--out outputs/gpu_check] [--parts products eager decode pipeline]
       python scripts/gpu_check.py --dry-run
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import sys
import time
import traceback
from pathlib import Path

import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling benchmark's helpers
from _common import REPO, markdown, write_results  # noqa: E402
from bench_runtime import (LAYER_COLS, LAYER_SHAPES, MODELS, RECIPES, TOY_SHAPES, best_seconds,  # noqa: E402
                           graph_decode_seconds, layer_rows, random_layout, random_palettized)

from wscompress import compress, kernels  # noqa: E402
from wscompress.evaluation.decode import StaticDecoder  # noqa: E402
from wscompress.evaluation.profile import copy_bandwidth  # noqa: E402
from wscompress.io import storage, ui  # noqa: E402
from wscompress.io.checkpoints import builtin_dir  # noqa: E402
from wscompress.model.arch import replace_everywhere  # noqa: E402
from wscompress.model.forms.wscompress_lowrank import LowRankLinear  # noqa: E402
from wscompress.recipe.load import load_recipe  # noqa: E402
from wscompress.workflow import step_calibrate, step_compress  # noqa: E402

LLAMA_7B = dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=32, vocab_size=32000, tie_word_embeddings=False)
SMOLLM2 = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
               num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True)
TINY = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=49152, tie_word_embeddings=False)  # the dry run's stand-in for both (SmolLM2's tokenizer)
FOUR_BIT = RECIPES["configs/kmeans_4bit.yaml"]
FOUR_BIT_STAGE = MODELS[FOUR_BIT][0]
# the default order: the methods no GPU run has reached yet first (2026-11-28 measured Basis Sharing only)
PIPELINE = {"SVD-LLM 20 %": "svd_llm.yaml", "kmeans 4-bit": "kmeans_4bit.yaml", "Basis Sharing 20 %": "basis_sharing.yaml"}


def low_rank(model: torch.nn.Module, ratio: float) -> None:
    """Every decoder linear as random rank-r factors keeping 1 - ``ratio`` of its parameters
    (the svd method's shape; speed does not depend on the values)."""
    for name, module in list(model.named_modules()):
        if ".layers." in name and isinstance(module, torch.nn.Linear):
            out, inp = module.weight.shape
            rank = int((1 - ratio) * out * inp / (out + inp))
            new = LowRankLinear.replacing(module, torch.randn(out, rank, device=module.weight.device) * 0.02,
                                          torch.randn(rank, inp, device=module.weight.device) * 0.02)
            replace_everywhere(model, module, new)


def rotated(model: torch.nn.Module, stage: dict) -> None:
    """``stage``'s layout on the weights turned by ``rotate`` (methods/rotate.py): its rotations run online."""
    compress(model, [{"method": "rotate"}])
    random_layout(model, stage)


def random_model(shape: dict, device: torch.device, dtype: torch.dtype) -> LlamaForCausalLM:
    """A LLaMA of ``shape`` with random weights, built directly on ``device`` in ``dtype``."""
    config = LlamaConfig(max_position_embeddings=2048, **shape)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return LlamaForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(default)


def products(device: torch.device, dtype: torch.dtype, dry: bool) -> tuple[str, list[dict], list[str]]:
    shapes = TOY_SHAPES if dry else LAYER_SHAPES
    rows = layer_rows(device, dtype, copy_bandwidth(device), device.type == "cuda", shapes)
    cols = [c for c in LAYER_COLS if any(c in r for r in rows)]
    return "One product at batch 1 (random weights; bound = weight bytes / copy bandwidth)", rows, cols


@torch.no_grad()
def eager(device: torch.device, dtype: torch.dtype, dry: bool, calls: int = 200) -> tuple[str, list[dict], list[str]]:
    """Where an eager call of the 4-bit recipe's layer spends its time (what decoding without a
    CUDA graph pays per product): each level of the call stack timed alone, outermost first."""
    out_f, in_f = (256, 128) if dry else (4096, 4096)
    layer = random_palettized(out_f, in_f, FOUR_BIT_STAGE, torch.Generator(device).manual_seed(0)).to(dtype)
    dense = torch.nn.Linear(in_f, out_f, bias=False).to(device, dtype)
    x = torch.randn(1, in_f, device=device, dtype=dtype)
    layer(x)  # the layout and the launch picked before timing
    lay, scale = layer.kernel_layout(), layer.scale
    levels = {"dense F.linear": lambda: dense(x),
              "PalettizedLinear call": lambda: layer(x),
              "kernels.palettized_linear": lambda: kernels.palettized_linear(
                  x, lay.indices, lay.width, lay.tables, layer.group_size, out_f, lay.outliers, lay.rounded, scale)}
    gpu = kernels.lut_gpu() if device.type == "cuda" else None
    if gpu is not None:
        launch = gpu._pick(x, lay.indices, lay.width, lay.tables, layer.group_size, out_f, lay.outliers, scale)
        levels["lut_triton.lut_linear"] = lambda: gpu.lut_linear(x, lay.indices, lay.width, lay.tables, layer.group_size,
                                                                 out_f, lay.outliers, scale)
        levels[f"Triton launch alone ({launch})"] = lambda: gpu._run(launch, x, lay.indices, lay.width, lay.tables,
                                                                     layer.group_size, out_f, lay.outliers, scale)
    rows = [{"level": name, "us per call": round(best_seconds(lambda f=f: [f() for _ in range(calls)], device)
                                                 / calls * 1e6, 1)} for name, f in levels.items()]
    return f"One eager call at batch 1 on {out_f} x {in_f}, {calls} calls, best of 5", rows, ["level", "us per call"]


def decode(device: torch.device, dtype: torch.dtype, dry: bool, tokens: int = 16, rounds: int = 3) -> tuple:
    bandwidth, rows = copy_bandwidth(device), []
    graph = device.type == "cuda"
    shapes = {"tiny (dry run)": TINY} if dry else {"LLaMA-7B shape": LLAMA_7B, "SmolLM2-135M shape": SMOLLM2}
    builds = {"dense": lambda m: None, "4-bit recipe layout": lambda m: random_layout(m, FOUR_BIT_STAGE),
              "rotated + 4-bit recipe layout": lambda m: rotated(m, FOUR_BIT_STAGE),
              "svd 40 %": lambda m: low_rank(m, 0.4)}
    for shape_name, shape in shapes.items():
        dense_tps = None
        for label, build in builds.items():
            model = random_model(shape, device, dtype)
            build(model)
            prompt = torch.randint(0, shape["vocab_size"], (1, 32), device=device)
            decoder = StaticDecoder(model, prompt, tokens, graph=graph)
            seconds = min(graph_decode_seconds(decoder, tokens) for _ in range(rounds))
            resident = storage.resident_bytes(model)
            tps = tokens / seconds
            dense_tps = dense_tps or tps
            rows.append({"model shape": shape_name, "model": label, "resident MB": round(resident / 2**20, 1),
                         "decode tok/s": round(tps, 1), "x dense": round(tps / dense_tps, 2),
                         "bytes ratio": None, "bound tok/s": round(bandwidth / resident, 1),
                         "of bound": f"{tps * resident / bandwidth:.0%}"})
            del decoder, model
            gc.collect()
            if graph:
                torch.cuda.empty_cache()
        dense_mb = rows[-len(builds)]["resident MB"]
        for row in rows[-len(builds):]:
            row["bytes ratio"] = round(dense_mb / row["resident MB"], 2)
    title = (f"Decode at batch 1, {tokens} tokens after a 32-token prompt, "
             f"{'replayed from a CUDA graph' if graph else 'eager'}, static KV cache, best of {rounds}")
    return title, rows, ["model shape", "model", "resident MB", "decode tok/s", "x dense", "bytes ratio",
                         "bound tok/s", "of bound"]


def save_model(shape: dict, layers: int, dtype: torch.dtype, folder: Path, device: torch.device) -> Path:
    """A random model of ``shape`` cut to ``layers``, saved with SmolLM2's tokenizer: the
    pipeline loads it from disk as users' models are. Built on ``device``: the 2026-11-28 run
    spent about 100 s outside its steps, building both models on the CPU among it."""
    if not (folder / "config.json").is_file():
        model = random_model({**shape, "num_hidden_layers": layers}, device, dtype)
        model.save_pretrained(folder)
        AutoTokenizer.from_pretrained(builtin_dir("smollm2-135m-instruct")).save_pretrained(folder)
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return folder


def pipeline(device: torch.device, dry: bool, out: Path, deadline: float, methods: list[str],
             dtype: torch.dtype = torch.float16) -> tuple:
    """(float16 in the dry run too: the path a 7B model takes is the one checked.) Each run's
    row is printed as it ends, and none starts after ``deadline`` (perf_counter seconds), so
    what finished comes back even when the machine's time runs out mid-part."""
    shape = {**(TINY if dry else LLAMA_7B), "vocab_size": 49152}  # SmolLM2's tokenizer
    layer_mb = sum(p.numel() for p in random_model({**shape, "num_hidden_layers": 1}, torch.device("meta"),
                                                   dtype).model.layers[0].parameters()) * dtype.itemsize / 2**20
    rows = []
    for label in methods:  # both depths of each (Basis Sharing's groups are 2 layers)
        config = PIPELINE[label]
        for depth in (2, 4):
            if time.perf_counter() > deadline:
                print(f"pipeline: {label} at {depth} layers skipped (out of time)", flush=True)
                continue
            folder = save_model(shape, depth, dtype, out / "models" / f"{depth}-layers", device)
            sets = [f"model.path={folder}", f"model.device={device.type}", "model.offload=cpu",
                    f"model.dtype={str(dtype).removeprefix('torch.')}", f"output.dir={out / 'runs' / f'{config}-{depth}'}"]
            if dry:  # seconds, not minutes, on a CPU
                sets += ["calibration.num_samples=4", "calibration.seq_len=64", "calibration.batch_size=2"]
                sets += ["compress.0.iterations=5"] if config.startswith("kmeans") else []
            recipe = load_recipe(REPO / "configs" / config, sets)
            row = {"method": label, "layers": depth, "layer MB": round(layer_mb, 1)}
            for step, run in (("calibrate", step_calibrate), ("compress", step_compress)):
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                start = time.perf_counter()
                report = run(recipe)
                row[f"{step} s"] = round(time.perf_counter() - start, 1)
                row[f"{step} peak MB"] = round(report["peak_memory_mb"], 1)
            row["stage s"] = ", ".join(f"{k} {v}" for k, v in report["stages"][0].items() if k.endswith("seconds"))
            rows.append(row)
            print("pipeline row:", json.dumps(row), flush=True)
            shutil.rmtree(out / "runs" / f"{config}-{depth}", ignore_errors=True)
    for label in methods:  # seconds a layer from the two depths; the fixed part stays
        both = [r for r in rows if r["method"] == label]
        if len(both) < 2:
            continue
        short, long_ = both
        for step in ("calibrate", "compress"):
            per_layer = (long_[f"{step} s"] - short[f"{step} s"]) / (long_["layers"] - short["layers"])
            long_[f"{step} s a layer"] = round(per_layer, 2)
            long_[f"{step} s at 32 layers"] = round(short[f"{step} s"] + per_layer * (32 - short["layers"]), 0)
    where = "peak GPU memory" if device.type == "cuda" else "peak resident memory (CPU)"
    title = (f"calibrate + compress in this process, offload: cpu, {str(dtype).removeprefix('torch.')} "
             f"({where}; layer MB: one decoder layer's weights)")
    cols = ["method", "layers", "layer MB", "calibrate s", "calibrate peak MB", "compress s", "compress peak MB",
            "calibrate s a layer", "compress s a layer", "calibrate s at 32 layers", "compress s at 32 layers", "stage s"]
    return title, rows, cols


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="the same code on the CPU with tiny shapes")
    ap.add_argument("--parts", nargs="+", default=["products", "eager", "decode", "pipeline"],
                    choices=["products", "eager", "decode", "pipeline"])
    ap.add_argument("--methods", nargs="+", default=list(PIPELINE), choices=list(PIPELINE),
                    help="the pipeline part's methods, in this order")
    ap.add_argument("--minutes", type=float, default=8.0, help="no part starts after this")
    ap.add_argument("--pipeline-minutes", type=float, default=8.0, help="no pipeline run starts after this")
    ap.add_argument("--out", type=Path, default=REPO / "outputs" / "gpu_check")
    args = ap.parse_args()
    ui.set_quiet(True)  # the parts' tables are the output
    device = torch.device("cpu" if args.dry_run else "cuda")
    dtype = torch.float32 if args.dry_run else torch.float16
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (dry run)"
    args.out.mkdir(parents=True, exist_ok=True)
    start, results = time.perf_counter(), {}
    parts = [f"# gpu_check on {where}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}\n\n"
             f"kernels: {kernels.status()}"]
    for part in args.parts:
        if time.perf_counter() - start > args.minutes * 60:
            parts.append(f"## {part}\n\nskipped: {args.minutes} minutes had passed")
            continue
        began = time.perf_counter()
        try:
            title, rows, cols = {"products": lambda: products(device, dtype, args.dry_run),
                                 "eager": lambda: eager(device, dtype, args.dry_run),
                                 "decode": lambda: decode(device, dtype, args.dry_run),
                                 "pipeline": lambda: pipeline(device, args.dry_run, args.out,
                                                              start + args.pipeline_minutes * 60, args.methods)}[part]()
        except Exception:  # noqa: BLE001 - one GPU session a run: the other parts still get measured
            parts.append(f"## {part}\n\nfailed:\n\n```\n{traceback.format_exc()[-3000:]}```")
            print(parts[-1], flush=True)
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            continue
        results[part] = rows
        parts.append(f"## {part} ({time.perf_counter() - began:.0f} s)\n\n{title}\n\n{markdown(rows, cols)}")
        (args.out / "gpu_check.md").write_text("\n\n".join(parts) + "\n")  # what is done so far, part by part
        print(parts[-1], flush=True)
    write_results(args.out, results, "\n\n".join(parts), stem="gpu_check")


if __name__ == "__main__":
    main()
