"""ALBERT-style cross-layer sharing: groups of layers use one attention, FFN or whole block.

From a pretrained model the shared weights start from the group's element-wise mean, from a
chosen representative layer, or from the layer that reconstructs the group best: the one
whose sub-block, put in place of every group member's, changes the members' outputs on the
calibration data the least.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field, model_validator

from ..arch import discover, set_module
from ..calibrate import layerwise, run_layer
from ..errors import UsageError
from ..recipe import StageConfig
from ..sharing import Part, check_groups, consecutive_groups, local, part_leaves, share_group
from . import register


class CrossLayerConfig(StageConfig):
    method: Literal["cross_layer"] = "cross_layer"
    what: Part = Field("ffn", description="what is shared: attn, ffn or block (all of a layer's weights)")
    group_size: int | None = Field(None, ge=2, description="consecutive groups over the whole model (a remainder stays unshared)")
    groups: list[list[int]] | None = Field(None, description="explicit layer groups, e.g. [[0, 1], [4, 5, 6]]")
    init: Literal["mean", "representative", "best"] = Field("mean", description="mean of the group, one chosen layer, "
                                                                                "or the layer with the least calibration error")
    representative: int = Field(0, ge=0, description="init representative: position inside each group (0: its first layer)")

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


@register(CrossLayerConfig, whole_model=True)
def apply(model, cfg: CrossLayerConfig, ctx) -> dict:
    arch = discover(model)
    if cfg.groups is not None:
        groups = check_groups(cfg.groups, arch.num_layers)
    else:
        if cfg.group_size > arch.num_layers:
            raise UsageError(f"group_size {cfg.group_size} exceeds the model's {arch.num_layers} layers",
                             f"use a group_size of at most {arch.num_layers}")
        groups = consecutive_groups(arch.num_layers, cfg.group_size)
    for g in groups:
        part_leaves(arch, g[0], cfg.what)  # refuses a part the model lacks before any change
    if cfg.init == "representative" and any(cfg.representative >= len(g) for g in groups):
        raise UsageError(f"representative {cfg.representative} is not a position in every group {groups}",
                         f"use a position below {min(len(g) for g in groups)}")
    sources: list[int | str]
    if cfg.init == "mean":
        sources = ["mean"] * len(groups)
    elif cfg.init == "representative":
        sources = [g[cfg.representative] for g in groups]
    else:
        errors = group_errors(model, arch, groups, cfg.what, ctx.calibration())
        sources = [g[min(range(len(g)), key=lambda k: sum(errors[i][k] for i in g))] for g in groups]
    saved = sum(share_group(arch, g, cfg.what, s) for g, s in zip(groups, sources))
    return {"what": cfg.what, "groups": groups, "sources": sources, "params_saved": saved,
            "trains": [n for g in groups for n in part_leaves(arch, g[0], cfg.what)]}  # the shared modules
