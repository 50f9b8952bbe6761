"""Does a least-squares codebook update after error feedback lower a matrix's output error?
GPTVQ (van Baalen et al. 2024) follows its GPTQ-style assignment with an update of the
codebook for the indices chosen. With the indices fixed the output error tr(ΔW·G·ΔWᵀ) is a
quadratic in the codebook entries, so its exact minimum is one linear solve: conjugate
gradients, each step one product with the Gram matrix, preconditioned by the diagonal. This
palettizes every matrix of two layers of SmolLM2-135M with the budget menu's 2-d layouts (on
the protocol's calibration statistics, as the budget measures them) and prints each matrix's
output error before and after the update, the new codebook rounded to float16 as stored.

Usage: python scripts/experiments/bench_codebook_update.py [--layers 4 20] [--calibration DIR]
(DIR: a `wscompress calibrate` output of configs/kmeans_budget_3bit.yaml, to skip collecting
the statistics)
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch import nn

from wscompress.io.checkpoints import load_model
from wscompress.methods.kmeans import every_use, palettize
from wscompress.model.arch import target_layers
from wscompress.model.arch import weight_of
from wscompress.model.forms.wscompress_palettized import PalettizedLinear
from wscompress.pipeline.context import Context
from wscompress.pipeline.stats import SharedGrams
from wscompress.recipe.load import load_recipe

REPO = Path(__file__).resolve().parents[2]


def output_error(w: torch.Tensor, layer: PalettizedLinear, gram: torch.Tensor) -> float:
    delta = layer.dense_weight().detach().double() - w.double()
    return (delta @ gram * delta).sum().item()


def update_codebook(w: torch.Tensor, layer: PalettizedLinear, gram: torch.Tensor, steps: int = 25) -> torch.Tensor:
    """The codebook minimising tr((W − Ŵ)·G·(W − Ŵ)ᵀ) for the layer's indices, scales and
    kept-aside weights (which stay as they are), rounded to float16."""
    out, inp = w.shape
    groups, k, d = layer.codebook.shape
    idx = layer.index_matrix()
    row_group = torch.arange(out)[:, None] // (out // groups)
    entry = (((row_group * k + idx)[..., None] * d + torch.arange(d)).reshape(out, inp))  # weight -> codebook entry
    scale = layer.scale.detach().double()[:, None] if layer.scale is not None else torch.ones(out, 1, dtype=torch.float64)
    free = torch.ones(out * inp, dtype=torch.float64)
    aside = torch.zeros(out * inp, dtype=torch.float64)
    if layer.outliers:
        free[layer.outlier_index.long()] = 0
        aside[layer.outlier_index.long()] = layer.outlier_value.detach().double()
    free, aside = free.view(out, inp), aside.view(out, inp)
    n = layer.codebook.numel()

    def gather(c: torch.Tensor) -> torch.Tensor:  # codebook -> its part of Ŵ
        return scale * c[entry] * free

    def scatter(m: torch.Tensor) -> torch.Tensor:  # adjoint of gather
        return torch.zeros(n, dtype=torch.float64).index_add_(0, entry.reshape(-1), (scale * m * free).reshape(-1))

    def hessian(c: torch.Tensor) -> torch.Tensor:
        return scatter(gather(c) @ gram)

    diagonal = scatter(scale * gram.diagonal()[None])
    inverse = torch.where(diagonal > 0, 1 / diagonal, torch.zeros_like(diagonal))  # unused entries: left alone
    x = layer.codebook.detach().double().reshape(-1).clone()
    r = scatter((w.double() - aside) @ gram) - hessian(x)
    z = inverse * r
    p, rz = z.clone(), (r * z).sum()
    for _ in range(steps):
        hp = hessian(p)
        alpha = rz / (p * hp).sum().clamp_min(1e-300)
        x, r = x + alpha * p, r - alpha * hp
        z = inverse * r
        rz, before = (r * z).sum(), rz
        p = z + rz / before * p
    return x.view_as(layer.codebook).half().to(layer.codebook.dtype)


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, nargs="*", default=[4, 20])
    ap.add_argument("--calibration", type=Path, default=None)
    args = ap.parse_args()
    recipe = load_recipe(REPO / "configs" / "kmeans_budget_3bit.yaml", ["output.dir=outputs/codebook-update"])
    stage = recipe.compress[0]
    model, tokenizer = load_model(recipe.model)
    ctx = Context(recipe.calibration, tokenizer, saved=args.calibration)
    layers = target_layers(model, stage)
    every = every_use(model, layers)
    grams = SharedGrams(model, every, ctx.stats(model, every))
    print("| matrix | index bits | output error | after the update | ratio |\n|---|---|---|---|---|")
    ratios = []
    for name in sorted(n for n in layers if any(f".layers.{i}." in n for i in args.layers)):
        w, gram = weight_of(layers[name]).detach().float(), grams[name].double()
        for layout in (c for c in stage.layouts() if c.cluster_dim == 2):
            layer = palettize(nn.Module(), layout, gram, w)
            before = output_error(w, layer, gram)
            layer.codebook.data = update_codebook(w, layer, gram)
            after = output_error(w, layer, gram)
            ratios.append(after / before)
            print(f"| {name} | {layout.bits} | {before:.4g} | {after:.4g} | {after / before:.3f} |", flush=True)
    print(f"\n{len(ratios)} results: the update leaves {min(ratios):.3f}-{max(ratios):.3f} of the output error")


if __name__ == "__main__":
    main()
