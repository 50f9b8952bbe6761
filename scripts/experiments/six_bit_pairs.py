"""Record: the 3-bit recipe's layout at TinyLlama-1.1B's shape with its 6-bit pair indices read as
stored against spread to a byte a pair (the layout before), both models in one process, taking
turns: resident and stored MiB, eager decode tok/s (16 tokens after 32) and prefill tok/s (128 tokens), 1 and
2 threads. Behind docs/runtime.md's "held once" figures (2026-11-29); ``WSCOMPRESS_MARCH=haswell``
times the AVX2 build's float path.

Usage: python scripts/experiments/six_bit_pairs.py [--tiny]
"""
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_runtime import MODELS, random_layout  # noqa: E402
from peers_llamacpp import SHAPES, TINY, random_model  # noqa: E402

from wscompress import compress  # noqa: E402
from wscompress.evaluation.decode import StaticDecoder  # noqa: E402
from wscompress.io import storage  # noqa: E402
from wscompress.model.forms import wscompress_palettized  # noqa: E402

shape = {**SHAPES["tinyllama"], **(TINY if "--tiny" in sys.argv else {})}
stages = MODELS["configs/kmeans_3bit.yaml layout + float16 tied embedding/head"]
gen = torch.Generator().manual_seed(1)
prompt, prefill = torch.randint(1000, 20000, (1, 32), generator=gen), torch.randint(1000, 20000, (1, 128), generator=gen)
models, decoders = {}, {}
for label, devices in (("6-bit as stored", ("cpu",)), ("byte a pair (before)", ())):
    wscompress_palettized.SIX_BIT_PAIRS = devices  # read when a layer first builds its kernel layout
    model = random_model(shape)
    random_layout(model, stages[0])
    compress(model, stages[1:])
    models[label], decoders[label] = model, StaticDecoder(model, prompt, 16)  # eager; builds the layouts
    with tempfile.TemporaryDirectory() as tmp:
        stored = storage.save(model, None, tmp)["file_bytes"]
    print(label, "resident MiB", round(storage.resident_bytes(model) / 2**20, 1), "stored MiB", round(stored / 2**20, 1),
          flush=True)
for threads in (1, 2):
    torch.set_num_threads(threads)
    decode, fill = {k: 1e9 for k in models}, {k: 1e9 for k in models}
    for _ in range(4):
        for k in models:
            decoders[k].reset()
            t = time.perf_counter()
            for _ in range(16):
                decoders[k].step()
            decode[k] = min(decode[k], (time.perf_counter() - t) / 16)
            t = time.perf_counter()
            with torch.no_grad():
                models[k](prefill)
            fill[k] = min(fill[k], time.perf_counter() - t)
    base = decode["byte a pair (before)"]
    for k in models:
        print(f"| {threads} | {k} | decode {1 / decode[k]:.2f} tok/s ({base / decode[k]:.2f}x) | "
              f"prefill {128 / fill[k]:.1f} tok/s |", flush=True)
