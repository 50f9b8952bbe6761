"""Trellis-coded quantization (QTIP's bit-shift trellis, with a computed Gaussian code): each row of
a target linear becomes a walk through 2^state_bits states, ``bits`` bits a weight, found by a
Viterbi search (``maths.trellis``) and stored as a ``TrellisLinear``.

The code's values are N(0, 1)'s quantiles and each row is divided by its RMS, so it fits weights
that are near-Gaussian: put ``rotate`` before it (incoherence processing, as QTIP and EXL3 do).
As with k-means, by default the error is judged at each layer's output (error feedback through
the inverse Gram matrix, ``maths.trellis.search``) in one layer-by-layer pass on the inputs the
compressed model itself produces (``refit``, ``pipeline.refit``), each module searched for the
weight that best reproduces the original layer there.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Literal

import torch
from pydantic import Field
from torch import nn

from ..errors import UsageError
from ..io.data import first_samples
from ..maths.clustering import GramFactors
from ..maths.linalg import solve_coefficients
from ..maths.trellis import search
from ..model.arch import Conv1D, dims_of, discover, target_layers, tied_to_embeddings, weight_of
from ..model.forms.wscompress_trellis import MAX_STATE_BITS, TILE, TrellisLinear
from ..pipeline.layerwise import replace_each
from ..pipeline.refit import Sums, fit_pass
from ..pipeline.stats import SharedGrams
from ..recipe.schema import LayerRefit, TargetedStage
from . import register


class TrellisConfig(TargetedStage, LayerRefit):
    """Trellis-code linear layers (default: every linear of the decoder layers)."""

    method: Literal["trellis"] = "trellis"
    bits: int = Field(3, ge=1, le=4, description="bits a weight: each step of a row's walk takes this many new bits")
    state_bits: int = Field(12, ge=2, le=MAX_STATE_BITS, description="the trellis has 2^state_bits states: more cost "
                            "less error and search time proportional to 2^state_bits (12: 4096 states)")
    error_feedback: bool = Field(True, description="judge the error at the layer's output and push each block's "
                                 "error onto the columns after it (GPTQ), from the calibration inputs' Gram matrix")
    damp: float = Field(0.01, gt=0, description="error feedback: Gram dampening, relative to its mean diagonal")

    def check(self, model: nn.Module) -> None:
        if self.bits >= self.state_bits:
            raise UsageError(f"trellis: bits={self.bits} needs state_bits above it (got {self.state_bits})",
                             "use e.g. state_bits: 12")
        for name, module in target_layers(model, self).items():
            if any(d % TILE for d in dims_of(module)):
                raise UsageError(f"trellis: {name} is {' x '.join(map(str, reversed(dims_of(module))))}, not made of "
                                 f"{TILE} x {TILE} tiles", "ignore this layer (or pad it)")
            if tied_to_embeddings(model, module) is not None:
                raise UsageError(f"trellis: {name} is tied to the input embedding, whose rows this layer does not "
                                 "decode", "leave it out of the stage's targets (or untie it)")


def encode(module: nn.Module, cfg: TrellisConfig, grams: GramFactors | None, weight: torch.Tensor | None = None,
           ) -> TrellisLinear:
    """One linear (or ``weight`` in its place) as a TrellisLinear on its device, searched with
    error feedback where ``grams`` (its inputs' Gram matrix) is given."""
    w = weight_of(module).detach() if weight is None else weight
    states, scale = search(w, cfg.bits, cfg.state_bits, grams if cfg.error_feedback else None, cfg.damp)
    return TrellisLinear.from_states(states, scale, cfg.bits, cfg.state_bits, getattr(module, "bias", None),
                                     isinstance(module, Conv1D), w.dtype)


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
                 _dtype: torch.dtype, cfg: TrellisConfig, rows: list[dict]):
        self.modules, self.weights, self.cfg, self.rows = modules, weights, cfg, rows
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
            new[name] = encode(module, self.cfg, grams, best)
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
    label = f"trellis {cfg.bits}-bit"
    grams: Mapping[str, torch.Tensor] = {}
    if cfg.error_feedback and cfg.refit and set(by_layer) - {None}:
        fit_pass(model, arch, first_samples(ctx.calibration(), cfg.refit_samples),
                 lambda i: {n: layers[n] for n in by_layer.get(i, [])},
                 lambda *args: _Search(*args, cfg=cfg, rows=rows), cfg.refit_target, ctx.dtype(model),
                 label=f"{label}: decoder layers searched and refit")
        by_layer = {None: by_layer[None]} if None in by_layer else {}
    elif cfg.error_feedback and layers:
        grams = SharedGrams(model, list(layers), ctx.stats(model, list(layers)))

    def make(name: str, module: nn.Module) -> TrellisLinear:
        layer = encode(module, cfg, GramFactors(grams[name].double()) if name in grams else None)
        rows.append(layer_report(name, weight_of(module), layer))
        return layer

    replace_each(model, {n: layers[n] for names in by_layer.values() for n in names}, make, f"{label}: matrices")
    weights = sum(r["shape"][0] * r["shape"][1] for r in rows)
    return {"layers": len(rows), "weights": weights, "bits": cfg.bits, "state_bits": cfg.state_bits,
            "bits_per_weight": sum(r["bits_per_weight"] * r["shape"][0] * r["shape"][1] for r in rows) / max(weights, 1),
            "mse": sum(r["mse"] * r["shape"][0] * r["shape"][1] for r in rows) / max(weights, 1),
            "search_seconds": round(time.perf_counter() - start, 2), "per_layer": rows}
