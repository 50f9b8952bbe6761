"""Shared machinery of the structural methods (cross_layer, merge, merge_drop, soft_share):
layer groups, the leaf modules of a layer's sub-blocks, averaging or fitting shared weights,
tying, calibration activations and FFN neuron alignment.

Sharing happens at the level of *leaf* modules (the projections and norms that own
parameters), never the attention module itself: attention modules carry ``layer_idx`` for
the KV cache, so every layer keeps its own while its projections are one Python object.
``storage.save`` then writes each shared module once and ``storage.load`` re-ties it.
"""

from __future__ import annotations

import copy
from typing import Callable, Collection, Literal

import torch
from pydantic import Field
from torch import nn

from ..errors import UsageError, need
from ..maths.linalg import solve_coefficients
from ..model.arch import Arch, discover, get_module, is_linear, set_module, weight_of
from ..pipeline.layerwise import computing_in, layerwise, run_layer
from ..recipe.schema import WEIGHT_RIDGE, StageConfig

Part = Literal["attn", "ffn", "block"]
FFN_ROLES = ("gate", "up", "down", "gate_up")
OUTPUT_ROLES = ("gate", "up")  # rows are the FFN's neurons; "down" has them as columns
Weights = tuple[torch.Tensor, torch.Tensor | None]  # (weight (out, in), bias)
FIT_RIDGE = WEIGHT_RIDGE  # shared weights fitted toward the group's mean, as the refits of whole weights


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

    def check(self, model: nn.Module) -> None:
        self.windows(discover(model).num_layers)


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


@torch.no_grad()
def fitted_modules(modules: list[nn.Module], grams: list[torch.Tensor]) -> nn.Module:
    """Like ``average_modules``, but a linear's weight is the one that serves every member best
    on its own inputs: W = argmin Σ_l ‖X_l·(W − W_l)ᵀ‖² + λ‖W − W̄‖² = (Σ W_l·G_l + λ·W̄)·(Σ G_l + λ·I)⁻¹,
    G_l = X_lᵀX_l the member's input Gram matrix and W̄ the mean (float64; λ = FIT_RIDGE × mean
    diagonal). Biases and non-linear modules (norms) are averaged."""
    out = average_modules(modules)
    if is_linear(out):
        w = weight_of(out)
        w.copy_(fitted_weight([weight_of(m).detach() for m in modules], grams, w).to(w.dtype))
    return out


def fitted_weight(weights: list[torch.Tensor], grams: list[torch.Tensor], mean: torch.Tensor) -> torch.Tensor:
    """(Σ W_l·G_l + λ·W̄)·(Σ G_l + λ·I)⁻¹ in float64: the one weight that serves every member
    best on its own inputs (G_l), pulled toward their mean W̄ (see ``fitted_modules``)."""
    a = sum(g.double() for g in grams)
    r = sum(w.double() @ g.double() for w, g in zip(weights, grams))
    return solve_coefficients(a, r, FIT_RIDGE, mean)


def shared_modules(arch: Arch, group: list[int], part: Part, source: int | Literal["mean", "fit"],
                   gram: Callable[[str], torch.Tensor] | None = None) -> tuple[dict[str, nn.Module], int]:
    """The ``part`` leaf modules every layer of ``group`` is to use (name inside a layer ->
    module): layer ``source``'s own, new ones holding the group's mean, or (``fit``) the mean
    for norms and, for linears, the weights fitted to the members' inputs (``fitted_modules``;
    ``gram``: full module name -> its input Gram matrix); and the parameters they save."""
    per_layer = [part_leaves(arch, i, part) for i in group]
    keys = [{local(arch, i, n) for n in names} for i, names in zip(group, per_layer)]
    if any(k != keys[0] for k in keys):
        raise UsageError(f"layers {group} do not have the same {part} structure", "group only layers of the same kind")
    out, saved = {}, 0
    for key in sorted(keys[0]):
        modules = [get_module(arch.layers[i], key) for i in group]
        if source == "mean" or source == "fit" and not is_linear(modules[0]):
            out[key] = average_modules(modules)
        elif source == "fit":
            out[key] = fitted_modules(modules, [gram(f"{arch.layer_name(i)}.{key}") for i in group])
        else:
            out[key] = get_module(arch.layers[source], key)
        saved += sum(p.numel() for p in out[key].parameters()) * (len(group) - 1)
    return out, saved


