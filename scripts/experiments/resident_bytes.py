"""Record: resident against stored bytes of the shipped recipes' layouts (with the int8 head) at
TinyLlama-1.1B's shape, random values: the bytes a model holds once its kernels have run (a
decode step builds their layouts) against its saved folder's, for the folder loaded as a user
loads it (values as stored) and for the model just compressed (values in its float32). Behind
docs/runtime.md's resident goal (2026-11-29).

Usage: python scripts/experiments/resident_bytes.py [--tiny] [LABEL ...]   (LABEL: a bench_runtime model)
"""
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_runtime import MODELS, RECIPES, random_layout  # noqa: E402
from peers_llamacpp import SHAPES, TINY, random_model  # noqa: E402

from wscompress import compress  # noqa: E402
from wscompress.evaluation.decode import StaticDecoder  # noqa: E402
from wscompress.io import storage  # noqa: E402

shape = {**SHAPES["tinyllama"], **(TINY if "--tiny" in sys.argv else {})}
labels = [a for a in sys.argv[1:] if a != "--tiny"] or [f"{r} layout + int8 tied embedding/head" for r in RECIPES]
prompt = torch.randint(1000, 2000, (1, 8))


def resident_after_a_step(model) -> int:
    StaticDecoder(model, prompt, 2)  # builds the kernels' layouts
    return storage.resident_bytes(model)


print("| layout | stored MiB | loaded folder, resident MiB | loaded x stored | just compressed, resident MiB | "
      "compressed x stored |\n"
      "|---|---|---|---|---|---|")
for label in labels:
    model = random_model(shape)
    random_layout(model, MODELS[label][0])
    compress(model, MODELS[label][1:])
    with tempfile.TemporaryDirectory() as tmp:
        stored = storage.save(model, None, tmp)["file_bytes"]
        fresh = resident_after_a_step(model)  # the values in the model's dtype, as fine-tuning trains them
        del model
        loaded = resident_after_a_step(storage.load(tmp)[0])  # as stored: what a user runs
    print(f"| {label} | {stored / 2**20:.1f} | {loaded / 2**20:.1f} | {loaded / stored:.3f} | {fresh / 2**20:.1f} | "
          f"{fresh / stored:.3f} |", flush=True)
