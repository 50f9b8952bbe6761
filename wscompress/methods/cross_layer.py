"""ALBERT-style cross-layer sharing: groups of layers use one attention, FFN or whole block.

From a pretrained model the shared weights are fitted to the group (``init: fit``), or start
from the group's element-wise mean, from a chosen representative layer, or from the layer
that reconstructs the group best (the one whose sub-block, put in place of every member's,
changes the members' outputs on the calibration data the least).

``fit`` first aligns the members' FFN neurons to the group's first layer (their order is
arbitrary in each layer: averaging unaligned neurons averages unrelated ones), then solves
each shared linear's weight for what it computes on every member's own calibration inputs
(``_sharing.fitted_modules``). ``refit`` then takes the layers in order and re-solves the
shared linears that end a block (o_proj, down_proj) by least squares, so that each member
reproduces its original block's output on the inputs the shared layers before it feed it.
"""

from __future__ import annotations

import copy
from typing import Callable, Literal

import torch
from pydantic import Field, model_validator
from torch import nn

from ..errors import UsageError
from ..io.data import first_samples
from ..model.arch import Arch, discover, distinct, is_linear, set_module, weight_of
from ..pipeline.layerwise import layerwise, run_layer
from ..pipeline.refit import LeastSquares, WeightFit, fit_pass
from ..recipe.schema import LayerRefit, StageConfig
from . import register
from ._sharing import (
    Part,
    alignment,
    check_groups,
    consecutive_groups,
    ffn_names,
    local,
    part_leaves,
    permute_ffn,
    sample_inputs,
    shared_modules,
)

ENDS = ("o", "down")  # the roles whose output is their block's output, in forward order


class CrossLayerConfig(StageConfig, LayerRefit):
    method: Literal["cross_layer"] = "cross_layer"
    what: Part = Field("ffn", description="what is shared: attn, ffn or block (all of a layer's weights)")
    group_size: int | None = Field(None, ge=2, description="consecutive groups over the whole model (a remainder stays unshared)")
    groups: list[list[int]] | None = Field(None, description="explicit layer groups, e.g. [[0, 1], [4, 5, 6]]")
    init: Literal["fit", "mean", "representative", "best"] = Field(
        "fit", description="fit: FFN neurons aligned, then each shared linear fitted to every member's calibration "
                           "inputs; mean of the group; one chosen layer; or the layer with the least calibration error")
    representative: int = Field(0, ge=0, description="init representative: position inside each group (0: its first layer)")

    def layer_groups(self, arch: Arch) -> list[list[int]]:
        """The groups of layers that share, refused where they do not fit the model."""
        if self.groups is not None:
            groups = check_groups(self.groups, arch.num_layers)
        else:
            if self.group_size > arch.num_layers:
                raise UsageError(f"group_size {self.group_size} exceeds the model's {arch.num_layers} layers",
                                 f"use a group_size of at most {arch.num_layers}")
            groups = consecutive_groups(arch.num_layers, self.group_size)
        for g in groups:
            part_leaves(arch, g[0], self.what)  # refuses a part the model lacks
        if self.init == "representative" and any(self.representative >= len(g) for g in groups):
            raise UsageError(f"representative {self.representative} is not a position in every group {groups}",
                             f"use a position below {min(len(g) for g in groups)}")
        return groups

    def check(self, model: nn.Module) -> None:
        self.layer_groups(discover(model))

    @model_validator(mode="after")
    def _one_grouping(self):
        if (self.group_size is None) == (self.groups is None):
            raise ValueError("give exactly one of group_size or groups")
        return self


@torch.no_grad()
def group_errors(model, arch, groups: list[list[int]], part: Part, batches) -> dict[int, list[float]]:
    """Layer index -> squared output error of that layer when its ``part`` is replaced by each
    group member's (in group order), on the original model's calibration inputs."""
    where = {i: g for g in groups for i in g}
    errors: dict[int, list[float]] = {}
    for i, layer, inputs in layerwise(model, batches, arch, label="cross_layer: choosing layers"):
        if i not in where:
            continue
        reference = run_layer(layer, inputs)
        own = {local(arch, i, n): m for n, m in part_leaves(arch, i, part).items()}
        errors[i] = []
        for j in where[i]:
            for key in own:
                set_module(layer, key, part_leaves(arch, j, part)[f"{arch.layer_name(j)}.{key}"])
            errors[i].append(sum(float((y - r).double().pow(2).sum()) for y, r in zip(run_layer(layer, inputs), reference)))
            for key, module in own.items():
                set_module(layer, key, module)
    return errors


