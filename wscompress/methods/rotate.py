"""Incoherence processing: turn each target linear's input by a random block Hadamard rotation
(``RotatedLinear``), its weight turned the same way, before a stage that quantizes it.

A weight row's few large entries (outliers) force a codebook or grid to span them, coarsening
every other weight of its group. After x -> x Q with Q = diag(random signs) (I ⊗ H), H the
normalised Hadamard matrix of ``block`` columns, the layer holds W Q, whose entries mix each
row's ``block`` neighbours with random signs: near-Gaussian, no outliers (QuIP#, QuaRot, EXL3;
llm-compressor's QuIP transform). The model computes the same function (Q is orthogonal); a
later stage compresses the rotated weights, which its default targets reach (the ``inner``
child of each rotated layer). Here Q is applied online, to each layer's input: one
(tokens, in / block, block) x (block, block) product a layer, on CPU and GPU alike.
"""

from __future__ import annotations

import zlib
from typing import Literal

import torch
from pydantic import Field
from torch import nn

from ..errors import UsageError
from ..model.arch import dims_of, target_layers, tied_to_embeddings
from ..model.forms.wscompress_rotated import RotatedLinear
from ..pipeline.layerwise import replace_each
from ..recipe.schema import TargetedStage
from . import register


class RotateConfig(TargetedStage):
    method: Literal["rotate"] = "rotate"
    block: int = Field(64, ge=2, description="columns each Hadamard block mixes (a power of two dividing every "
                                             "target's input width); 64 is llm-compressor's QuIP default")
    seed: int = Field(0, description="seed of the random signs (each layer's drawn from it and its name)")

    def check(self, model: nn.Module) -> None:
        if self.block & (self.block - 1):
            raise UsageError(f"rotate: block={self.block} is not a power of two", "use e.g. block: 64")
        for name, module in target_layers(model, self).items():
            cols = dims_of(module)[0]
            if cols % self.block:
                raise UsageError(f"rotate: {name} has {cols} inputs, not a multiple of block={self.block}",
                                 f"use a power of two dividing {cols}, e.g. block: {cols & -cols}")
            if tied_to_embeddings(model, module) is not None:
                raise UsageError(f"rotate: {name} is tied to the input embedding, whose rows a rotation would not "
                                 "give", "leave it out of the stage's targets")


@register(RotateConfig)
@torch.no_grad()
def apply(model: nn.Module, cfg: RotateConfig, ctx) -> dict:
    def make(name: str, module: nn.Module) -> RotatedLinear:
        generator = torch.Generator().manual_seed(cfg.seed * 1_000_003 + zlib.crc32(name.encode()))
        return RotatedLinear.turning(module, cfg.block, generator)

    layers = target_layers(model, cfg)
    replace_each(model, layers, make, f"rotate: block {cfg.block}")
    return {"layers": len(layers), "block": cfg.block,
            "sign_bytes": sum(dims_of(m)[0] for m in layers.values())}
