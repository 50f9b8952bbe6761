"""Store dense linears as int8 blocks (``Int8Linear``, llama.cpp's Q8_0): 8.5 bits a weight.

Meant for the tied embedding/head, which the default target names: once the decoder layers are
palettized, most of the bytes every decoded token reads (a 4-bit 1.1B model's float16 head is
201 MB of its 684). Each run of 32 weights of a row keeps int8 values times one float16 scale
(the run's largest magnitude / 127), so every weight is within 1/254 of its run's largest one:
a finer grid than one 256-entry codebook shared by many rows, whose tails are coarse
(docs/clustering.md). A tied head stays one table, as with ``half``.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field
from torch import nn

from ..errors import UsageError
from ..model.arch import dims_of, target_layers
from ..model.forms.wscompress_narrow import INT8_BLOCK, Int8Linear
from ..recipe.schema import TargetedStage
from . import register
from .half import HALF_MAX, store


class Int8Config(TargetedStage):
    method: Literal["int8"] = "int8"
    targets: list[str] = Field(default_factory=lambda: ["lm_head"],
                               description="regexes of dense linears to store as int8 blocks (default: the LM "
                                           "head, with the embedding when they are tied)")

    def check(self, model: nn.Module) -> None:  # before any work: a pattern that matches nothing, a width that does not divide
        for name, module in target_layers(model, self).items():
            if dims_of(module)[0] % INT8_BLOCK:
                raise UsageError(f"int8: {name} has {dims_of(module)[0]} inputs, not a multiple of {INT8_BLOCK} "
                                 "(its blocks of weights sharing a scale)", "store it with `method: half` instead")


@register(Int8Config)
@torch.no_grad()
def apply(model: nn.Module, cfg: Int8Config, ctx) -> dict:
    return store(model, cfg, Int8Linear, 127 * HALF_MAX, "its float16 scales' range")
