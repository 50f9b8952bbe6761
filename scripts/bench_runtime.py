"""Run-time speed of compressed SmolLM2 models: decode and prefill, batch 1 and 8, dense vs
palettized (kmeans 2/3/4 bits per channel, 4 bits grouped; vector codebooks at 2, 3 and 4 bits
per weight) vs low-rank (svd 20 / 40 %), with the
memory-bandwidth bound for decode as a column. On CPU (default) in float32 with one and two
threads; with ``--device cuda`` in float16 (the dense baseline is then fp16), timed with CUDA
events, plus ``--layers``: one decode-sized product on LLaMA-7B-sized layers, where the weight
bytes, not kernel launches, set the time. On CUDA both are also timed replayed from a captured
CUDA graph (``graph`` columns: decode steps on a static KV cache, as serving stacks run them),
which takes Python's kernel launches out of the time; on CPU ``--compile`` times the decode step
compiled (torch.compile, ``compiled`` columns), which takes the framework's per-token cost out.
``--breakdown`` adds, per model, where a decoded token's time goes (evaluation/profile.py). The
shipped recipes' layouts are also measured with the tied embedding / head in the same layout.

The models are built in this process, kmeans layouts with random values of the layout (seconds;
``--cluster`` runs data-free clustering instead: the speed does not depend on the values), take
turns in every round, and each figure is the best of ``--rounds``. The decode
bound is resident weight bytes / measured copy bandwidth (every weight is read once per
decoded token at batch 1), so ``of bound`` says how close a path comes to the memory limit.

Writes outputs/bench_runtime/results.{json,md} and prints the table.
Usage: python scripts/bench_runtime.py [--threads 1 2] [--rounds 5] [--models "dense" "kmeans 4-bit per channel" ...]
       python scripts/bench_runtime.py --device cuda [--layers]
       python scripts/bench_runtime.py --dry-run   (every model at toy size, one round: the suite runs it)
"""

from __future__ import annotations

import argparse
import copy
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from _common import REPO, markdown, toy_model, write_results
from wscompress import kernels
from wscompress.evaluation.bench import kernel_path
from wscompress.evaluation.decode import StaticDecoder, cache_argument, prompt_forward
from wscompress.evaluation.profile import copy_bandwidth, decode_breakdown
from wscompress.evaluation.profile import markdown as breakdown_markdown
from wscompress.io import storage
from wscompress.io.checkpoints import load_model
from wscompress.recipe.load import load_recipe
from wscompress.workflow import apply_stages

PLAIN = {"method": "kmeans", "sensitivity": "none", "error_feedback": False, "refit": False, "outliers": 0,
         "codebook_dtype": "float32"}
