"""Perplexity by the papers' protocol: concatenate the test text, cut it into windows of
``context_length`` (non-overlapping, or strided with only new tokens scored), and report
exp(mean token NLL) over all scored tokens. Where the BOS goes (``eval.bos``) is part of the
protocol: models trained with one (Gemma, LLaMA-2) score ~3x worse without it."""

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
               batch_size: int = 4, max_windows: int | None = None, label: str = "perplexity",
               bos_id: int | None = None) -> dict:
    """Mean-NLL perplexity of ``model`` on the 1-D token stream ``ids``; with ``bos_id`` every
    window is opened by that token (and scores all of its text tokens)."""
    device = model_device(model)
    prefix = int(bos_id is not None)
    spans = data.windows(ids, context_length, stride, max_windows, bos=bool(prefix))
    # windows of equal length and equal scored offset batch together
    groups: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
    for span in spans:
        groups.setdefault((span[1] - span[0], span[2]), []).append(span)
    batches = [g[i: i + batch_size] for g in groups.values() for i in range(0, len(g), batch_size)]
    nll, count = 0.0, 0
    start = time.perf_counter()
    for batch in ui.track(batches, label):
        x = torch.stack([ids[b:e] for b, e, _ in batch])
        if prefix:
            x = torch.cat([torch.full((len(batch), 1), bos_id, dtype=x.dtype), x], 1)
        x = x.to(device)
        first = batch[0][2] + prefix  # position in x of the first scored token
        logits = model(input_ids=x, use_cache=False).logits[:, first - 1: -1].float()
        target = x[:, first:]
        nll += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="sum").item()
        count += target.numel()
    seconds = time.perf_counter() - start
    mean = nll / max(count, 1)
    return {"ppl": math.exp(mean), "nll": mean, "tokens": count, "windows": len(spans),
            "seconds": seconds, "tokens_per_s": sum(e - b + prefix for b, e, _ in spans) / max(seconds, 1e-9)}


def evaluate_text(model: nn.Module, tokenizer, source: str, context_length: int, stride: int | None = None,
                  batch_size: int = 4, max_windows: int | None = None, bos: data.Bos = "auto",
                  label: str | None = None) -> dict:
    """Perplexity on one text source with the BOS placement ``bos`` (reported as ``bos``)."""
    mode = data.resolve_bos(tokenizer, bos)
    limit = None if max_windows is None else max_windows * (stride or context_length) + context_length
    ids = data.tokenize(tokenizer, source, max_tokens=limit, bos=mode)
    result = perplexity(model, ids, context_length, stride, batch_size, max_windows, label=label or f"ppl {source}",
                        bos_id=tokenizer.bos_token_id if mode == "window" else None)
    return {**result, "bos": mode}


def evaluate_sources(model: nn.Module, tokenizer, sources: list[str], context_length: int, stride: int | None,
                     batch_size: int, max_windows: int | None, bos: data.Bos = "auto") -> dict[str, dict]:
    """Perplexity on each named source."""
    return {s: evaluate_text(model, tokenizer, s, context_length, stride, batch_size, max_windows, bos) for s in sources}
