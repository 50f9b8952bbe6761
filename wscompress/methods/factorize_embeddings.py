"""ALBERT's factorised embedding: the V x H table becomes (V x E)(E x H) by truncated SVD.

With tied embeddings the LM head uses the very same factors (``FactorizedLMHead`` holds the
embedding's own factor modules), so the vocabulary matrix is never stored densely twice.
An untied head is left as it is.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field
from torch import nn

from ..errors import UsageError
from ..model.arch import discover, set_module
from ..model.forms.wscompress_embeddings import FactorizedEmbedding, FactorizedLMHead
from ..recipe.schema import StageConfig
from . import register


class FactorizeEmbeddingsConfig(StageConfig):
    method: Literal["factorize_embeddings"] = "factorize_embeddings"
    rank: int = Field(128, ge=1, description="E, the inner dimension of V x E and E x H")

    def check(self, model: nn.Module) -> None:
        emb = model.get_input_embeddings()
        if not isinstance(emb, nn.Embedding):
            raise UsageError(f"factorize_embeddings: the input embedding is a {type(emb).__name__}, not an nn.Embedding",
                             "factorize the embedding once, before other stages that replace it")
        vocab, hidden = emb.weight.shape
        if self.rank * (vocab + hidden) >= vocab * hidden:
            raise UsageError(f"factorize_embeddings: rank {self.rank} saves nothing on a {vocab} x {hidden} embedding",
                             f"use a rank below {vocab * hidden // (vocab + hidden)}")


@register(FactorizeEmbeddingsConfig)
@torch.no_grad()
def apply(model, cfg: FactorizeEmbeddingsConfig, ctx) -> dict:
    arch = discover(model)
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    (vocab, hidden), e = emb.weight.shape, cfg.rank
    tied = head is not None and getattr(head, "weight", None) is emb.weight
    w = emb.weight.detach()
    u, s, vh = torch.linalg.svd(w.float(), full_matrices=False)
    scale = float(getattr(emb, "embed_scale", 1.0))
    new = FactorizedEmbedding(vocab, hidden, e, emb.padding_idx, scale).to(device=w.device, dtype=w.dtype)
    new.embed.weight.copy_(u[:, :e] * s[:e])
    new.proj.weight.copy_(vh[:e].T)
    set_module(model, arch.embedding_name, new)
    if tied:
        head_name = next(n for n, m in model.named_modules() if m is head)
        set_module(model, head_name, FactorizedLMHead.tied_to(new, head.bias))
    energy = float(s[:e].pow(2).sum() / s.pow(2).sum())
    return {"rank": e, "tied_head": tied, "params_saved": vocab * hidden - e * (vocab + hidden),
            "energy_kept": round(energy, 4), "trains": [arch.embedding_name]}