# vector codebooks (bits per weight = bits / cluster_dim); few iterations: the speed does not depend on them
VQ = {**PLAIN, "iterations": 5, "n_init": 1}
VQ3 = {**VQ, "bits": 6, "cluster_dim": 2, "granularity": "grouped", "group_size": 64}  # 3 bits, 2-d per 64 channels
VQ2 = {**VQ, "bits": 8, "cluster_dim": 4, "granularity": "per_tensor"}  # 2 bits, 4-d per matrix
SHIPPED = {"codebook_dtype": "float16"}  # the shipped recipes store codebooks, scales and outliers so
MODELS = {  # label -> compress stages (empty: the dense model)
    "dense": [],
    "kmeans 4-bit per channel": [{**PLAIN, "bits": 4}],
    "kmeans 4-bit + 0.25 % outliers": [{**PLAIN, "bits": 4, "outliers": 0.0025}],
    "kmeans 4-bit + tied embedding/head": [{**PLAIN, "bits": 4, "targets": [r"model\.layers\.", "lm_head"]}],
    "kmeans 3-bit per channel": [{**PLAIN, "bits": 3}],
    "kmeans 2-bit per channel": [{**PLAIN, "bits": 2}],
    "kmeans 4-bit grouped 64": [{**PLAIN, "bits": 4, "granularity": "grouped", "group_size": 64}],
    "kmeans 2-bit, 2-d vectors per 64 channels": [{**VQ3, "bits": 4}],
    "kmeans 3-bit, 2-d vectors per 64 channels": [VQ3],
    "kmeans 2-bit, 4-d vectors per matrix": [VQ2],
    # with weights kept aside (each row corrects its outputs): the shipped recipes' layouts (marked), and
    # each without its row scales
    "kmeans 3-bit, 2-d vectors per 64 channels + 0.4 % outliers": [{**VQ3, "outliers": 0.004}],
    "kmeans 3-bit, 2-d vectors per 64 channels + row scales + 0.35 % outliers":  # configs/kmeans_3bit.yaml's layout
        [{**VQ3, **SHIPPED, "row_scale": True, "outliers": 0.0035}],
    "kmeans 2-bit, 4-d vectors per matrix + 0.5 % outliers": [{**VQ2, "outliers": 0.005}],
    "kmeans 2-bit, 4-d vectors per matrix + row scales + 0.5 % outliers":  # configs/kmeans_2bit.yaml's layout
        [{**VQ2, **SHIPPED, "row_scale": True, "outliers": 0.005}],
    "kmeans 4-bit, 2-d vectors per 64 channels + 0.1 % outliers": [{**VQ3, "bits": 8, "outliers": 0.001}],
    "kmeans 4-bit, 2-d vectors per 64 channels + row scales + 0.07 % outliers":  # configs/kmeans_4bit.yaml's layout
        [{**VQ3, **SHIPPED, "bits": 8, "row_scale": True, "outliers": 0.0007}],
    "kmeans 4-bit per channel + row scales + 0.07 % outliers":  # configs/kmeans_4bit_fast.yaml's layout
        [{**PLAIN, **SHIPPED, "bits": 4, "row_scale": True, "outliers": 0.0007}],
    "svd 20 %": [{"method": "svd", "whitening": False, "ratio": 0.2}],
    "svd 40 %": [{"method": "svd", "whitening": False, "ratio": 0.4}],
}
# the tied embedding / head (one table): in a layout of the recipe's bits it costs 20-25 % of
# perplexity; 8-bit scalar codebooks per 64 rows (HEAD_8BIT, for the records) 0.16-0.25 %; int8
# blocks (what the shipped recipes store) and float16 nothing measurable (docs/runtime.md)
HEAD = {"targets": [r"model\.layers\.", "lm_head"]}
HEAD_HALF = {"method": "half"}
HEAD_INT8 = {"method": "int8"}
HEAD_8BIT = {**PLAIN, "bits": 8, "granularity": "grouped", "group_size": 64, "codebook_dtype": "float16",
             "targets": ["lm_head"]}
RECIPES = {  # the shipped recipes' layouts (labels above)
    "configs/kmeans_4bit.yaml": "kmeans 4-bit, 2-d vectors per 64 channels + row scales + 0.07 % outliers",
    "configs/kmeans_3bit.yaml": "kmeans 3-bit, 2-d vectors per 64 channels + row scales + 0.35 % outliers",
    "configs/kmeans_2bit.yaml": "kmeans 2-bit, 4-d vectors per matrix + row scales + 0.5 % outliers",
    "configs/kmeans_4bit_fast.yaml": "kmeans 4-bit per channel + row scales + 0.07 % outliers"}
for _recipe, _label in RECIPES.items():
    MODELS[f"{_recipe} layout + tied embedding/head in it"] = [{**MODELS[_label][0], **HEAD}]
    MODELS[f"{_recipe} layout + float16 tied embedding/head"] = [MODELS[_label][0], HEAD_HALF]
    MODELS[f"{_recipe} layout + int8 tied embedding/head"] = [MODELS[_label][0], HEAD_INT8]  # the recipe as shipped
    # incoherence first (methods/rotate.py): the rotations' online cost on top of the layout's products
    MODELS[f"rotated (Hadamard 64) + {_recipe} layout + int8 tied embedding/head"] = \
        [{"method": "rotate", "block": 64}, MODELS[_label][0], HEAD_INT8]


