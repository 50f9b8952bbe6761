"""ALBERT's factorised embedding: the V x H table becomes (V x E)(E x H) by truncated SVD.

With tied embeddings the LM head uses the very same factors (``FactorizedLMHead`` holds the
embedding's own factor modules), so the vocabulary matrix is never stored densely twice.
An untied head is left as it is.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from ..arch import discover, set_module
from ..errors import UsageError
from ..modules import CompressedLinear, register_module
from ..recipe import StageConfig
from . import register


@register_module
class FactorizedEmbedding(nn.Module):
    """Embedding lookup in a (V, E) table followed by an (E -> H) projection."""

    def __init__(self, num_embeddings: int, embedding_dim: int, rank: int, padding_idx: int | None = None,
                 scale: float = 1.0):
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.rank, self.scale = num_embeddings, embedding_dim, rank, scale
        self.embed = nn.Embedding(num_embeddings, rank, padding_idx=padding_idx)
        self.proj = nn.Linear(rank, embedding_dim, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = self.proj(self.embed(ids))
        return out if self.scale == 1.0 else out * self.scale  # e.g. Gemma's sqrt(H) embedding scale

    def dense_weight(self) -> torch.Tensor:
        """The (V, H) table (unscaled, as a tied head reads it)."""
        return self.embed.weight @ self.proj.weight.T

    @property
    def weight(self) -> torch.Tensor:
        """Dense table for code that reads ``get_input_embeddings().weight`` (dtype, device, values)."""
        return self.dense_weight()

    def spec(self) -> dict:
        return {"num_embeddings": self.num_embeddings, "embedding_dim": self.embedding_dim, "rank": self.rank,
                "padding_idx": self.embed.padding_idx, "scale": self.scale}

    def to_dense(self) -> nn.Embedding:
        """The dense table; a scale is the model's own (its embedding class applies it on export)."""
        w = self.dense_weight().detach()
        emb = nn.Embedding(self.num_embeddings, self.embedding_dim, padding_idx=self.embed.padding_idx,
                           device=w.device, dtype=w.dtype)
        with torch.no_grad():
            emb.weight.copy_(w)
        return emb

    def trainable_parameters(self) -> list[nn.Parameter]:
        return list(self.parameters())


@register_module
class FactorizedLMHead(CompressedLinear):
    """LM head tied to a FactorizedEmbedding: logits = h P E^T. Its ``embed`` and ``proj``
    are the embedding's own modules (the same objects), so the factors are stored once."""

    def __init__(self, num_embeddings: int, embedding_dim: int, rank: int, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features, self.rank = embedding_dim, num_embeddings, rank
        self.embed = nn.Embedding(num_embeddings, rank)  # replaced by the embedding's own when built or loaded
        self.proj = nn.Linear(rank, embedding_dim, bias=False)
        self.bias = nn.Parameter(torch.empty(num_embeddings)) if bias else None

    @classmethod
    def tied_to(cls, embedding: FactorizedEmbedding, bias: nn.Parameter | None) -> FactorizedLMHead:
        head = cls(embedding.num_embeddings, embedding.embedding_dim, embedding.rank, bias is not None)
        head.embed, head.proj, head.bias = embedding.embed, embedding.proj, bias
        return head

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(h @ self.proj.weight, self.embed.weight, self.bias)

    def dense_weight(self) -> torch.Tensor:
        return self.embed.weight @ self.proj.weight.T

    def spec(self) -> dict:
        return {"num_embeddings": self.out_features, "embedding_dim": self.in_features, "rank": self.rank,
                "bias": self.bias is not None}


class FactorizeEmbeddingsConfig(StageConfig):
    method: Literal["factorize_embeddings"] = "factorize_embeddings"
    rank: int = Field(128, ge=1, description="E, the inner dimension of V x E and E x H")


@register(FactorizeEmbeddingsConfig)
@torch.no_grad()
def apply(model, cfg: FactorizeEmbeddingsConfig, ctx) -> dict:
    arch = discover(model)
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    if not isinstance(emb, nn.Embedding):
        raise UsageError(f"factorize_embeddings: the input embedding is a {type(emb).__name__}, not an nn.Embedding",
                         "factorize the embedding once, before other stages that replace it")
    (vocab, hidden), e = emb.weight.shape, cfg.rank
    if e * (vocab + hidden) >= vocab * hidden:
        raise UsageError(f"factorize_embeddings: rank {e} saves nothing on a {vocab} x {hidden} embedding",
                         f"use a rank below {vocab * hidden // (vocab + hidden)}")
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
