"""Clustering formats screened on real SmolLM2 modules without a perplexity run: the relative
output error tr(ΔW G ΔWᵀ) / tr(W G Wᵀ) of each module (G: its inputs' Gram matrix on 16 x 512
tokens of wiki.train) and the bits per weight as stored, for `kmeans` options given as
``key=value,...`` (no refit: one module at a time, on the original model's inputs).

Usage: python scripts/experiments/bench_kmeans_layers.py "bits=2" "bits=2,outliers=0" "bits=8,cluster_dim=4,granularity=per_tensor"
"""

from __future__ import annotations

import argparse
import time

import torch

from wscompress.io import data
from wscompress.io.checkpoints import load_model
from wscompress.methods.kmeans import KMeansConfig, layer_report, palettize
from wscompress.pipeline.calibration import collect_grams
from wscompress.recipe.schema import ModelConfig

MODULES = [f"model.layers.{i}.{p}" for i in (3, 15) for p in ("self_attn.q_proj", "self_attn.v_proj", "mlp.up_proj", "mlp.down_proj")]


def value(text: str) -> int | float | str:
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("configs", nargs="+", help="kmeans options, e.g. bits=3,cluster_dim=2")
    args = ap.parse_args()
    torch.manual_seed(0)
    model, tok = load_model(ModelConfig(path="builtin:smollm2-135m-instruct", dtype="float32"))
    batches = data.calibration_batches(tok, "builtin:wiki.train", 16, 512, 8, seed=2023, sampling="gptq")
    stats = collect_grams(model, batches, MODULES)
    print("| options | bits/weight | mean output error | per module | s |\n|---|---|---|---|---|")
    for text in args.configs:
        cfg = KMeansConfig(**{k: value(v) for k, v in (kv.split("=") for kv in text.split(","))})
        errors, bits, weights, start = [], 0.0, 0, time.perf_counter()
        for name in MODULES:
            module, gram = model.get_submodule(name), stats.of(name).double()
            layer = palettize(module, cfg, gram.float())
            w, dw = module.weight.double(), layer.dense_weight().detach().double() - module.weight.double()
            errors.append(float(((dw @ gram) * dw).sum() / ((w @ gram) * w).sum()))
            bits += layer_report(name, module.weight, layer)["bits_per_weight"] * module.weight.numel()
            weights += module.weight.numel()
        print(f"| {text} | {bits / weights:.3f} | {sum(errors) / len(errors):.4f} | "
              f"{' '.join(f'{e:.4f}' for e in errors)} | {time.perf_counter() - start:.1f} |", flush=True)


if __name__ == "__main__":
    main()
