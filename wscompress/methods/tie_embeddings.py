"""Tie the input embedding and the output head (LM head) into one (V, H) matrix.

For models that keep them separate: the tied matrix starts from the input embedding, the
output head or their mean, and ``config.tie_word_embeddings`` is set so stock transformers
(and ``storage.load``) re-tie them. A model that is already tied is reported as such.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field
from torch import nn

from ..errors import UsageError
from ..model.arch import is_dense_linear
from ..recipe.schema import StageConfig
from . import register


class TieEmbeddingsConfig(StageConfig):
    method: Literal["tie_embeddings"] = "tie_embeddings"
    init: Literal["input", "output", "mean"] = Field("mean", description="what the tied matrix starts from")

    def check(self, model: nn.Module) -> None:
        emb, head = model.get_input_embeddings(), model.get_output_embeddings()
        if not isinstance(emb, nn.Embedding) or not (isinstance(head, nn.Linear) and is_dense_linear(head)):
            raise UsageError(f"tie_embeddings needs a plain nn.Embedding and nn.Linear head, found {type(emb).__name__} "
                             f"and {type(head).__name__}", "run tie_embeddings before stages that replace the embeddings")
        if head.weight.shape != emb.weight.shape:
            raise UsageError(f"tie_embeddings: the embedding is {tuple(emb.weight.shape)} but the head is "
                             f"{tuple(head.weight.shape)}", "only heads with the embedding's shape (vocab, hidden) can be tied")


@register(TieEmbeddingsConfig)
@torch.no_grad()
def apply(model, cfg: TieEmbeddingsConfig, ctx) -> dict:
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    if head.weight is emb.weight:
        return {"applicable": False, "reason": "input and output embeddings are already tied", "params_saved": 0}
    source = {"input": emb.weight, "output": head.weight, "mean": (emb.weight.float() + head.weight.float()) / 2}[cfg.init]
    emb.weight.copy_(source.to(emb.weight.dtype))
    head.weight = emb.weight
    model.config.tie_word_embeddings = True
    return {"applicable": True, "init": cfg.init, "params_saved": emb.weight.numel()}
