"""Perplexity by the papers' protocol: concatenate the test text, cut it into windows of
``context_length`` (non-overlapping, or strided with only new tokens scored), and report
exp(mean token NLL) over all scored tokens."""

from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F
from torch import nn

from .. import data, ui
from ..model import model_device


@torch.no_grad()
def perplexity(model: nn.Module, ids: torch.Tensor, context_length: int, stride: int | None = None,
               batch_size: int = 4, max_windows: int | None = None, label: str = "perplexity") -> dict:
    """Mean-NLL perplexity of ``model`` on the 1-D token stream ``ids``."""
    device = model_device(model)
    spans = data.windows(ids, context_length, stride, max_windows)
    # windows of equal length and equal scored offset batch together
    groups: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
    for span in spans:
        groups.setdefault((span[1] - span[0], span[2]), []).append(span)
    batches = [g[i: i + batch_size] for g in groups.values() for i in range(0, len(g), batch_size)]
    nll, count = 0.0, 0
    start = time.perf_counter()
    for batch in ui.track(batches, label):
        x = torch.stack([ids[b:e] for b, e, _ in batch]).to(device)
        first = batch[0][2]
        logits = model(input_ids=x, use_cache=False).logits[:, first - 1: -1].float()
        target = x[:, first:]
        nll += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="sum").item()
        count += target.numel()
    seconds = time.perf_counter() - start
    mean = nll / max(count, 1)
    return {"ppl": math.exp(mean), "nll": mean, "tokens": count, "windows": len(spans),
            "seconds": seconds, "tokens_per_s": sum(e - b for b, e, _ in spans) / max(seconds, 1e-9)}


def evaluate_sources(model: nn.Module, tokenizer, sources: list[str], context_length: int, stride: int | None,
                     batch_size: int, max_windows: int | None) -> dict[str, dict]:
    """Perplexity on each named source."""
    out = {}
    for source in sources:
        limit = None if max_windows is None else max_windows * (stride or context_length) + context_length
        ids = data.tokenize(tokenizer, source, max_tokens=limit)
        out[source] = perplexity(model, ids, context_length, stride, batch_size, max_windows, label=f"ppl {source}")
    return out
