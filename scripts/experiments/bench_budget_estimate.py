"""How well the budget's estimated cost ranks what a matrix's compression really costs: for a
sample of (matrix, layout) pairs, that one matrix is palettized alone (the rest dense) and the
mean next-token loss measured on text no choice of the method sees (pydoc: neither the
calibration text nor wiki.test or brown); the Spearman rank correlation of the loss increase
with the estimate (½ · output sensitivity · tr(ΔW·G·ΔWᵀ), methods/kmeans.py), with the same
estimate measured as the budget measures it (on the sample of rows ``measured_rows`` picks,
scaled up), with two finer weightings of the output error (each output channel by its own
sensitivity, ½ Σ_r s_r (ΔW·G·ΔWᵀ)_rr; and the channels' gradient covariance, ½ tr(S·ΔW·G·ΔWᵀ)
with S = E[g gᵀ], the Kronecker-factored Fisher) and, for comparison, with the plain weight
error ‖ΔW‖² and with the output error without sensitivity.

Usage: python scripts/experiments/bench_budget_estimate.py [--pairs 24] [--windows 8] [--calibration DIR]
(DIR: a `wscompress calibrate` output of configs/kmeans_budget_3bit.yaml, e.g.
outputs/budget/calibration/calibration, to skip collecting the statistics)
"""

from __future__ import annotations

import argparse
import math
import random
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from wscompress.evaluation.perplexity import evaluate_text
from wscompress.io.data import first_samples
from wscompress.io.checkpoints import load_model
from wscompress.methods.kmeans import every_use, measured_rows, misfit, palettize
from wscompress.model.arch import target_layers
from wscompress.model.arch import replace_everywhere, weight_of
from wscompress.pipeline.context import Context
from wscompress.pipeline.stats import SharedGrams
from wscompress.recipe.load import load_recipe

REPO = Path(__file__).resolve().parents[2]


def ranks(x: np.ndarray) -> np.ndarray:
    return np.argsort(np.argsort(x)).astype(np.float64)


def spearman(a: list[float], b: list[float]) -> float:
    return float(np.corrcoef(ranks(np.array(a)), ranks(np.array(b)))[0, 1])


def gradient_covariance(model: nn.Module, layers: dict[str, nn.Module], batches: list[torch.Tensor],
                        samples: int) -> dict[str, torch.Tensor]:
    """S = mean over tokens of g gᵀ (float64), g = ∂L/∂y at each named module's output, L a
    sequence's mean next-token loss, over the first ``samples`` calibration sequences; its
    diagonal is each channel's sensitivity, its mean diagonal the scalar the budget uses."""
    sums = {n: torch.zeros(weight_of(m).shape[0], weight_of(m).shape[0], dtype=torch.float64) for n, m in layers.items()}
    handles = []
    for name, module in layers.items():
        def observe(_m, _args, out, name=name):
            def add(g: torch.Tensor) -> None:  # returns nothing: the gradient flows on unchanged
                flat = g.reshape(-1, g.shape[-1]).double()
                sums[name].add_(flat.T @ flat)

            out.register_hook(add)
        handles.append(module.register_forward_hook(observe))
    handles.append(model.get_input_embeddings().register_forward_hook(lambda _m, _a, out: out.requires_grad_()))
    for p in model.parameters():
        p.requires_grad_(False)
    tokens = 0
    for seq in torch.cat(first_samples(batches, samples)).split(1):
        with torch.enable_grad():
            logits = model(input_ids=seq, use_cache=False).logits[0, :-1].float()
            F.cross_entropy(logits, seq[0, 1:]).backward()
        tokens += seq.numel()
    for h in handles:
        h.remove()
    return {n: s / tokens for n, s in sums.items()}


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pairs", type=int, default=24)
    ap.add_argument("--windows", type=int, default=8, help="512-token windows of pydoc per loss")
    ap.add_argument("--calibration", type=Path, default=None)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    recipe = load_recipe(REPO / "configs" / "kmeans_budget_3bit.yaml", ["output.dir=outputs/budget-estimate"])
    stage = recipe.compress[0]
    model, tokenizer = load_model(recipe.model)
    ctx = Context(recipe.calibration, tokenizer, saved=args.calibration)
    layers = target_layers(model, stage)
    every = every_use(model, layers)
    stats = ctx.stats(model, every, stage.sensitivity_samples)
    grams = SharedGrams(model, every, stats)
    covariance = gradient_covariance(model, layers, ctx.calibration(), stage.sensitivity_samples)

    def loss() -> float:
        return math.log(evaluate_text(model, tokenizer, "pydoc", 512, max_windows=args.windows)["ppl"])

    base, rng, rows = loss(), random.Random(args.seed), []
    for name in rng.sample(sorted(layers), args.pairs):
        module = layers[name]
        fitting = [c for c in stage.layouts() if not misfit(model, name, module, c)]
        layout = rng.choice(fitting)
        gram, w = grams[name].double(), weight_of(module).detach()
        palettized = palettize(module, layout, grams[name])
        delta = (palettized.dense_weight().detach() - w).double()
        by_row = delta @ gram
        per_row = (by_row * delta).sum(1)  # (ΔW·G·ΔWᵀ)_rr
        output = sampled = per_row.sum().item()
        cov = covariance[name]
        if (picked := measured_rows(w.shape[0], fitting)) is not None:  # as the budget measures it
            part = (palettize(nn.Module(), layout, grams[name], w[picked]).dense_weight().detach() - w[picked]).double()
            sampled = (part @ gram * part).sum().item() * w.shape[0] / picked.numel()
        replace_everywhere(model, module, palettized)
        rows.append({"matrix": name, "bits": layout.bits, "cluster_dim": layout.cluster_dim,
                     "estimate": 0.5 * stats.sensitivity[name] * output,
                     "sampled estimate": 0.5 * stats.sensitivity[name] * sampled,
                     "per-channel estimate": 0.5 * (cov.diagonal() * per_row).sum().item(),
                     "K-FAC estimate": 0.5 * (cov * (by_row @ delta.T)).sum().item(), "output error": output,
                     "weight error": delta.pow(2).sum().item(), "loss increase": loss() - base})
        replace_everywhere(model, palettized, module)
        print(rows[-1], flush=True)
    true = [r["loss increase"] for r in rows]
    print(f"\n{args.pairs} pairs, {args.windows} windows of pydoc, dense loss {base:.4f}: Spearman rank correlation "
          f"with the loss increase: estimate {spearman([r['estimate'] for r in rows], true):.3f}, sampled estimate "
          f"{spearman([r['sampled estimate'] for r in rows], true):.3f}, per-channel estimate "
          f"{spearman([r['per-channel estimate'] for r in rows], true):.3f}, K-FAC estimate "
          f"{spearman([r['K-FAC estimate'] for r in rows], true):.3f}, output error "
          f"{spearman([r['output error'] for r in rows], true):.3f}, weight error "
          f"{spearman([r['weight error'] for r in rows], true):.3f}")


if __name__ == "__main__":
    main()
