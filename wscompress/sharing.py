"""Shared machinery of the structural methods (cross_layer, merge, merge_drop, soft_share):
layer groups, the leaf modules of a layer's sub-blocks, averaging, tying and calibration
activations.

Sharing happens at the level of *leaf* modules (the projections and norms that own
parameters), never the attention module itself: attention modules carry ``layer_idx`` for
the KV cache, so every layer keeps its own while its projections are one Python object.
``storage.save`` then writes each shared module once and ``storage.load`` re-ties it.
"""

from __future__ import annotations

import copy
from typing import Literal

import torch
from pydantic import Field
from torch import nn

from .arch import Arch, get_module, set_module
from .calibrate import layerwise, run_layer
from .errors import UsageError
from .recipe import StageConfig

Part = Literal["attn", "ffn", "block"]
FFN_ROLES = ("gate", "up", "down", "gate_up")


def check_groups(groups: list[list[int]], num_layers: int, what: str = "groups") -> list[list[int]]:
    """Validate explicit layer groups: no overlaps, inside the model, at least 2 layers each."""
    seen: dict[int, int] = {}
    out = []
    for g, group in enumerate(groups):
        if len(group) < 2:
            raise UsageError(f"{what}: group {group} has fewer than 2 layers", "give each group at least two layer indices")
        for i in group:
            if not 0 <= i < num_layers:
                raise UsageError(f"{what}: layer {i} in group {group} does not exist (the model has {num_layers} layers)",
                                 f"use layer indices 0..{num_layers - 1}")
            if i in seen:
                raise UsageError(f"{what}: layer {i} is in group {groups[seen[i]]} and in group {group}",
                                 "groups must not overlap: put every layer in at most one group")
            seen[i] = g
        out.append(sorted(group))
    return out


def consecutive_groups(num_layers: int, size: int, start: int = 0, count: int | None = None,
                       what: str = "group_size") -> list[list[int]]:
    """``count`` groups of ``size`` consecutive layers from ``start`` (negative: from the end);
    ``count=None`` fills the model from ``start`` (a remainder shorter than ``size`` stays unshared)."""
    first = start + num_layers if start < 0 else start
    if count is None:
        count = (num_layers - first) // size
    last = first + size * count
    if first < 0 or count < 1 or last > num_layers:
        raise UsageError(f"{what}: {count} window(s) of {size} layers from layer {start} exceed the model's {num_layers} layers",
                         f"keep every window inside layers 0..{num_layers - 1}")
    return [list(range(first + k * size, first + (k + 1) * size)) for k in range(count)]


class WindowStage(StageConfig):
    """Options placing windows of ``n`` consecutive layers (merge, merge_drop)."""

    n: int = Field(2, ge=2, description="layers per window")
    start: int | None = Field(None, description="first layer of the first window (negative: from the end); "
                                                "default: the windows end just before the last layer")
    num_windows: int = Field(1, ge=1, description="consecutive windows from start")
    groups: list[list[int]] | None = Field(None, description="explicit windows of consecutive layers "
                                                             "(instead of n/start/num_windows)")

    def windows(self, num_layers: int) -> list[list[int]]:
        if self.groups is not None:
            groups = check_groups(self.groups, num_layers)
            for g in groups:
                if g != list(range(g[0], g[-1] + 1)):
                    raise UsageError(f"groups: {g} is not a run of consecutive layers",
                                     f"e.g. {list(range(g[0], g[0] + len(g)))}")
            return groups
        start = self.start
        if start is None:  # the last layer stays as it is: it shapes the output distribution
            start = num_layers - 1 - self.n * self.num_windows
            if start < 0:
                raise UsageError(f"{self.num_windows} window(s) of {self.n} layers before the last layer need "
                                 f"{self.n * self.num_windows + 1} layers; the model has {num_layers}",
                                 "use a smaller n or num_windows, or set start (0 may include every layer)")
        return consecutive_groups(num_layers, self.n, start, self.num_windows, what="n/start/num_windows")


def leaves(module: nn.Module, prefix: str = "") -> dict[str, nn.Module]:
    """Submodules owning parameters directly, by name relative to ``module`` (with ``prefix``)."""
    out = {}
    for name, sub in module.named_modules():
        if any(True for _ in sub.parameters(recurse=False)):
            out[f"{prefix}{name}" if name else prefix.rstrip(".")] = sub
    return out


