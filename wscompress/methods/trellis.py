"""Trellis-coded quantization (QTIP's bit-shift trellis, with a computed Gaussian code): each row of
a target linear becomes a walk through 2^state_bits states, ``bits`` bits a weight, found by a
Viterbi search (``maths.trellis``) and stored as a ``TrellisLinear``.

The code's values are N(0, 1)'s quantiles and each row is divided by its RMS, so it fits weights
that are near-Gaussian: put ``rotate`` before it (incoherence processing, as QTIP and EXL3 do).
As with k-means, by default the error is judged at each layer's output (error feedback through
the inverse Gram matrix, ``maths.trellis.search``) in one layer-by-layer pass on the inputs the
compressed model itself produces (``refit``, ``pipeline.refit``), each module searched for the
weight that best reproduces the original layer there. With a ``budget`` each matrix gets the bits
of ``menu`` that cost the model least within it (``choose_bits``).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Literal

import numpy as np
import torch
from pydantic import Field, model_validator
from torch import nn

from ..errors import UsageError
from ..io.data import first_samples
from ..maths import knapsack
from ..maths.clustering import GramFactors
from ..maths.linalg import solve_coefficients
from ..maths.trellis import distortion, search
from ..model.arch import Conv1D, dims_of, discover, target_layers, tied_to_embeddings, weight_of
from ..model.forms.wscompress_trellis import MAX_STATE_BITS, TILE, TrellisLinear
from ..pipeline.layerwise import onloaded, replace_each
from ..pipeline.refit import Sums, fit_pass
from ..pipeline.stats import SharedGrams
from ..recipe.schema import Budget, LayerRefit, TargetedStage
from . import register
from .kmeans import beside


class TrellisConfig(TargetedStage, LayerRefit):
    """Trellis-code linear layers (default: every linear of the decoder layers)."""

    method: Literal["trellis"] = "trellis"
    bits: int = Field(3, ge=1, le=4, description="bits a weight: each step of a row's walk takes this many new bits")
    state_bits: int = Field(12, ge=2, le=MAX_STATE_BITS, description="the trellis has 2^state_bits states: more cost "
                            "less error and search time proportional to 2^state_bits (12: 4096 states)")
    error_feedback: bool = Field(True, description="judge the error at the layer's output and push each block's "
                                 "error onto the columns after it (GPTQ), from the calibration inputs' Gram matrix")
    damp: float = Field(0.01, gt=0, description="error feedback: Gram dampening, relative to its mean diagonal")
    budget: Budget | None = Field(None, description="a size the targets must fit, everything counted (bits a weight "
                                  "or bytes): each matrix gets the bits of `menu` that cost the model least within it "
                                  "(`bits` is then ignored)")
    menu: list[int] = Field([2, 3, 4], min_length=1, description="budget: the bits a weight a matrix may get")
    sensitivity_samples: int = Field(16, gt=0, description="budget: calibration sequences for the output "
                                     "sensitivities that weigh each matrix's error")

    @property
    def allocates(self) -> bool:
        """A budget weighs each matrix by its output sensitivity: `calibrate` saves them too."""
        return self.budget is not None

    @model_validator(mode="after")
    def _menu(self) -> TrellisConfig:
        if any(not 1 <= b <= 4 for b in self.menu):
            raise ValueError(f"menu {self.menu}: bits a weight are 1 to 4")
        return self

    def check(self, model: nn.Module) -> None:
        """Every target is made of whole tiles and is not the tied head; the bits fit the states;
        a budget lies between the menu's fewest bits and the dense weights."""
        most = max(self.menu) if self.budget is not None else self.bits
        if most >= self.state_bits:
            raise UsageError(f"trellis: bits={most} needs state_bits above it (got {self.state_bits})",
                             "use e.g. state_bits: 12")
        layers = target_layers(model, self)
        if self.budget is not None:
            weights = sum(weight_of(m).numel() for m in layers.values())
            budget = self.budget.bytes_for(weights) - beside(model, list(layers))
            least = sum(matrix_bytes(*reversed(dims_of(m)), min(self.menu)) for m in layers.values())
            dense = sum(weight_of(m).numel() * weight_of(m).element_size() for m in layers.values())
            self.budget.check("trellis", budget, weights, least, f"{min(self.menu)} bits a weight for every matrix",
                              dense)
        for name, module in layers.items():
            if any(d % TILE for d in dims_of(module)):
                raise UsageError(f"trellis: {name} is {' x '.join(map(str, reversed(dims_of(module))))}, not made of "
                                 f"{TILE} x {TILE} tiles", "ignore this layer (or pad it)")
            if tied_to_embeddings(model, module) is not None:
                raise UsageError(f"trellis: {name} is tied to the input embedding, whose rows this layer does not "
                                 "decode", "leave it out of the stage's targets (or untie it)")


