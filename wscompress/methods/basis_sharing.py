"""Stage ``basis_sharing``: one low-rank basis shared by a group of consecutive layers
(Basis Sharing, Wang et al., ICLR 2025, arXiv 2410.03765).

For every shared projection type (e.g. q) and every group of ``group_size`` consecutive
layers, the group's weights are stacked along the output dimension, whitened with the
Cholesky factor of the group's summed input Gram matrices (each divided by its layer's
output energy tr(W·G·Wᵀ), so all layers of a group count alike), and factorised by SVD into one
basis (in -> k) that every layer of the group references (the very same module object, so
memory and the checkpoint hold it once) and per-layer coefficients (k -> out). The SVD's
coefficients are optimal for the group's summed statistics; each layer's are then re-solved
by least squares on its own Gram matrix (C = W·G·Bᵀ·(B·G·Bᵀ)⁻¹), which lowers every
layer's output error at no cost in size (on SmolLM2 this is what puts Basis Sharing ahead of
SVD-LLM at every ratio, see scripts/experiments/bench_basis_sharing.py). The rank
k = floor((1 - r)·n·d_in·d_out / (d_in + n·d_out)) removes ``ratio`` of the group's
parameters. Private projections are compressed per layer at the same ratio (SVD-LLM).
With ``refit: true`` every module's coefficients are then re-solved, module by module in
forward order, so that fed what the compressed model produces it reproduces what the original
layer computes from the same layer input (an extension of the official update step; see
``compensate``).
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field, model_validator
from torch import nn

from ..errors import UsageError
from ..io.data import first_samples
from ..io.offload import offload_of
from ..maths.allocation import Unit, allocate, spectrum
from ..maths.linalg import low_rank, refit_coefficients
from ..model.arch import Arch, decoder_projections, dims_of, discover, get_module, require_unshared, set_module, weight_of
from ..model.forms.wscompress_lowrank import SharedBasisLinear
from ..pipeline.refit import refit_pass
from . import register
from .svd import LowRankConfig, LowRankLinear

Role = Literal["q", "k", "v", "o", "qkv", "gate", "up", "down", "gate_up"]


class BasisSharingConfig(LowRankConfig):
    method: Literal["basis_sharing"] = "basis_sharing"
    group_size: int = Field(2, gt=0, description="consecutive layers sharing one basis per projection type")
    shared: list[Role] | None = Field(None, description="roles that share bases (default: per architecture)")
    private: list[Role] | None = Field(None, description="roles compressed per layer (default: the other roles)")

    def check(self, model: nn.Module) -> None:
        arch = discover(model)
        layer_groups(arch.num_layers, self.group_size)
        compressed_names(model, arch, self)

    @model_validator(mode="after")
    def _disjoint_roles(self):
        both = set(self.shared or ()) & set(self.private or ())
        if both:
            raise ValueError(f"roles {sorted(both)} are both shared and private")
        return self


def default_roles(arch: Arch) -> tuple[list[str], list[str]]:
    """The paper's choice: share the projections reading the block input (q, k, v, gate, up;
    fused qkv for GPT-2), keep o and down private. GQA's small k/v matrices lose more than
    they gain from sharing, so with GQA only q, gate and up share."""
    shareable = {"q", "qkv", "gate", "up", "gate_up"} | (set() if arch.is_gqa else {"k", "v"})
    roles = arch.roles()
    return [r for r in roles if r in shareable], [r for r in roles if r not in shareable]


def relative(w: torch.Tensor, gram: torch.Tensor) -> torch.Tensor:
    """``gram`` divided by the layer's output energy ‖W·S‖² = tr(W·G·Wᵀ): summed over a group,
    every layer then weighs by its relative error, not by the size of its activations (which
    grows with depth and would let the group's last layers claim the shared basis)."""
    w = w.double()
    return gram / ((w @ gram) * w).sum().clamp_min(1e-30)  # the trace without the (out, out) product


def layer_groups(num_layers: int, group_size: int) -> list[list[int]]:
    """Consecutive groups; when group_size does not divide the depth, the last group holds
    the remaining layers and gets its own (smaller-n) rank budget."""
    if group_size > num_layers:
        raise UsageError(f"basis_sharing.group_size {group_size} exceeds the model's {num_layers} layers",
                         f"use a group_size between 1 and {num_layers}")
    return [list(range(s, min(s + group_size, num_layers))) for s in range(0, num_layers, group_size)]


def resolve_roles(arch: Arch, cfg: BasisSharingConfig) -> tuple[list[str], list[str]]:
    shared, private = default_roles(arch)
    if cfg.shared is not None:
        shared = list(cfg.shared)
        if cfg.private is None:
            private = [r for r in arch.roles() if r not in shared]
    if cfg.private is not None:
        private = list(cfg.private)
    unknown = [r for r in shared + private if r not in arch.roles()]
    if unknown:
        raise UsageError(f"basis_sharing: this model has no {unknown[0]!r} projection",
                         f"its roles are {', '.join(arch.roles())}")
    return shared, private


def compressed_names(model: nn.Module, arch: Arch, cfg: BasisSharingConfig) -> tuple[dict[str, tuple[int, str]], list[str]]:
    """(the projections the targets choose, with their layer and role; those of them the stage
    compresses): it refuses a choice with none, or with a module that layers share."""
    shared, private = resolve_roles(arch, cfg)
    chosen = decoder_projections(model, arch, cfg)
    names = [n for n, (_, role) in chosen.items() if role in shared + private]
    if not names:
        raise UsageError("basis_sharing: the targets select none of the shared or private projections",
                         "widen targets or name the roles in shared/private")
    require_unshared(model, names, "basis_sharing")  # stacking one module twice is no sharing
    return chosen, names


@register(BasisSharingConfig)
def apply(model: nn.Module, cfg: BasisSharingConfig, ctx) -> dict:
    arch = discover(model)
    offload = offload_of(model)
    groups = layer_groups(arch.num_layers, cfg.group_size)
    shared, private = resolve_roles(arch, cfg)
    chosen, names = compressed_names(model, arch, cfg)
    stats = ctx.stats(model, names, cfg.sensitivity_samples if cfg.allocates else 0)
    parts: dict[int, list[tuple[str, list[str]]]] = {}  # group index -> its factorisations (role, members)
    for g, group in enumerate(groups):
        for role in shared + private:
            members = [n for i in group if (n := arch.projections(i).get(role)) in chosen]
            parts.setdefault(g, []).extend((role, p) for p in ([members] if role in shared else [[n] for n in members]) if p)
    scale = stats.sensitivity if cfg.allocates else None

    def stacked(part: list[str], weigh: bool = True) -> tuple[list[torch.Tensor], torch.Tensor]:
        """The part's weights and the Gram its basis is whitened with: the layers' Grams each
        weighted by their sensitivity (fisher) or divided by their output energy (uniform).
        ``weigh=False`` leaves a one-layer part's Gram as it is: a positive factor on it changes
        its spectrum (which the allocation compares) but not its basis."""
        ws = [weight_of(get_module(model, n)) for n in part]
        g = [stats.of(n).to(ws[0].device) for n in part]
        if not weigh and len(part) == 1:
            return ws, g[0]
        return ws, sum(gi * scale[n] if scale else relative(wi, gi) for n, wi, gi in zip(part, ws, g))

    if scale:
        units = []
        for g, _group in enumerate(offload.groups(groups, "basis sharing spectra")):
            for _role, part in parts[g]:
                ws, gram = stacked(part)
                units.append(Unit(part[0], spectrum(torch.cat(ws), gram), ws[0].shape[1] + sum(w.shape[0] for w in ws),
                                  sum(w.numel() for w in ws)))
        wanted = allocate(units, cfg.ratio)
    else:
        wanted = {part[0]: cfg.rank_for(*dims_of(get_module(model, part[0])), len(part))
                  for g in parts.values() for _, part in g}

    ranks: dict[str, int | None] = {}
    shifted: list[str] = []

    def build(g: int) -> dict[str, LowRankLinear]:
        """Group g's replacements, built from its original weights (the group onloaded)."""
        new = {}
        for role, part in parts[g]:
            label = f"{part[0]} (+{len(part) - 1} sharing)" if len(part) > 1 else part[0]
            ranks[label] = wanted[part[0]]
            if wanted[part[0]] is None:  # the allocation keeps these dense
                continue
            ws, gram = stacked(part, weigh=False)
            w = torch.cat(ws)  # (n·out, in): one basis for all
            d_out, d_in = ws[0].shape
            coeff, basis, how = low_rank(w, wanted[part[0]], gram)
            if how == "shifted":
                shifted.append(part[0])
            if len(part) > 1:  # the basis suits the group; each layer's coefficients can suit it alone
                coeff = torch.cat([refit_coefficients(wi, basis, stats.of(n)) for n, wi in zip(part, ws)])
            ranks[label] = basis.shape[0]
            if role in shared:
                lin = nn.Linear(d_in, basis.shape[0], bias=False, device=w.device, dtype=w.dtype)
                lin.weight.copy_(basis)
                basis = lin
            cls = SharedBasisLinear if role in shared else LowRankLinear
            for n, c in zip(part, coeff.split(d_out)):
                new[n] = cls.replacing(get_module(model, n), c, basis)
        return new

    with torch.no_grad():
        if cfg.refit:
            built: dict[str, LowRankLinear] = {}  # a group's replacements wait for their layer's turn

            def layer(i: int) -> dict[str, LowRankLinear]:
                g = next(g for g, group in enumerate(groups) if i in group)
                if i == groups[g][0]:
                    with offload.onload(groups[g]):
                        built.update(build(g))
                return {n: built.pop(n) for n in list(built) if chosen[n][0] == i}

            refit_pass(model, arch, first_samples(ctx.calibration(), cfg.refit_samples), layer, cfg.ridge, cfg.refit_target,
                       ctx.dtype(model))
        else:
            for g, group in enumerate(offload.groups(groups, "basis sharing groups")):
                for n, module in build(g).items():
                    set_module(model, n, module)
    remainder = len(groups[-1]) if len(groups[-1]) != cfg.group_size else 0
    return {"groups": len(groups), "group_size": cfg.group_size,
            "remainder": (f"the last {remainder} layers form their own group with their own rank budget"
                          if remainder else None),
            "shared": shared, "private": private, "allocation": cfg.allocation_label(),
            "ranks": ranks, "dense": [n for n, k in ranks.items() if k is None], "refit": cfg.refit,
            "gram_shifted": shifted}