def random_palettized(out: int, inp: int, stage: dict, gen: torch.Generator):
    """A PalettizedLinear in a kmeans stage's layout (codebooks, scales, kept-aside weights) with
    random values, made on ``gen``'s device in seconds instead of clustering: the speed does not
    depend on the values."""
    from wscompress.methods.kmeans import KMeansConfig, group_size_of
    from wscompress.model.forms.wscompress_palettized import PalettizedLinear

    cfg, device = KMeansConfig(**stage), gen.device
    kept = int(cfg.outliers * out * inp)
    return PalettizedLinear.from_clusters(
        torch.randn(out // group_size_of(cfg, out), 2**cfg.bits, cfg.cluster_dim, generator=gen, device=device) * 0.02,
        torch.randint(0, 2**cfg.bits, (out, inp // cfg.cluster_dim), generator=gen, device=device), None,
        outliers=(torch.randperm(out * inp, generator=gen, device=device)[:kept],
                  torch.randn(kept, generator=gen, device=device) * 0.05) if kept else None,
        scale=torch.rand(out, generator=gen, device=device) + 0.5 if cfg.row_scale else None,
        codebook_dtype=cfg.codebook_dtype)


def random_layout(model, stage: dict) -> None:
    """A kmeans stage's layout on every target of ``model`` (the tied table shared by the
    embedding, as the method makes it) with random values (``random_palettized``), in the
    model's device and dtype."""
    from wscompress.methods.kmeans import KMeansConfig
    from wscompress.model.arch import target_layers, tied_to_embeddings
    from wscompress.model.arch import replace_everywhere, weight_of
    from wscompress.model.forms.wscompress_embeddings import PalettizedEmbedding

    gen = torch.Generator(next(model.parameters()).device).manual_seed(0)
    for module in target_layers(model, KMeansConfig(**stage)).values():
        w = weight_of(module)
        layer = random_palettized(*w.shape, stage, gen).to(w.dtype)
        embedding = tied_to_embeddings(model, module)
        replace_everywhere(model, module, layer)
        if embedding is not None:  # the tied table: one module for both, as the method makes it
            replace_everywhere(model, embedding, PalettizedEmbedding.around(layer, embedding))


def build(model, tok, recipe, stages: list[dict], cluster: bool = False) -> None:
    """Apply ``stages`` in order: kmeans ones as random layouts (or clustered, with ``cluster``)."""
    for stage in stages:
        if stage["method"] == "kmeans" and not cluster:
            random_layout(model, stage)
        else:
            run = recipe.model_copy()
            run.compress = load_recipe(data={"compress": [stage]}).compress
            apply_stages(model, tok, run)


def clock(device: torch.device) -> float:
    """perf_counter once the device's queued work is done (CUDA runs asynchronously)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


@torch.inference_mode()
def timings(model, batch: int, prompt: int, decode: int) -> dict[str, float]:
    """Seconds of one prefill of ``prompt`` tokens (``prompt_forward``: as generate() makes it) and
    of ``decode`` greedy steps after a 32-token prompt."""
    device = model.device
    x = torch.randint(0, model.config.vocab_size, (batch, prompt), generator=torch.Generator().manual_seed(0)).to(device)
    start = clock(device)
    prompt_forward(model, x)
    prefill = clock(device) - start
    name = cache_argument(model)
    out = prompt_forward(model, x[:, :32])
    past, token = getattr(out, name), out.logits[:, -1:].argmax(-1)
    start = clock(device)
    for _ in range(decode):
        out = model(input_ids=token, use_cache=True, **{name: past})
        past, token = getattr(out, name), out.logits[:, -1:].argmax(-1)
    return {"prefill": prefill, "decode": clock(device) - start}


@torch.no_grad()
def graph_decode_seconds(decoder: StaticDecoder, decode: int) -> float:
    """Seconds of ``decode`` greedy steps replayed from the decoder's CUDA graph (or run
    compiled: a decoder made with ``compile=True``)."""
    decoder.reset()
    start = clock(decoder.prompt.device)
    for _ in range(decode):
        decoder.step()
    return clock(decoder.prompt.device) - start


LAYER_SHAPES = [(4096, 4096), (11008, 4096), (4096, 11008)]  # (out, in) of LLaMA-7B's q/o, gate/up, down
TOY_SHAPES = [(128, 256), (256, 128)]  # the dry runs'
LAYER_MODELS = ["kmeans 4-bit per channel", "kmeans 3-bit per channel", "kmeans 2-bit per channel",
                "kmeans 2-bit, 2-d vectors per 64 channels", "kmeans 3-bit, 2-d vectors per 64 channels",
                "kmeans 2-bit, 4-d vectors per matrix", *RECIPES.values()]
LAYER_COLS = ["layer (out x in)", "model", "path", "error", "weight MB", "us per call", "x dense", "graph us per call",
              "graph x dense", "bound us", "of bound"]


@torch.no_grad()  # not inference mode: the layers cache their kernel layout by tensor version
def layer_rows(device: torch.device, dtype: torch.dtype, bandwidth: float, graph: bool,
               shapes: list[tuple[int, int]] = LAYER_SHAPES, labels: list[str] = LAYER_MODELS) -> list[dict]:
    """One decode-sized product (batch 1) per call on each (out, in) of ``shapes``: dense vs the
    kmeans layouts ``labels`` (of MODELS), microseconds per call (best of 5 runs of ``calls``;
    with ``graph``, also replayed from a CUDA graph), the weight bytes' bound, which path ran
    (the kernel or torch's decoded weight) and the largest error against float64 products."""
    gen = torch.Generator(device).manual_seed(0)
    calls = 200 if device.type == "cuda" else 5  # a GPU call takes microseconds: time many
    rows = []
    for out_f, in_f in shapes:
        layers = {"dense": torch.nn.Linear(in_f, out_f, bias=False).to(device, dtype)}
        layers |= {label: random_palettized(out_f, in_f, MODELS[label][0], gen).to(dtype) for label in labels}
        x = torch.randn(1, in_f, device=device, dtype=dtype)
        for label, layer in layers.items():
            y = layer(x)  # builds the kernel layout (and compiles / tunes the kernel) before timing
            run = lambda: [layer(x) for _ in range(calls)]  # noqa: E731
            row = {"layer (out x in)": f"{out_f} x {in_f}", "model": label, "us per call": best_seconds(run, device) / calls * 1e6}
            if label != "dense":  # which path ran, and how far its product is from the decoded weight's (float64)
                ref = x.double() @ layer.dense_weight().double().T
                row["path"] = "kernel" if layer.lut_forward(x) is not None else "torch"
                row["error"] = f"{((y.double() - ref).abs().max() / ref.abs().max()).item():.0e}"
            if graph:  # the same calls captured once and replayed: GPU time without Python's launches
                captured = torch.cuda.CUDAGraph()
                with torch.cuda.graph(captured):
                    run()
                row["graph us per call"] = best_seconds(captured.replay, device) / calls * 1e6
            weight = storage.resident_bytes(layer)
            fastest = min(row["us per call"], row.get("graph us per call", float("inf")))
            rows.append({**row, "weight MB": round(weight / 2**20, 2), "bound us": round(weight / bandwidth * 1e6, 1),
                         "of bound": f"{weight / bandwidth / fastest * 1e6:.0%}"})
        dense = rows[-len(layers)]
        for row in rows[-len(layers):]:
            for key, ratio in (("us per call", "x dense"), ("graph us per call", "graph x dense")):
                if key in row:
                    row[ratio] = round(dense[key] / row[key], 2)
        for row in rows[-len(layers):]:
            row.update({k: round(v, 1) for k, v in row.items() if k.endswith("per call")})
    return rows


def best_seconds(fn, device: torch.device, runs: int = 5) -> float:
    """The fastest of ``runs`` calls of ``fn``, in seconds."""
    best = float("inf")
    for _ in range(runs):
        start = clock(device)
        fn()
        best = min(best, clock(device) - start)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prefill", type=int, default=128, help="prompt tokens timed without a cache")
    ap.add_argument("--decode", type=int, default=16, help="tokens decoded after a 32-token prompt")
    ap.add_argument("--model", default="builtin:smollm2-135m-instruct", help="checkpoint: folder, hub id or builtin:")
    ap.add_argument("--random-weights", action="store_true", help="the checkpoint's config and tokenizer with random "
                    "weights (its weight files need not be there): speed does not depend on the values")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda (float16, CUDA timing; threads do not apply)")
    ap.add_argument("--layers", action="store_true", help="also time single products on LLaMA-7B-sized layers")
    ap.add_argument("--graph", action=argparse.BooleanOptionalAction, default=True,
                    help="on CUDA, also time decoding replayed from CUDA graphs")
    ap.add_argument("--compile", action="store_true", help="also time decoding with the step compiled (torch.compile, "
                    "static cache; about a minute of compiling per model)")
    ap.add_argument("--breakdown", action="store_true", help="also report where a decoded token's time goes (batch 1, "
                    "the first thread count), part by part")
    ap.add_argument("--cluster", action="store_true", help="build kmeans layouts by data-free clustering (minutes) "
                    "instead of random values of the same layout (seconds; the speed is the same)")
    ap.add_argument("--out", type=Path, default=REPO / "outputs" / "bench_runtime")
    ap.add_argument("--dry-run", action="store_true", help="every model built from the toy model (--layers: toy "
                    "shapes), timed once on one thread at batch 1: checks the script in seconds")
    args = ap.parse_args()
    if args.dry_run:
        args.model = str(toy_model(args.out / "toy"))
        args.threads, args.batches, args.rounds, args.prefill, args.decode = [1], [1], 1, 16, 4
    device = torch.device(args.device)
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    graphed = device.type == "cuda" and args.graph or args.compile
    static = "graph" if device.type == "cuda" and args.graph else "compiled"
    threads_list = args.threads if device.type == "cpu" else [torch.get_num_threads()]

    recipe = load_recipe(data={"model": {"path": args.model, "device": args.device}})
    if args.random_weights:
        config = AutoConfig.from_pretrained(args.model)
        original, tok = AutoModelForCausalLM.from_config(config).to(device), AutoTokenizer.from_pretrained(args.model)
    else:
        original, tok = load_model(recipe.model)
    models = {}
    for label in args.models:
        model = copy.deepcopy(original)
        build(model, tok, recipe, MODELS[label], args.cluster)
        models[label] = model.to(dtype).eval()
    del original
    for m in models.values():  # prepare kernel layouts before counting what stays resident
        timings(m, 1, 8, 1)
    resident = {label: storage.resident_bytes(m) for label, m in models.items()}

    rows = []
    for threads in threads_list:
        torch.set_num_threads(threads)
        bandwidth = copy_bandwidth(device)
        for batch in args.batches:
            best = {label: {"prefill": float("inf"), "decode": float("inf"), "graph": float("inf")} for label in models}
            prompt = torch.randint(0, 1000, (batch, 32), generator=torch.Generator().manual_seed(1)).to(device)
            graphs = {label: StaticDecoder(m, prompt, args.decode, graph=static == "graph", compile=args.compile)
                      for label, m in models.items()} if graphed else {}
            for round_ in range(args.rounds + 1):  # round 0 warms up; then the models take turns
                for label, model in models.items():
                    t = timings(model, batch, args.prefill, args.decode)
                    if graphed:
                        t["graph"] = graph_decode_seconds(graphs[label], args.decode)
                    if round_:
                        best[label] = {k: min(best[label][k], t[k]) for k in t}
            del graphs
            dense = best.get("dense")
            for label in models:
                decode_tps = batch * args.decode / best[label]["decode"]
                prefill_tps = batch * args.prefill / best[label]["prefill"]
                row = {"threads": threads if device.type == "cpu" else "-", "batch": batch, "model": label, "resident MB": round(resident[label] / 2**20, 1),
                       "decode tok/s": round(decode_tps, 1), "prefill tok/s": round(prefill_tps, 1)}
                if dense is not None:
                    row["decode x dense"] = round(dense["decode"] / best[label]["decode"], 2)
                    row["prefill x dense"] = round(dense["prefill"] / best[label]["prefill"], 2)
                if graphed:
                    graph_tps = batch * args.decode / best[label]["graph"]
                    row[f"{static} decode tok/s"] = round(graph_tps, 1)
                    if dense is not None:
                        row[f"{static} x dense"] = round(dense["graph"] / best[label]["graph"], 2)
                if batch == 1:
                    bound = bandwidth / resident[label]
                    row["decode bound tok/s"] = round(bound, 1)
                    row["of bound"] = f"{max(decode_tps, row.get(f'{static} decode tok/s', 0)) / bound:.0%}"
                rows.append(row)
                print(row, flush=True)
    paths = {label: kernel_path(m) for label, m in models.items()}
    cols = ["threads", "batch", "model", "resident MB", "decode tok/s", "decode x dense"]
    cols += [f"{static} decode tok/s", f"{static} x dense"] if graphed else []
    cols += ["decode bound tok/s", "of bound", "prefill tok/s", "prefill x dense"]
    where = f"{torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}, {str(dtype).removeprefix('torch.')}"
    name = f"{args.model}{' (random weights)' if args.random_weights else ''}"
    parts = [f"{name} on {where}; decode {args.decode} tokens after a 32-token prompt, prefill "
             f"{args.prefill} tokens; best of {args.rounds} rounds, models interleaved; kernels: {kernels.status()}",
             markdown(rows, cols), markdown([{"model": k, "path": v} for k, v in paths.items()], ["model", "path"])]
    breakdowns = {}
    if args.breakdown:  # one thread count (the first), batch 1, eager: where each model's token goes
        torch.set_num_threads(threads_list[0])
        bandwidth = copy_bandwidth(device)
        for label, model in models.items():
            breakdowns[label] = decode_breakdown(model, bandwidth)
            parts.append(f"Where a decoded token's time goes: {label} ({threads_list[0]} thread(s), batch 1, eager)\n\n"
                         + breakdown_markdown(breakdowns[label]))
    layers = []
    if args.layers:
        layers = layer_rows(device, dtype, bandwidth, device.type == "cuda" and args.graph,
                            TOY_SHAPES if args.dry_run else LAYER_SHAPES)
        parts += [f"One product per call at batch 1 on {where} (random weights; "
                  "bound = weight bytes / copy bandwidth)", markdown(layers, [c for c in LAYER_COLS if c in layers[0]])]
    md = "\n\n".join(parts)
    write_results(args.out, {"rows": rows, "paths": paths, "layers": layers, "breakdowns": breakdowns}, md)
    print(md)


if __name__ == "__main__":
    main()
