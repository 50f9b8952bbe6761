"""Stage ``svd``: per-layer low-rank factorisation, plain truncated SVD or SVD-LLM.

Each targeted linear W (out, in) becomes coeff(basis(x)) with rank k chosen so the pair
holds (1 - ratio) of W's parameters. With ``whitening: true`` (SVD-LLM, Wang et al. 2024)
the SVD is taken of W·S, S the Cholesky factor of the layer's input Gram matrix XᵀX from
calibration data, so the truncation minimises the error on real activations instead of on
the weights. ``LowRankLinear`` (here) is also what Basis Sharing uses for its private layers.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field, model_validator
from torch import nn

from .. import ui
from ..allocation import Unit, allocate, spectrum
from ..arch import Arch, Conv1D, discover, distinct, get_module, match_modules, replace_everywhere, weight_of
from ..calibrate import shared_grams
from ..linalg import low_rank, rank_for_ratio
from ..modules import CompressedLinear, register_module
from ..recipe import StageConfig
from . import register

Allocation = Literal["uniform", "fisher"]


@register_module
class LowRankLinear(CompressedLinear):
    """y = coeff(basis(x)): a (rank, in) basis then (out, rank) coefficients (+ the original bias)."""

    def __init__(self, in_features: int, out_features: int, rank: int, bias: bool = False, conv1d: bool = False):
        super().__init__()
        self.in_features, self.out_features, self.rank = in_features, out_features, rank
        self.conv1d = conv1d
        self.basis = nn.Linear(in_features, rank, bias=False)
        self.coeff = nn.Linear(rank, out_features, bias=bias)

    @property
    def bias(self) -> torch.Tensor | None:
        return self.coeff.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.coeff(self.basis(x))

    def dense_weight(self) -> torch.Tensor:
        return weight_of(self.coeff) @ weight_of(self.basis)  # either factor may be palettized in turn

    def spec(self) -> dict:
        return {"in_features": self.in_features, "out_features": self.out_features, "rank": self.rank,
                "bias": self.bias is not None, "conv1d": self.conv1d}

    @classmethod
    def replacing(cls, original: nn.Module, coeff: torch.Tensor, basis: nn.Linear | torch.Tensor) -> LowRankLinear:
        """The low-rank stand-in for ``original`` (its bias, dtype and device kept): coefficients
        (out, rank) and a basis given as a (rank, in) tensor or as an existing module to share."""
        w = weight_of(original)
        bias = getattr(original, "bias", None)
        rank = coeff.shape[1]
        new = cls(w.shape[1], w.shape[0], rank, bias=bias is not None, conv1d=bool(Conv1D) and isinstance(original, Conv1D))
        new.to(device=w.device, dtype=w.dtype)
        with torch.no_grad():
            if isinstance(basis, nn.Linear):
                new.basis = basis
            else:
                new.basis.weight.copy_(basis)
            new.coeff.weight.copy_(coeff)
            if bias is not None:
                new.coeff.bias.copy_(bias)
        return new


class LowRankConfig(StageConfig):
    """Options common to the SVD-family stages."""

    ratio: float = Field(0.2, gt=0, lt=1, description="fraction of the targets' parameters to remove")
    rank: int | None = Field(None, gt=0, description="fixed rank instead of ratio (capped at full rank)")
    allocation: Allocation = Field("fisher", description="uniform: every matrix loses `ratio`; fisher: one "
                                   "budget, ranks where they cost the model's loss least (see allocation.py)")
    sensitivity_samples: int = Field(16, gt=0, description="fisher: calibration sequences for the sensitivities")

    @model_validator(mode="after")
    def _ratio_or_rank(self):
        if {"ratio", "rank"} <= self.model_fields_set and self.rank is not None:
            raise ValueError("give either ratio or rank, not both")
        return self

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
        """Plain SVD needs no calibration data, so by default it keeps one ratio per matrix."""
        if not self.whitening and "allocation" not in self.model_fields_set:
            self.allocation = "uniform"
        return self


def decoder_projections(model: nn.Module, arch: Arch, cfg: StageConfig) -> dict[str, tuple[int, str]]:
    """name -> (layer index, role) of the decoder-layer projections a stage compresses: all of
    them by default, those matching ``targets`` (and not ``ignore``) otherwise."""
    found = {name: (i, role) for i in range(arch.num_layers) for role, name in arch.projections(i).items()}
    chosen = match_modules(model, cfg.targets or ["."], cfg.ignore, what=f"{cfg.method}.targets")
    return {n: v for n, v in found.items() if n in chosen}


@register(SVDConfig)
def apply(model: nn.Module, cfg: SVDConfig, ctx) -> dict:
    arch = discover(model)
    every = list(decoder_projections(model, arch, cfg))
    names = distinct(model, every)  # a module shared by layers: factorised once
    wanted: dict[str, int | None] = {n: cfg.rank_for(*reversed(weight_of(get_module(model, n)).shape)) for n in names}
    grams = shared_grams(model, every, *ctx.grams(model, every)) if cfg.whitening else {}
    if cfg.allocates:
        scale = ctx.sensitivity(model, names, cfg.sensitivity_samples)
        units = []
        for n in ui.track(names, "svd spectra"):
            w = weight_of(get_module(model, n))
            units.append(Unit(n, spectrum(w, grams.get(n)) * scale[n], sum(w.shape), w.numel()))
        wanted = allocate(units, cfg.ratio)
    ranks: dict[str, int | None] = {}
    shifted = []
    with torch.no_grad():
        for name in ui.track(names, "svd layers"):
            module = get_module(model, name)
            ranks[name] = wanted[name]
            if wanted[name] is None:  # the allocation keeps it dense
                continue
            coeff, basis, how = low_rank(weight_of(module), wanted[name], grams.get(name))
            replace_everywhere(model, module, LowRankLinear.replacing(module, coeff, basis))
            ranks[name] = coeff.shape[1]
            if how == "shifted":
                shifted.append(name)
    return {"modules": len(names), "allocation": cfg.allocation_label(),
            "ranks": ranks, "dense": [n for n, k in ranks.items() if k is None], "whitening": cfg.whitening,
            "gram_shifted": shifted}
