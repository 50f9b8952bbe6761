"""Multi-head to grouped-query attention by mean-pooling key/value heads (Ainslie et al. 2023).

Each group of consecutive key/value heads is replaced by their mean, so query head h reads
kv head h // (num_heads / groups) as stock transformers' GQA does; ``num_key_value_heads``
in the config follows, so the result runs with stock code. Works from MHA or from a model
that is already GQA (to fewer groups); groups = 1 is multi-query attention.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field
from torch import nn

from ..arch import discover, distinct, get_module, replace_everywhere, weight_of
from ..errors import UsageError
from ..recipe import StageConfig
from . import register


class GQAConfig(StageConfig):
    method: Literal["gqa"] = "gqa"
    groups: int = Field(ge=1, description="key/value heads after conversion (1: multi-query attention)")


@torch.no_grad()
def pool_heads(module: nn.Module, heads: int, groups: int) -> nn.Linear:
    """An nn.Linear whose output heads are the means of ``heads // groups`` consecutive heads."""
    w = weight_of(module).detach()
    out = w.shape[0] // heads * groups
    bias = getattr(module, "bias", None)
    lin = nn.Linear(w.shape[1], out, bias=bias is not None, device=w.device, dtype=w.dtype)
    lin.weight.copy_(w.reshape(groups, heads // groups, -1, w.shape[1]).float().mean(1).reshape(out, -1))
    if bias is not None:
        lin.bias.copy_(bias.reshape(groups, heads // groups, -1).float().mean(1).reshape(out))
    return lin


@register(GQAConfig, whole_model=True)
def apply(model, cfg: GQAConfig, ctx) -> dict:
    arch = discover(model)
    heads, kv = arch.num_heads, arch.num_kv_heads
    if not hasattr(model.config, "num_key_value_heads"):
        raise UsageError(f"gqa: {model.config.model_type} has no num_key_value_heads in its config, so stock "
                         "transformers could not run a GQA result", "use a LLaMA/Mistral/Qwen2/Gemma-style model")
    if kv % cfg.groups:
        divisors = [d for d in range(1, kv + 1) if kv % d == 0]
        raise UsageError(f"gqa: groups={cfg.groups} does not divide the model's {kv} key/value heads",
                         f"use one of {divisors}")
    projections = [arch.projections(i) for i in range(arch.num_layers)]
    for i, roles in enumerate(projections):
        if "k" not in roles or "v" not in roles:
            raise UsageError(f"gqa: layer {i} has no separate k/v projections", "gqa needs k_proj and v_proj modules")
    pooled = distinct(model, [roles[r] for roles in projections for r in ("k", "v")])
    for name in pooled:
        module = get_module(model, name)  # shared across layers (cross_layer): pooled once, stays shared
        replace_everywhere(model, module, pool_heads(module, kv, cfg.groups))
    for i in range(arch.num_layers):
        attn = get_module(model, arch.submodule_name(i, "attn"))
        if hasattr(attn, "num_key_value_groups"):  # read by the attention kernel: heads per kv head
            attn.num_key_value_groups = heads // cfg.groups
        if hasattr(attn, "num_key_value_heads"):
            attn.num_key_value_heads = cfg.groups
    model.config.num_key_value_heads = cfg.groups
    return {"kv_heads_before": kv, "kv_heads_after": cfg.groups, "query_heads": heads,
            "trains": pooled}  # the pooled k/v projections (Ainslie et al. uptrain after pooling)
