"""What decoding by byte products (the LUT kernels' q8 path: 12-bit tables, activations as two
bytes a value) gains in speed and costs in quality against the float path, in one run:

1. ``--products``: single products at batch 1 on SmolLM2's shapes and a 4096 x 4096 one (larger
   than the caches), for the layouts the path covers, with random tables and indices (speed does
   not depend on them): microseconds, speed-up, and gigabytes of indices read a second; then the
   heads' products, float16 (``half_linear``) and int8 blocks (``int8_linear``), against float32 ``F.linear``.
   ``WSCOMPRESS_MARCH=haswell`` times the AVX2 build on an AVX-512 machine.
2. FOLDER ...: real compressed models: perplexity through the decode path itself
   (teacher-forced, one token a step through the KV cache, batch 1: the rows the kernels take)
   with each path, beside the prefill perplexity of the same windows (which the BLAS computes in
   float either way), and the milliseconds a decoded token took in each; then one product of
   every palettized layer in turn (a token's worth) through each operator and through the
   modules (whose difference is the eager path's cost around the kernels), and the byte
   products again with each layer's repeated from warm caches (what streaming them costs).
3. FOLDER ... --profile: where a compiled decode step's time goes, by operator.

Usage: python scripts/bench_q8.py [--products] [FOLDER ...] [--half] [--profile] [--windows 4] [--length 256] [--threads 1]
(FOLDER: a model folder `wscompress compress` wrote, e.g. of configs/kmeans_4bit.yaml)
       python scripts/bench_q8.py --dry-run   (toy shapes and a toy model, no profile: the suite runs it)
"""

from __future__ import annotations

import math
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from _common import cpu_line, parse, parser, toy_model
from bench_runtime import MODELS, RECIPES, TOY_SHAPES, random_layout
from wscompress import compress, kernels, load
from wscompress.io import data, storage
from wscompress.model.forms.wscompress_narrow import Int8Linear
from wscompress.model.forms.wscompress_palettized import round_tables

TEXTS = ["builtin:wiki.test", "builtin:brown"]
LAYOUTS = {  # label -> (index width, weights an index, table entries); tables per 64 rows
    "scalar 4-bit (nibbles)": (4, 1, 16),
    "scalar 8-bit (bytes)": (8, 1, 256),
    "2-d, 8-bit indices (4-bit recipe)": (8, 2, 256),
    "2-d, 6-bit indices a byte each (3-bit recipe on AVX2)": (8, 2, 64),
    "2-d, 6-bit indices as stored (3-bit recipe)": (6, 2, 64),
    "4-d, 8-bit indices (2-bit recipe)": (8, 4, 256),
}
SHAPES = [(576, 576), (1536, 576), (576, 1536), (4096, 4096)]  # (out, in)
HEADS = [(49152, 576), (49152, 2048), (1536, 576)]  # the narrow heads' products: SmolLM2's, TinyLlama's, a smaller one
NONE = (torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.uint16), torch.empty(0))


def best_us(f, calls: int) -> float:
    f()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            f()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6


