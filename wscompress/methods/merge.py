"""Layer merging that keeps depth: each window of n consecutive layers uses one averaged FFN
(or attention, or block), stored once. Every layer still runs, so latency stays; size drops."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from ..model.arch import discover
from . import register
from ._sharing import Part, WindowStage, part_leaves, share_group


class MergeConfig(WindowStage):
    method: Literal["merge"] = "merge"
    parts: list[Part] = Field(default_factory=lambda: ["ffn"], min_length=1, description="sub-blocks averaged: attn, ffn, block")

    def check(self, model) -> None:
        arch = discover(model)
        windows = self.windows(arch.num_layers)
        for part in self.parts:
            part_leaves(arch, windows[0][0], part)  # refuses a part the model lacks

    @field_validator("parts")
    @classmethod
    def _distinct(cls, parts: list[str]) -> list[str]:
        if len(set(parts)) != len(parts) or ("block" in parts and len(parts) > 1):
            raise ValueError("list each part once; 'block' already covers attn and ffn")
        return parts


@register(MergeConfig, whole_model=True)
def apply(model, cfg: MergeConfig, ctx) -> dict:
    arch = discover(model)
    windows = cfg.windows(arch.num_layers)
    saved = sum(share_group(arch, w, part, "mean") for w in windows for part in cfg.parts)
    return {"windows": windows, "parts": cfg.parts, "params_saved": saved}
