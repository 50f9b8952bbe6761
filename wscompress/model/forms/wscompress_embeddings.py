"""Compressed embeddings: a table held by a compressed linear that decodes rows (palettized,
float16, int8), and ALBERT's factorised embedding with its tied head. Travels with the folders
that use it (``wscompress_format``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .wscompress_format import CompressedLayer, CompressedLinear, register_layer


@register_layer
class PalettizedEmbedding(CompressedLayer, nn.Module):
    """An embedding whose (vocab, hidden) table is a compressed linear with ``rows`` (``table``: a
    ``PalettizedLinear`` or a ``NarrowLinear``): a lookup decodes only the rows it reads. With tied
    embeddings the LM head *is* that table module, so the matrix is stored once and the head's
    matmul runs the table's kernel."""

    CHILDREN = ("table",)
    TORCH_PATH = "the rows it reads decoded by its table"

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int | None = None, scale: float = 1.0):
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.padding_idx, self.scale = num_embeddings, embedding_dim, padding_idx, scale
        self.register_module("table", None)  # set by ``around`` or, on loading, by ``build``

    @classmethod
    def around(cls, table: CompressedLinear, embedding: nn.Embedding) -> PalettizedEmbedding:
        new = cls(table.out_features, table.in_features, embedding.padding_idx, float(getattr(embedding, "embed_scale", 1.0)))
        new.table = table
        return new

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = self.table.rows(ids)
        return out if self.scale == 1.0 else out * self.scale  # e.g. Gemma's sqrt(H) embedding scale

    @property
    def weight(self) -> torch.Tensor:
        """The dense table, for code that reads ``get_input_embeddings().weight`` (dtype, device, values)."""
        return self.table.dense_weight()

    def spec(self) -> dict:
        return {"num_embeddings": self.num_embeddings, "embedding_dim": self.embedding_dim,
                "padding_idx": self.padding_idx, "scale": self.scale}

    def to_dense(self) -> nn.Embedding:
        w = self.table.dense_weight().detach()
        emb = nn.Embedding(self.num_embeddings, self.embedding_dim, padding_idx=self.padding_idx, device=w.device,
                           dtype=w.dtype)
        with torch.no_grad():
            emb.weight.copy_(w)
        return emb


@register_layer
class FactorizedEmbedding(CompressedLayer, nn.Module):
    """ALBERT's factorised embedding: lookup in a (V, E) table followed by an (E -> H) projection."""

    CHILDREN = ("embed", "proj")
    TORCH_PATH = "lookup, then projection (torch)"

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


@register_layer
class FactorizedLMHead(CompressedLinear):
    """LM head tied to a FactorizedEmbedding: logits = h P E^T. Its ``embed`` and ``proj``
    are the embedding's own modules (the same objects), so the factors are stored once."""

    CHILDREN = ("embed", "proj")
    TORCH_PATH = "two matmuls (torch)"

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