def matrix_bytes(out_features: int, in_features: int, bits: int) -> int:
    """Bytes a trellis-coded (out, in) weight takes: its walks and its float16 row scales."""
    return out_features * in_features * bits // 8 + 2 * out_features


def encode(module: nn.Module, cfg: TrellisConfig, bits: int, grams: GramFactors | None,
           weight: torch.Tensor | None = None) -> TrellisLinear:
    """One linear (or ``weight`` in its place) as a TrellisLinear of ``bits`` a weight on its
    device, searched with error feedback where ``grams`` (its inputs' Gram matrix) is given."""
    w = weight_of(module).detach() if weight is None else weight
    states, scale = search(w, bits, cfg.state_bits, grams if cfg.error_feedback else None, cfg.damp)
    return TrellisLinear.from_states(states, scale, bits, cfg.state_bits, getattr(module, "bias", None),
                                     isinstance(module, Conv1D), w.dtype)


def choose_bits(model: nn.Module, cfg: TrellisConfig, layers: dict[str, nn.Module], ctx) -> tuple[dict[str, int], dict]:
    """Under ``cfg.budget``: the bits of ``cfg.menu`` for each matrix of least total estimated
    cost within the budget (``knapsack.choose``). A choice's cost is the loss its output error
    adds to first order, ½ · output sensitivity · E‖ΔW X‖², with the errors of a weight i.i.d. at
    the relative distortion the code reaches at those bits on Gaussian weights
    (``trellis.distortion``, which the rotation makes the weights): ½ · s · D(bits) · ‖W‖² /
    in · tr(G), G the inputs' Gram matrix. Nothing is searched to measure it."""
    names = list(layers)
    stats = ctx.stats(model, names, cfg.sensitivity_samples)
    grams = SharedGrams(model, names, stats)
    rates = np.array([distortion(b, cfg.state_bits) for b in cfg.menu])
    costs, sizes = np.zeros((len(names), len(cfg.menu))), np.zeros((len(names), len(cfg.menu)), dtype=np.int64)
    for row, name in enumerate(onloaded(model, names, f"trellis budget: {len(cfg.menu)} choices a matrix")):
        w = weight_of(layers[name]).detach().double()
        energy = w.pow(2).sum().item() / w.shape[1] * grams[name].diagonal().double().sum().item()
        costs[row] = 0.5 * stats.sensitivity.get(name, 1.0) * rates * energy
        sizes[row] = [matrix_bytes(*w.shape, b) for b in cfg.menu]
    weights = sum(weight_of(layers[n]).numel() for n in names)
    around = beside(model, names)
    picks = knapsack.choose(costs, sizes, cfg.budget.bytes_for(weights) - around)
    used = int(sum(sizes[k, j] for k, j in enumerate(picks))) + around
    chosen = {n: cfg.menu[picks[k]] for k, n in enumerate(names)}
    return chosen, {"bytes": cfg.budget.bytes_for(weights), "used_bytes": used, "beside_bytes": around,
                    "bits_per_weight": 8 * used / weights, "menu": cfg.menu,
                    "distortion": dict(zip(cfg.menu, rates.tolist())),
                    "matrices_by_bits": {b: sum(v == b for v in chosen.values()) for b in cfg.menu}, "choices": chosen}


