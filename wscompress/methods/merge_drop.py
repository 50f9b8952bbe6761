"""Layer merging that removes depth: each window of n consecutive layers becomes one layer and
the other n - 1 layers are deleted.

The model really gets shallower (``config.num_hidden_layers`` and per-layer config lists
such as ``layer_types`` follow), so prefill and decode latency drop with the removed depth.
Attention modules are re-indexed (``layer_idx``) so the KV cache and ``generate()`` work.

Where the windows go and what the one layer holds are options, each a published recipe (the
defaults are the calibrated ones; ``search: false, init: mean, refit: false`` is data-free):
- ``search``: windows where the hidden state changes least across them, by the angular
  distance between a window's input and output on the calibration text (Gromov et al. 2024,
  "The Unreasonable Ineffectiveness of the Deeper Layers"); a ``start`` or ``groups`` given, or
  ``search: false``, place them as ``merge`` does (default: just before the last layer).
- ``init``: the window's ``first`` layer alone (the others dropped, as ShortGPT and Gromov et
  al. prune) or the element-wise ``mean`` of its layers (LaCo-like merging).
- ``refit``: the kept layer's down projection re-solved by least squares so that the layer
  reproduces the whole window's output on its calibration inputs (the window's FFN output is
  the last thing added to the residual stream, so one linear solve can absorb what the dropped
  layers added).
"""

from __future__ import annotations

import copy
import math
from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from ..errors import UsageError
from ..io.data import first_samples
from ..model.arch import Arch, discover, set_module, weight_of
from ..pipeline.layerwise import LayerInputs, layerwise, run_layer
from ..pipeline.refit import LeastSquares
from ..recipe.schema import Refit
from . import register
from ._sharing import WindowStage, leaves


class MergeDropConfig(WindowStage, Refit):
    method: Literal["merge_drop"] = "merge_drop"
    search: bool = Field(True, description="place the windows (n, num_windows) where the hidden state's angle "
                                           "changes least from a window's input to its output on the calibration "
                                           "text, the last layer kept; a start or groups given place them instead")
    init: Literal["first", "mean"] = Field("first", description="the kept layer: the window's first layer (the others "
                                                                "dropped), or the element-wise mean of its layers")

    def check(self, model: nn.Module) -> None:
        arch = discover(model)
        if arch.layer_indexed:
            raise UsageError("merge_drop: this model scales attention by its layer index, which re-indexing would change",
                             "use merge (keeps depth) instead of merge_drop")
        if self.refit and ("down" not in arch.projections(0) or arch.ffn_output_norm):
            raise UsageError("merge_drop: refit solves for the FFN down projection's output as it is added to the "
                             "residual stream; this model has none, or normalises it first (Gemma)", "use refit: false")
        for w in self.windows(arch.num_layers):  # a searched placement: its windows are layers of one kind too
            same_structure(arch, w)


def same_structure(arch: Arch, window: list[int]) -> None:
    """Refuse a window whose layers differ in structure (one cannot stand for the others)."""
    if any(set(leaves(arch.layers[i])) != set(leaves(arch.layers[window[0]])) for i in window):
        raise UsageError(f"merge_drop: the layers of window {window} differ in structure", "merge only layers of the same kind")


@torch.no_grad()
def average_layers(layers: list[nn.Module]) -> None:
    """Set ``layers[0]``'s parameters to the element-wise mean of all the layers'."""
    for name, p in layers[0].named_parameters():
        p.copy_(torch.stack([layer.get_parameter(name).detach().float() for layer in layers]).mean(0).to(p.dtype))


def drop_layers(model: nn.Module, keep: list[int]) -> None:
    """Keep only decoder layers ``keep`` (in order): re-index them and update the config."""
    arch = discover(model)
    old = arch.num_layers
    set_module(model, arch.layers_path, nn.ModuleList([arch.layers[i] for i in keep]))
    for new_idx, layer in enumerate(arch.layers):
        for module in layer.modules():
            if isinstance(getattr(module, "layer_idx", None), int):
                module.layer_idx = new_idx
    config = model.config
    for key, value in list(vars(config).items()):  # per-layer lists (layer_types, ...) follow the kept layers
        if isinstance(value, list) and len(value) == old and not key.startswith("_"):
            setattr(config, key, [value[i] for i in keep])
    config.num_hidden_layers = len(keep)