def share_group(arch: Arch, group: list[int], part: Part, source: int | Literal["mean", "fit"],
                gram: Callable[[str], torch.Tensor] | None = None) -> int:
    """Make every layer of ``group`` use one set of ``part`` leaf modules (the same objects,
    ``shared_modules``). Returns parameters saved."""
    shared, saved = shared_modules(arch, group, part, source, gram)
    for key, module in shared.items():
        for i in group:
            set_module(arch.layers[i], key, module)
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
def sample_inputs(model: nn.Module, arch: Arch, batches: list[torch.Tensor], role: str, rows_per_batch: int = 256,
                  layers: Collection[int] | None = None, dtype: torch.dtype | None = None) -> dict[int, torch.Tensor]:
    """Layer index -> (tokens, features) float32 sample of the inputs of each layer's ``role``
    projection (e.g. 'down': the FFN's intermediate activations), layer by layer, for every
    layer or those of ``layers`` (the pass ends after the last), the layers run in ``dtype``
    (the calibration dtype, as every calibration pass; default: the model's). Every layer keeps
    the same token positions, so row t of two layers' samples is one token: neuron alignment
    correlates them row by row."""
    out = {}
    last = arch.num_layers - 1 if layers is None else max(layers)
    for i, layer, inputs in layerwise(model, batches, arch, f"sampling {role} inputs", dtype):
        if layers is None or i in layers:
            name = arch.projections(i).get(role)
            if name is None:
                raise UsageError(f"layer {i} has no {role} projection",
                                 "this method needs FFN layers (gate/up/down projections)")
            sampler = ActivationSampler({name: get_module(model, name)}, rows_per_batch)
            with computing_in(layer, dtype):  # the next layer's inputs too: the layer runs once
                inputs.outputs = run_layer(layer, inputs)
            out[i] = sampler.close()[name]
        if i == last:
            break
    return out


def ffn_names(arch: Arch, i: int, method: str) -> dict[str, str]:
    """role -> module name of layer i's FFN projections (gate optional), separate as neuron
    alignment needs them; ``method`` names the caller in the refusal."""
    roles = {r: n for r, n in arch.projections(i).items() if r in FFN_ROLES}
    if "gate_up" in roles:
        raise UsageError(f"layer {i} fuses gate and up projections; {method} needs them separate",
                         "use cross_layer (init: mean) or merge on this model")
    if "up" not in roles or "down" not in roles:
        raise UsageError(f"layer {i} ({type(arch.layers[i]).__name__}) has no FFN (up/down projections)",
                         f"{method} works on FFN layers: use cross_layer with what: attn on this model")
    return roles


def alignment(ref: torch.Tensor, acts: torch.Tensor) -> torch.Tensor:
    """Permutation p such that neuron p[k] of ``acts`` best matches neuron k of ``ref``
    (Hungarian matching of the activation correlations; both (tokens, neurons), row t of
    both the same token)."""
    def standardize(z: torch.Tensor) -> torch.Tensor:
        z = z - z.mean(0)
        return z / z.norm(dim=0).clamp_min(1e-8)

    corr = standardize(ref).T @ standardize(acts)
    optimize = need("scipy.optimize", "compress", "aligning neurons")
    _, cols = optimize.linear_sum_assignment(corr.double().cpu().numpy(), maximize=True)
    return torch.as_tensor(cols, dtype=torch.long)


def aligned_weights(arch: Arch, i: int, perm: torch.Tensor) -> dict[str, Weights]:
    """role -> (weight (out, in), bias) of layer i's FFN with its neurons reordered by ``perm``:
    rows of gate/up (and their biases), columns of down. The layer's function is unchanged."""
    out = {}
    for role, name in ffn_names(arch, i, "neuron alignment").items():
        module = get_module(arch.model, name)
        w, b = weight_of(module).detach(), getattr(module, "bias", None)
        b, p = None if b is None else b.detach(), perm.to(w.device)
        out[role] = (w[p], None if b is None else b[p]) if role in OUTPUT_ROLES else (w[:, p], b)
    return out


@torch.no_grad()
def permute_ffn(arch: Arch, i: int, perm: torch.Tensor) -> None:
    """Reorder layer i's FFN neurons by ``perm`` in place (``aligned_weights``)."""
    names = ffn_names(arch, i, "neuron alignment")
    for role, (w, b) in aligned_weights(arch, i, perm).items():
        module = get_module(arch.model, names[role])
        weight_of(module).copy_(w.clone())
        if b is not None:
            module.bias.copy_(b.clone())