def products(shapes: list[tuple[int, int]], heads: list[tuple[int, int]]) -> None:
    ops = torch.ops.wscompress
    print("| layout | out x in | float µs | byte products µs | speed-up | GB/s of indices |")
    print("|---|---|---|---|---|---|")
    gen = torch.Generator().manual_seed(0)
    for label, (width, d, k) in LAYOUTS.items():
        for out, inp in shapes:
            tables = torch.randn(out // 64, k, d, generator=gen)
            tables = tables[..., 0].contiguous() if d == 1 else tables
            idx = torch.randint(0, 256 if width == 4 else k, (out * inp * width // 8 // d,), dtype=torch.uint8, generator=gen)
            rounded, x = round_tables(tables, width), torch.randn(1, inp, generator=gen)
            calls = 20 if out * inp > 1e7 else 200
            fl = best_us(lambda: ops.lut_linear(x, idx, tables, width, 64, out, *NONE), calls)
            if not kernels.q8(width):  # the float path alone: what a layout without byte products runs
                print(f"| {label} | {out} x {inp} | {fl:.1f} | not on this build | | |", flush=True)
                continue
            q8 = best_us(lambda: ops.lut_linear_q8(x, idx, *rounded, width, 64, out, *NONE), calls)
            print(f"| {label} | {out} x {inp} | {fl:.1f} | {q8:.1f} | {fl / q8:.2f}x | {idx.numel() / q8 / 1e3:.1f} |", flush=True)
    # the narrow heads (method: half, method: int8) against the float32 one, the same product at batch 1
    print("\n| dense weight | out x in | float32 F.linear µs | float16 half_linear µs | int8 int8_linear µs "
          "| float16 speed-up | int8 speed-up | int8 GB/s of weights |")
    print("|---|---|---|---|---|---|---|---|")
    for out, inp in heads:
        w, x = torch.randn(out, inp, generator=gen) * 0.02, torch.randn(1, inp, generator=gen)
        w16, calls = w.half(), 20 if out * inp > 1e7 else 200
        q, s16 = Int8Linear.from_weight(w, None).stored()
        fl = best_us(lambda: F.linear(x, w), calls)
        half = best_us(lambda: ops.half_linear(x, w16, None), calls)
        int8 = best_us(lambda: ops.int8_linear(x, q, s16, None), calls)
        print(f"| head | {out} x {inp} | {fl:.1f} | {half:.1f} | {int8:.1f} | {fl / half:.2f}x | {fl / int8:.2f}x "
              f"| {(q.numel() + 2 * s16.numel()) / int8 / 1e3:.1f} |", flush=True)


def step_by_step(model, window: torch.Tensor) -> tuple[float, int, float]:
    """(summed NLL of tokens 1.., their count, seconds) decoding ``window`` one token a step."""
    cache, nll = None, 0.0
    start = time.perf_counter()
    for t in range(window.numel() - 1):
        out = model(input_ids=window[t: t + 1][None], past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        nll += F.cross_entropy(out.logits[0, -1].float()[None], window[t + 1: t + 2]).item()
    return nll, window.numel() - 1, time.perf_counter() - start


def prefilled(model, window: torch.Tensor) -> float:
    logits = model(input_ids=window[None], use_cache=False).logits[0, :-1].float()
    return F.cross_entropy(logits, window[1:], reduction="sum").item()


def toy_folder(out: Path) -> Path:
    """The toy model in the 4-bit recipe's layout (random values: the speed does not depend on them),
    saved in ``out``: a folder for the dry run."""
    model, tokenizer = load(toy_model(out / "toy"), device="cpu")
    random_layout(model, MODELS[RECIPES["configs/kmeans_4bit.yaml"]][0])
    storage.save(model, tokenizer, out / "toy-4bit")
    return out / "toy-4bit"


@torch.no_grad()
def main() -> None:
    ap = parser(__doc__, threads=1)
    ap.add_argument("folders", nargs="*", type=Path)
    ap.add_argument("--products", action="store_true", help="time single products first")
    ap.add_argument("--windows", type=int, default=4, help="windows of each text")
    ap.add_argument("--length", type=int, default=256, help="tokens a window")
    ap.add_argument("--half", action="store_true",
                    help="store each folder's tied embedding/head in float16 first (the shipped recipes' last stage, "
                         "for folders written before they had it)")
    ap.add_argument("--profile", action="store_true",
                    help="only: where a compiled decode step's time goes, by operator (torch.profiler)")
    ap.add_argument("--dry-run", action="store_true", help="--products on toy shapes, then a toy model in the 4-bit "
                    "recipe's layout with --half, one window of 32 tokens a text (no --profile): checks the script in seconds")
    args = parse(ap)
    print(f"CPU: {cpu_line()}; kernels: {kernels.status()}; threads {args.threads}")
    if args.dry_run:
        with tempfile.TemporaryDirectory() as tmp:
            products(TOY_SHAPES, [(512, 128)])
            args.folders, args.half, args.windows, args.length, args.profile = [toy_folder(Path(tmp))], True, 1, 32, False
            return folders(args)
    if args.products:
        products(SHAPES, HEADS)
    folders(args)


def folders(args) -> None:
    """Each folder's decode perplexity and speed by path, or with ``args.profile`` its compiled step's profile."""
    if not args.folders:
        return
    if not args.profile:
        print("\n| model | text | prefill ppl | decode ppl, float | decode ppl, byte products | x float | ms/token float | "
              "ms/token byte products | speed-up |")
        print("|---|---|---|---|---|---|---|---|---|")
    for folder in args.folders:
        model, tokenizer = storage.load(folder)
        model.eval()
        if args.half:
            compress(model, [{"method": "half"}])
        name = folder.parent.name if folder.name == "model" else folder.name  # a run's <output>/model
        if args.profile:
            compiled_profile(model, tokenizer, name)
            continue
        for text in TEXTS:
            ids = data.tokenize(tokenizer, text, max_tokens=args.windows * args.length)
            wins = [ids[i * args.length: (i + 1) * args.length] for i in range(args.windows)]
            tokens = sum(w.numel() - 1 for w in wins)
            prefill = math.exp(sum(prefilled(model, w) for w in wins) / tokens)
            ppl, ms = {}, {}
            for mode, on in (("float", False), ("q8", True)):  # each layout width as this CPU's build allows
                kernels._q8.clear()
                if not on:
                    kernels._q8.update({4: False, 8: False})
                runs = [step_by_step(model, w) for w in wins]
                ppl[mode] = math.exp(sum(r[0] for r in runs) / tokens)
                ms[mode] = 1e3 * sum(r[2] for r in runs) / tokens
            kernels._q8.clear()
            print(f"| {name} | {text.split(':')[-1]} | {prefill:.3f} | {ppl['float']:.3f} | {ppl['q8']:.3f} | "
                  f"{ppl['q8'] / ppl['float']:.4f} | {ms['float']:.1f} | {ms['q8']:.1f} | {ms['float'] / ms['q8']:.2f}x |",
                  flush=True)
        layer_times(model, name)


def compiled_profile(model, tokenizer, name: str, steps: int = 16) -> None:
    """Milliseconds a compiled decode step (``StaticDecoder(compile=True)``, batch 1) spends in
    each operator, by torch.profiler (which itself adds ~10 %), the unprofiled step beside them.
    The compiled graph's own code (inductor's fused norms, rotary embeddings, residual adds) runs
    inside the graph call and is counted there."""
    from torch.profiler import ProfilerActivity, profile

    from wscompress.evaluation.decode import StaticDecoder

    prompt = tokenizer("The history of the city begins with", return_tensors="pt").input_ids
    decoder = StaticDecoder(model, prompt, 2 * steps, compile=True)
    best = float("inf")
    for _ in range(3):
        decoder.reset()
        start = time.perf_counter()
        for _ in range(steps):
            decoder.step()
        best = min(best, (time.perf_counter() - start) / steps)
    decoder.reset()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            decoder.step()
    rows = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    total = sum(e.self_cpu_time_total for e in rows) / steps / 1e3
    print(f"{name}: compiled step {best * 1e3:.1f} ms unprofiled, {total:.1f} ms profiled")
    print("| operator (self time) | ms / step | calls / step |\n|---|---|---|")
    for e in rows[:8]:
        print(f"| {e.key[:60]} | {e.self_cpu_time_total / steps / 1e3:.2f} | {e.count / steps:.0f} |")


def byte_products(layout) -> bool:
    """Whether this build multiplies the layer's rounded tables by 8-bit activations (byte indices
    have no such path on AVX2)."""
    return layout.rounded is not None and kernels.q8(layout.width)


def layer_times(model, name: str) -> None:
    """Milliseconds of one batch-1 product of every palettized layer in turn."""
    from wscompress.model.forms.wscompress_palettized import PalettizedLinear

    ops = torch.ops.wscompress
    mods = [m for m in model.modules() if isinstance(m, PalettizedLinear)]
    xs = [torch.randn(1, m.in_features) for m in mods]
    for m, x in zip(mods, xs):
        m(x)
    layouts = [m.kernel_layout() for m in mods]
    sparse = [layout.outliers or NONE for layout in layouts]
    tables = [layout.tables.float().contiguous() for layout in layouts]  # as palettized_linear hands them over
    runs = {
        "float operator": lambda: [ops.lut_linear(x, a.indices, t, a.width, m.group_size, m.out_features, *o)
                                   for m, a, t, o, x in zip(mods, layouts, tables, sparse, xs)],
        "byte-product operator": lambda: [ops.lut_linear_q8(x, a.indices, *a.rounded, a.width, m.group_size,
                                                            m.out_features, *o)
                                          for m, a, o, x in zip(mods, layouts, sparse, xs) if byte_products(a)],
        "modules (byte products)": lambda: [m(x) for m, x in zip(mods, xs)]}
    times = {label: best_us(f, 3) / 1e3 for label, f in runs.items()}
    # the same products, each layer's repeated while its indices stay in the caches: what streaming costs
    times["byte-product operator, each layer from warm caches"] = sum(
        best_us(lambda: ops.lut_linear_q8(x, a.indices, *a.rounded, a.width, m.group_size, m.out_features, *o), 10) / 1e3
        for m, a, o, x in zip(mods, layouts, sparse, xs) if byte_products(a))
    print(f"{name}: {len(mods)} palettized layers, one token: "
          + ", ".join(f"{label} {ms:.1f} ms" for label, ms in times.items()), flush=True)


if __name__ == "__main__":
    main()
