"""Stage ``svd``: per-layer low-rank factorisation, plain truncated SVD or SVD-LLM.

Each targeted linear W (out, in) becomes coeff(basis(x)) with rank k chosen so the pair
holds (1 - ratio) of W's parameters. With ``whitening: true`` (SVD-LLM, Wang et al. 2024)
the SVD is taken of W·S, S the Cholesky factor of the layer's input Gram matrix XᵀX from
calibration data, so the truncation minimises the error on real activations instead of on
the weights. ``LowRankLinear`` (``modeling_wscompress``) is also what Basis Sharing uses for its private layers.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field, model_validator
from torch import nn

from ..io.data import first_samples
from ..io.offload import offload_of
from ..maths.allocation import Unit, allocate, spectrum
from ..maths.linalg import low_rank, rank_for_ratio
from ..model.arch import decoder_projections, dims_of, discover, distinct, get_module, replace_everywhere, weight_of
from ..model.forms.wscompress_lowrank import LowRankLinear
from ..pipeline.refit import refit_pass
from ..pipeline.stats import SharedGrams
from ..recipe.schema import LayerRefit, TargetedStage
from . import register

Allocation = Literal["uniform", "fisher"]


class LowRankConfig(TargetedStage, LayerRefit):
    """Options common to the SVD-family stages."""

    ratio: float = Field(0.2, gt=0, lt=1, description="fraction of the targets' parameters to remove")
    rank: int | None = Field(None, gt=0, description="fixed rank instead of ratio (capped at full rank)")
    allocation: Allocation = Field("fisher", description="uniform: every matrix loses `ratio`; fisher: one "
                                   "budget, ranks where they cost the model's loss least (see allocation.py)")
    sensitivity_samples: int = Field(16, gt=0, description="fisher: calibration sequences for the sensitivities")
    ridge: float = Field(1e-3, ge=0, description="refit: ridge toward the unrefit coefficients, relative to the "
                                                  "mean diagonal of B·G·Bᵀ (weaker than for whole weights: k "
                                                  "coefficients a row do not overfit the calibration set)")

    @model_validator(mode="after")
    def _ratio_or_rank(self):
        if {"ratio", "rank"} <= self.model_fields_set and self.rank is not None:
            raise ValueError("give either ratio or rank, not both")
        return self

    def check(self, model: nn.Module) -> None:
        decoder_projections(model, discover(model), self)  # every target pattern names a projection

    def rank_for(self, d_in: int, d_out: int, n: int = 1) -> int:
        return self.rank if self.rank is not None else rank_for_ratio(d_in, d_out, self.ratio, n)

    @property
    def allocates(self) -> bool:
        """Ranks come from the global allocation (not one ratio or a fixed rank per matrix)."""
        return self.allocation == "fisher" and self.rank is None

    def allocation_label(self) -> str:
        return "rank" if self.rank is not None else self.allocation


class SVDConfig(LowRankConfig):
    method: Literal["svd"] = "svd"
    whitening: bool = Field(True, description="SVD-LLM whitening with calibration statistics (false: plain SVD)")

    @model_validator(mode="after")
    def _plain_svd_is_data_free(self):
        """Plain SVD needs no calibration data, so by default it keeps one ratio per matrix and no refit."""
        if not self.whitening and "allocation" not in self.model_fields_set:
            self.allocation = "uniform"
        if not self.whitening and "refit" not in self.model_fields_set:
            self.refit = False
        return self


@register(SVDConfig)
def apply(model: nn.Module, cfg: SVDConfig, ctx) -> dict:
    arch = discover(model)
    offload = offload_of(model)
    chosen = decoder_projections(model, arch, cfg)
    every = list(chosen)
    names = distinct(model, every)  # a module shared by layers: factorised once, where first used
    in_layer = {i: [n for n in names if chosen[n][0] == i] for i in range(arch.num_layers)}
    layers = [[i] for i in range(arch.num_layers) if in_layer[i]]
    stats = ctx.stats(model, every, cfg.sensitivity_samples if cfg.allocates else 0) \
        if cfg.whitening or cfg.allocates else None
    grams = SharedGrams(model, every, stats) if cfg.whitening else {}
    if cfg.allocates:
        units = []
        for (i,) in offload.groups(layers, "svd spectra"):
            for n in in_layer[i]:
                w = weight_of(get_module(model, n))
                units.append(Unit(n, spectrum(w, grams.get(n)) * stats.sensitivity[n], sum(w.shape), w.numel()))
        wanted = allocate(units, cfg.ratio)
    else:
        wanted = {n: cfg.rank_for(*dims_of(get_module(model, n))) for n in names}
    shifted = []

    def build(i: int) -> dict[str, LowRankLinear]:
        """Layer i's replacements (the layer onloaded)."""
        new = {}
        for name in in_layer[i]:
            if wanted[name] is None:  # the allocation keeps it dense
                continue
            module = get_module(model, name)
            coeff, basis, how = low_rank(weight_of(module), wanted[name], grams.get(name))
            new[name] = LowRankLinear.replacing(module, coeff, basis)
            if how == "shifted":
                shifted.append(name)
        return new

    with torch.no_grad():
        if cfg.refit:
            refit_pass(model, arch, first_samples(ctx.calibration(), cfg.refit_samples), build, cfg.ridge, cfg.refit_target,
                       ctx.dtype(model))
        else:
            for (i,) in offload.groups(layers, "svd layers"):
                for name, module in build(i).items():
                    replace_everywhere(model, get_module(model, name), module)
    ranks = {n: None if wanted[n] is None else min(wanted[n], *dims_of(get_module(model, n))) for n in names}
    return {"modules": len(names), "allocation": cfg.allocation_label(),
            "ranks": ranks, "dense": [n for n, k in ranks.items() if k is None], "whitening": cfg.whitening,
            "refit": cfg.refit, "gram_shifted": shifted}
