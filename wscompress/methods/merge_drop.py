"""Layer merging that removes depth: each window of n consecutive layers becomes one layer
holding their element-wise mean, and the other n - 1 layers are deleted.

The model really gets shallower (``config.num_hidden_layers`` and per-layer config lists
such as ``layer_types`` follow), so prefill and decode latency drop with the removed depth.
Attention modules are re-indexed (``layer_idx``) so the KV cache and ``generate()`` work.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from ..arch import discover, set_module
from ..errors import UsageError
from ..sharing import WindowStage, leaves
from . import register


class MergeDropConfig(WindowStage):
    method: Literal["merge_drop"] = "merge_drop"


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


@register(MergeDropConfig, whole_model=True)
def apply(model, cfg: MergeDropConfig, ctx) -> dict:
    arch = discover(model)
    if getattr(model.config, "scale_attn_by_inverse_layer_idx", False):
        raise UsageError("merge_drop: this model scales attention by its layer index, which re-indexing would change",
                         "use merge (keeps depth) instead of merge_drop")
    windows = cfg.windows(arch.num_layers)
    if any(set(leaves(arch.layers[i])) != set(leaves(arch.layers[w[0]])) for w in windows for i in w):
        raise UsageError(f"merge_drop: layers of windows {windows} differ in structure", "merge only layers of the same kind")
    for w in windows:
        average_layers([arch.layers[i] for i in w])
    dropped = {i for w in windows for i in w[1:]}
    keep = [i for i in range(arch.num_layers) if i not in dropped]
    drop_layers(model, keep)
    return {"windows": windows, "layers_before": len(keep) + len(dropped), "layers_after": len(keep),
            "trains": [arch.layer_name(keep.index(w[0])) for w in windows]}  # the merged layers