def part_leaves(arch: Arch, i: int, part: Part) -> dict[str, nn.Module]:
    """Full name -> leaf module of layer i's attention, FFN or whole block.

    The FFN is the MLP submodule when there is one (LLaMA, GPT-2), else the layer's FFN
    projections themselves (OPT keeps fc1/fc2 directly in the layer).
    """
    layer_name = arch.layer_name(i)
    if part == "block":
        return leaves(arch.layers[i], layer_name + ".")
    sub = arch.submodule_name(i, "attn" if part == "attn" else "mlp")
    if sub is not None:
        return leaves(get_module(arch.model, sub), sub + ".")
    if part == "ffn":
        names = [n for role, n in arch.projections(i).items() if role in FFN_ROLES]
        if names:
            return {n: get_module(arch.model, n) for n in names}
    raise UsageError(f"layer {i} ({type(arch.layers[i]).__name__}) has no {'attention' if part == 'attn' else 'FFN'} block",
                     "choose a part the model has (attn, ffn or block)" if part == "attn" else
                     "this model has no FFN layers to share: use part 'attn' or 'block', or another method")


def local(arch: Arch, i: int, name: str) -> str:
    """``model.layers.3.mlp.up_proj`` -> ``mlp.up_proj`` (name inside layer i)."""
    return name.removeprefix(arch.layer_name(i) + ".")


@torch.no_grad()
def average_modules(modules: list[nn.Module]) -> nn.Module:
    """A new module like ``modules[0]`` whose parameters are the element-wise mean of all."""
    out = copy.deepcopy(modules[0])
    for name, p in out.named_parameters():
        p.copy_(torch.stack([m.get_parameter(name).detach().float() for m in modules]).mean(0).to(p.dtype))
    return out


def share_group(arch: Arch, group: list[int], part: Part, source: int | Literal["mean"]) -> int:
    """Make every layer of ``group`` use one set of ``part`` leaf modules (the same objects):
    layer ``source``'s own, or new ones holding the group's mean. Returns parameters saved."""
    per_layer = [part_leaves(arch, i, part) for i in group]
    keys = [{local(arch, i, n) for n in names} for i, names in zip(group, per_layer)]
    if any(k != keys[0] for k in keys):
        raise UsageError(f"layers {group} do not have the same {part} structure", "group only layers of the same kind")
    saved = 0
    for key in sorted(keys[0]):
        modules = [get_module(arch.layers[i], key) for i in group]
        shared = average_modules(modules) if source == "mean" else get_module(arch.layers[source], key)
        saved += sum(p.numel() for p in shared.parameters()) * (len(group) - 1)
        for i in group:
            set_module(arch.layers[i], key, shared)
    return saved


class ActivationSampler:
    """Forward hooks keeping a fixed random subset of the token rows fed to some modules,
    so activation statistics of every layer fit in memory whatever the calibration size."""

    def __init__(self, modules: dict[str, nn.Module], rows_per_batch: int, seed: int = 0):
        self.rows: dict[str, list[torch.Tensor]] = {n: [] for n in modules}
        self.rows_per_batch = rows_per_batch
        self.gen = torch.Generator().manual_seed(seed)
        self.handles = [m.register_forward_hook(self._hook(n)) for n, m in modules.items()]

    def _hook(self, name: str):
        def hook(_module, args, _out):
            x = args[0].detach().reshape(-1, args[0].shape[-1])
            keep = torch.randperm(x.shape[0], generator=self.gen)[: self.rows_per_batch].to(x.device)
            self.rows[name].append(x[keep].float())
        return hook

    def close(self) -> dict[str, torch.Tensor]:
        for h in self.handles:
            h.remove()
        return {n: torch.cat(r) for n, r in self.rows.items() if r}


@torch.no_grad()
def sample_inputs(model: nn.Module, arch: Arch, batches: list[torch.Tensor], role: str,
                  rows_per_batch: int = 256) -> dict[int, torch.Tensor]:
    """Layer index -> (tokens, features) sample of the inputs of each layer's ``role``
    projection (e.g. 'down': the FFN's intermediate activations), layer by layer. Every layer
    keeps the same token positions, so row t of two layers' samples is one token: neuron
    alignment correlates them row by row."""
    out = {}
    for i, layer, inputs in layerwise(model, batches, arch, label=f"sampling {role} inputs"):
        name = arch.projections(i).get(role)
        if name is None:
            raise UsageError(f"layer {i} has no {role} projection", "this method needs FFN layers (gate/up/down projections)")
        sampler = ActivationSampler({name: get_module(model, name)}, rows_per_batch)
        run_layer(layer, inputs)
        out[i] = sampler.close()[name]
    return out