@torch.no_grad()
def angular_distances(model: nn.Module, batches: list[torch.Tensor], n: int) -> dict[int, float]:
    """Start -> mean over calibration tokens of arccos(cos(h_start, h_start+n)) / π, for every
    window of n layers that ends before the last layer (h_i: what enters layer i)."""
    arch = discover(model)
    last_start = arch.num_layers - 1 - n
    recent: dict[int, list[torch.Tensor]] = {}
    out = {}
    for i, _layer, inputs in layerwise(model, batches, arch, "merge_drop: measuring layer distances"):
        if i - n in recent:
            cos = [F.cosine_similarity(a.float(), b.float(), dim=-1).clamp(-1, 1) for a, b in zip(recent.pop(i - n), inputs.hidden)]
            out[i - n] = (torch.cat([c.flatten() for c in cos]).acos().mean() / math.pi).item()
        if i <= last_start:
            recent[i] = inputs.hidden
        if i - n >= last_start:
            break
    return out


def searched_windows(distances: dict[int, float], n: int, count: int) -> list[list[int]]:
    """``count`` non-overlapping windows of n layers with the smallest distances, greedily."""
    starts: list[int] = []
    for s in sorted(distances, key=distances.get):
        if len(starts) < count and all(s + n <= t or t + n <= s for t in starts):
            starts.append(s)
    if len(starts) < count:
        raise UsageError(f"merge_drop: no room for {count} windows of {n} layers before the last layer",
                         "use fewer or smaller windows")
    return [list(range(s, s + n)) for s in sorted(starts)]


@torch.no_grad()
def refit_down(model: nn.Module, windows: list[list[int]], kept: dict[int, nn.Module], batches: list[torch.Tensor],
               ridge: float) -> None:
    """For each window, the down projection of its kept layer (``kept``: first layer -> the new
    layer, not yet in the model) solved, ``ridge`` toward itself (``pipeline.refit.LeastSquares``),
    so that on the window's calibration inputs the layer's output matches the original window's:
    the wanted down output is D + (Y − O), D its current output, O the layer's output and Y the
    window's. Not ``fit_pass``: the target is a window of layers, not a module of one."""
    arch = discover(model)
    ends = {w[-1]: w[0] for w in windows}
    entering: dict[int, LayerInputs] = {}
    for i, layer, inputs in layerwise(model, batches, arch, "merge_drop: refitting the kept layers"):
        if i in kept:
            entering[i] = LayerInputs(inputs.hidden, list(inputs.calls))
        if i in ends:
            inputs.outputs = run_layer(layer, inputs)  # the original window's output
            start = ends[i]
            new, window_in = kept[start], entering.pop(start)
            down = new.get_submodule(arch.projections(start)["down"].removeprefix(arch.layer_name(start) + "."))
            bias = 0 if getattr(down, "bias", None) is None else down.bias
            fit, seen = LeastSquares(weight_of(down), ridge), {}
            hook = down.register_forward_hook(lambda _m, args, out: seen.update(x=args[0], y=out))
            try:
                for want, hidden, (args, kwargs) in zip(inputs.outputs, window_in.hidden, window_in.calls):
                    out = new(hidden, *args, **kwargs)
                    out = out[0] if isinstance(out, tuple) else out
                    fit.add_outputs(seen["x"].flatten(0, -2), (seen["y"] + want - out - bias).flatten(0, -2))
            finally:
                hook.remove()
            fit.write(down)
        if i == max(ends):
            break  # the layers after the windows need no outputs


@register(MergeDropConfig, whole_model=True)
def apply(model, cfg: MergeDropConfig, ctx) -> dict:
    arch = discover(model)
    windows = cfg.windows(arch.num_layers)
    distances = {}
    if cfg.search and cfg.start is None and cfg.groups is None:
        distances = angular_distances(model, ctx.calibration(), cfg.n)
        windows = searched_windows(distances, cfg.n, cfg.num_windows)
        for w in windows:
            same_structure(arch, w)
    kept = {}  # a window's first layer -> the layer that replaces the window (a copy while the refit needs the originals)
    for w in windows:
        kept[w[0]] = copy.deepcopy(arch.layers[w[0]]) if cfg.refit else arch.layers[w[0]]
        if cfg.init == "mean":
            average_layers([kept[w[0]]] + [arch.layers[i] for i in w[1:]])
    if cfg.refit:
        refit_down(model, windows, kept, first_samples(ctx.calibration(), cfg.refit_samples), cfg.ridge)
        for start, layer in kept.items():
            set_module(model, arch.layer_name(start), layer)
    dropped = {i for w in windows for i in w[1:]}
    keep = [i for i in range(arch.num_layers) if i not in dropped]
    drop_layers(model, keep)
    return {"windows": windows, "layers_before": len(keep) + len(dropped), "layers_after": len(keep),
            "init": cfg.init, "refit": cfg.refit, "angular_distance": {str(k): round(v, 4) for k, v in distances.items()},
            "trains": [arch.layer_name(keep.index(w[0])) for w in windows]}  # the merged layers
