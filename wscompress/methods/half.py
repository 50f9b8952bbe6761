"""Store dense linears in float16 (``HalfLinear``): half the bytes of float32 for what is left dense.

Meant for the tied embedding/head, which the default target names: a fifth of a small model's
weights and, once the decoder layers are palettized, most of the bytes every decoded token
reads. Float16 keeps 11 significant bits a weight (relative rounding <= 2^-11, below what any
compression stage here changes), so it costs no measurable perplexity (docs/runtime.md), and
decoding on CPU multiplies the halves into float32 sums (``kernels.half_linear``). A tied head
stays one table: the embedding looks its rows up in the same ``HalfLinear``.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field
from torch import nn

from ..errors import UsageError
from ..model.arch import Conv1D, target_layers, weight_of
from ..model.forms.wscompress_narrow import HalfLinear, NarrowLinear
from ..pipeline.layerwise import replace_each
from ..recipe.schema import TargetedStage
from . import register

HALF_MAX = torch.finfo(torch.float16).max


class HalfConfig(TargetedStage):
    method: Literal["half"] = "half"
    targets: list[str] = Field(default_factory=lambda: ["lm_head"],
                               description="regexes of dense linears to store in float16 (default: the LM head, "
                                           "with the embedding when they are tied)")

    def check(self, model: nn.Module) -> None:
        target_layers(model, self)  # a pattern that matches no dense linear is refused here, before any work


def store(model: nn.Module, cfg: TargetedStage, form: type[NarrowLinear], limit: float, beyond: str) -> dict:
    """Replace each dense linear ``cfg`` targets by ``form`` (a tied head's embedding reading the
    same table), refusing weights past ``limit`` (``beyond`` names that range); the report gives
    each layer's relative rounding error."""
    rows = []

    def make(name: str, module: nn.Module) -> NarrowLinear:
        w = weight_of(module)
        if w.abs().max() > limit:
            raise UsageError(f"{cfg.method}: {name} has weights beyond {beyond}", "leave it out of the stage's targets")
        layer = form.from_weight(w, getattr(module, "bias", None), conv1d=isinstance(module, Conv1D))
        err = (layer.dense_weight().float() - w.float()).norm() / w.float().norm().clamp_min(1e-30)
        rows.append({"layer": name, "shape": list(w.shape), "rel_error": err.item()})
        return layer

    replace_each(model, target_layers(model, cfg), make, cfg.method)
    return {"layers": len(rows), "weights": sum(r["shape"][0] * r["shape"][1] for r in rows), "per_layer": rows}


@register(HalfConfig)
@torch.no_grad()
def apply(model: nn.Module, cfg: HalfConfig, ctx) -> dict:
    return store(model, cfg, HalfLinear, HALF_MAX, f"float16's range (±{HALF_MAX:.0f})")