def layer_report(name: str, weight: torch.Tensor, layer: TrellisLinear) -> dict:
    w = weight.detach().float()
    err = layer.dense_weight().detach().float() - w
    return {"layer": name, "shape": list(w.shape), "mse": err.pow(2).mean().item(),
            "rel_error": (err.norm() / w.norm().clamp_min(1e-30)).item(),
            "bits_per_weight": layer.storage_bits() / w.numel()}


class _Search:
    """A stage of ``pipeline.refit.fit_pass``: the modules reading one input, each searched once the
    pass has summed G = X'ᵀX' of what the compressed model feeds them (and H = XᵀX' where the
    target reads another input X), for W̃ = (W·H + λ·W)(G + λ·I)⁻¹, the weight that best
    reproduces its target there (as ``kmeans``' refit)."""

    def __init__(self, modules: dict[str, nn.Module], weights: dict[str, torch.Tensor], same: bool,
                 _dtype: torch.dtype, cfg: TrellisConfig, bits: Mapping[str, int], rows: list[dict]):
        self.modules, self.weights, self.cfg, self.bits, self.rows = modules, weights, cfg, bits, rows
        self.sums = Sums(same)

    def add(self, x: torch.Tensor, x_ref: torch.Tensor | None) -> None:
        self.sums.add(x, x_ref)

    def finish(self) -> tuple[dict[str, nn.Module], dict[str, torch.Tensor]]:
        gram, cross = self.sums.gram(), self.sums.cross
        grams, new = GramFactors(gram), {}
        for name, module in self.modules.items():
            w = self.weights[name]
            best = w if cross is None else \
                solve_coefficients(gram, w.double() @ cross.to(w.device), self.cfg.ridge, w).to(w.dtype)
            new[name] = encode(module, self.cfg, self.bits[name], grams, best)
            self.rows.append(layer_report(name, w, new[name]))
        return new, {}


@register(TrellisConfig)
def apply(model: nn.Module, cfg: TrellisConfig, ctx) -> dict:
    """Trellis-code every target linear, one decoder layer at a time; totals and one row a layer."""
    arch = discover(model)
    layers = target_layers(model, cfg)
    by_layer: dict[int | None, list[str]] = {}
    for name in layers:
        by_layer.setdefault(arch.layer_of(name), []).append(name)
    start, rows = time.perf_counter(), []
    bits, budget = choose_bits(model, cfg, layers, ctx) if cfg.budget is not None else ({n: cfg.bits for n in layers}, None)
    label = "trellis budget" if budget else f"trellis {cfg.bits}-bit"
    grams: Mapping[str, torch.Tensor] = {}
    if cfg.error_feedback and cfg.refit and set(by_layer) - {None}:
        fit_pass(model, arch, first_samples(ctx.calibration(), cfg.refit_samples),
                 lambda i: {n: layers[n] for n in by_layer.get(i, [])},
                 lambda *args: _Search(*args, cfg=cfg, bits=bits, rows=rows), cfg.refit_target, ctx.dtype(model),
                 label=f"{label}: decoder layers searched and refit")
        by_layer = {None: by_layer[None]} if None in by_layer else {}
    elif cfg.error_feedback and layers:
        grams = SharedGrams(model, list(layers), ctx.stats(model, list(layers)))

    def make(name: str, module: nn.Module) -> TrellisLinear:
        layer = encode(module, cfg, bits[name], GramFactors(grams[name].double()) if name in grams else None)
        rows.append(layer_report(name, weight_of(module), layer))
        return layer

    replace_each(model, {n: layers[n] for names in by_layer.values() for n in names}, make, f"{label}: matrices")
    weights = sum(r["shape"][0] * r["shape"][1] for r in rows)
    return {"layers": len(rows), "weights": weights, "bits": None if budget else cfg.bits, "state_bits": cfg.state_bits,
            "bits_per_weight": sum(r["bits_per_weight"] * r["shape"][0] * r["shape"][1] for r in rows) / max(weights, 1),
            "mse": sum(r["mse"] * r["shape"][0] * r["shape"][1] for r in rows) / max(weights, 1),
            "search_seconds": round(time.perf_counter() - start, 2), **({"budget": budget} if budget else {}),
            "per_layer": rows}