def alignable(arch: Arch, groups: list[list[int]], part: Part) -> bool:
    """Whether the groups' FFN neurons can be aligned: an FFN part with separate projections,
    each layer's own (a module an earlier stage shares cannot be permuted for one layer)."""
    if part == "attn":
        return False
    roles = [arch.projections(i) for g in groups for i in g]
    if any("gate_up" in r or "up" not in r or "down" not in r for r in roles):
        return False
    names = [n for r in roles for role, n in r.items() if role in ("gate", "up", "down")]
    return len(distinct(arch.model, names)) == len(names)


@torch.no_grad()
def fit_init(model: nn.Module, arch: Arch, groups: list[list[int]], part: Part,
             ctx) -> tuple[bool, Callable[[str], torch.Tensor]]:
    """Align the groups' FFN neurons (in place, functions unchanged) and return (aligned, a
    function: full linear name -> its input Gram matrix, in the aligned order)."""
    names = [n for g in groups for i in g for n, m in part_leaves(arch, i, part).items() if is_linear(m)]
    stats = ctx.stats(model, names)
    perms: dict[str, torch.Tensor] = {}  # down projection -> the order of its input neurons
    aligned = alignable(arch, groups, part)
    if aligned:
        acts = sample_inputs(model, arch, ctx.calibration(), "down", layers=[i for g in groups for i in g],
                             dtype=ctx.dtype(model))
        for g in groups:
            for i in g[1:]:
                perm = alignment(acts[g[0]], acts[i])
                permute_ffn(arch, i, perm)
                perms[ffn_names(arch, i, "cross_layer")["down"]] = perm

    def gram(name: str) -> torch.Tensor:
        g, p = stats.of(name), perms.get(name)
        return g if p is None else g[p][:, p]
    return aligned, gram


def refit_ends(model: nn.Module, arch: Arch, per_layer: dict[int, dict[str, nn.Module]], cfg: CrossLayerConfig,
               ctx) -> list[str]:
    """Swap the shared modules in layer by layer (``per_layer``: layer -> full name -> shared
    module; ``pipeline.refit.fit_pass``) and re-solve the shared linears that end a block
    (``ENDS``): each member's original module is the target, summed over the members so far,
    toward the shared weight it started from. Returns the refit modules' first names."""
    ends = {n for i, names in per_layer.items() for r, n in arch.projections(i).items() if r in ENDS and n in names}
    solvers: dict[int, LeastSquares] = {}
    refit: list[str] = []

    def stage(modules: dict[str, nn.Module], weights: dict[str, torch.Tensor], same: bool, _dtype) -> WeightFit | None:
        (name, shared), *more = modules.items()
        if more or name not in ends:
            return None
        if id(shared) not in solvers:
            solvers[id(shared)] = LeastSquares(weight_of(shared), cfg.ridge)
            refit.append(name)
        return WeightFit(weights[name], same, solvers[id(shared)], lambda solver: solver.write(shared))

    fit_pass(model, arch, first_samples(ctx.calibration(), cfg.refit_samples), lambda i: per_layer.get(i, {}), stage,
             cfg.refit_target, ctx.dtype(model), layers=range(max(per_layer) + 1),
             label="cross_layer: refitting shared modules")
    return refit


@register(CrossLayerConfig, whole_model=True)
def apply(model, cfg: CrossLayerConfig, ctx) -> dict:
    arch = discover(model)
    groups = cfg.layer_groups(arch)
    report: dict = {"what": cfg.what, "groups": groups, "init": cfg.init}
    gram = None
    sources: list[int | str]
    if cfg.init in ("mean", "fit"):
        sources = [cfg.init] * len(groups)
        if cfg.init == "fit":
            report["aligned_ffn_neurons"], gram = fit_init(model, arch, groups, cfg.what, ctx)
    elif cfg.init == "representative":
        sources = [g[cfg.representative] for g in groups]
    else:
        errors = group_errors(model, arch, groups, cfg.what, ctx.calibration())
        sources = [g[min(range(len(g)), key=lambda k: sum(errors[i][k] for i in g))] for g in groups]
    per_layer: dict[int, dict[str, nn.Module]] = {}  # layer -> full name -> its shared module
    saved = 0
    for g, source in zip(groups, sources):
        shared, n = shared_modules(arch, g, cfg.what, source, gram)
        if isinstance(source, int) and cfg.refit:  # a copy: the source layer's own modules stay the refit's targets
            shared = {key: copy.deepcopy(m) for key, m in shared.items()}
        per_layer |= {i: {f"{arch.layer_name(i)}.{key}": m for key, m in shared.items()} for i in g}
        saved += n
    report |= {"sources": sources, "params_saved": saved}
    if cfg.refit:
        report["refit"] = refit_ends(model, arch, per_layer, cfg, ctx)
    else:
        for name, module in ((n, m) for modules in per_layer.values() for n, m in modules.items()):
            set_module(model, name, module)
    return report | {"trains": [n for g in groups for n in part_leaves(arch, g[0], cfg.what)]}  # the shared modules
