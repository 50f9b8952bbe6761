"""Perplexity by the papers' protocol: concatenate the test text, cut it into windows of
``context_length`` (non-overlapping, or strided with only new tokens scored), and report
exp(mean token NLL) over all scored tokens. Where the BOS goes (``eval.bos``) is part of the
protocol: models trained with one (Gemma, LLaMA-2) score ~3x worse without it."""

from __future__ import annotations

import hashlib
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..io import data, distributed, ui
from ..io.offload import model_device, offload_of

PROTOCOL = 1  # bump when the computation changes: cached figures of older versions are not reused


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
    rank, size = distributed.world()
    for batch in ui.track(batches[rank::size], label):  # several processes: each scores its share of the windows
        x = torch.stack([ids[b:e] for b, e, _ in batch])
        if prefix:
            x = torch.cat([torch.full((len(batch), 1), bos_id, dtype=x.dtype), x], 1)
        x = x.to(device)
        first = batch[0][2] + prefix  # position in x of the first scored token
        logits = model(input_ids=x, use_cache=False).logits[:, first - 1: -1].float()
        target = x[:, first:]
        nll += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="sum").item()
        count += target.numel()
    nll, count = distributed.reduced(torch.tensor([nll, count], dtype=torch.float64, device=device)).tolist()
    seconds = time.perf_counter() - start
    mean = nll / max(count, 1)
    return {"ppl": math.exp(mean), "nll": mean, "tokens": int(count), "windows": len(spans),
            "seconds": seconds, "tokens_per_s": sum(e - b + prefix for b, e, _ in spans) / max(seconds, 1e-9)}


def evaluate_text(model: nn.Module, tokenizer, source: str, context_length: int, stride: int | None = None,
                  batch_size: int = 4, max_windows: int | None = None, bos: data.Bos = "auto",
                  label: str | None = None, cache: bool = False) -> dict:
    """Perplexity on one text source with the BOS placement ``bos`` (reported as ``bos``).
    With ``cache`` the result is kept per (model fingerprint, text, protocol) in the cache
    folder and read from there next time (for the original checkpoint, which runs never change)."""
    mode = data.resolve_bos(tokenizer, bos)
    path = _cache_path(model, source, context_length, stride, max_windows, mode) if cache else None
    if path is not None and path.is_file():
        try:
            return {**_cached(path), "cached": True}
        except (OSError, ValueError, TypeError) as err:  # a cache entry that cannot be read is measured again
            ui.log(f"[yellow]perplexity cache {path} unreadable ({type(err).__name__}: {err}); measuring again[/]")
    limit = None if max_windows is None else max_windows * (stride or context_length) + context_length
    ids = data.tokenize(tokenizer, source, max_tokens=limit, bos=mode)
    with offload_of(model).running():
        result = perplexity(model, ids, context_length, stride, batch_size, max_windows, label=label or f"ppl {source}",
                            bos_id=tokenizer.bos_token_id if mode == "window" else None)
    result = {**result, "bos": mode}
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(result))
        tmp.replace(path)
    return result


def _cached(path: Path) -> dict:
    """A cached result, checked to be one."""
    result = json.loads(path.read_text())
    if not isinstance(result, dict) or not isinstance(result.get("ppl"), float):
        raise ValueError("not a perplexity result")
    return result


def _cache_path(model: nn.Module, source: str, context_length: int, stride: int | None, max_windows: int | None,
                bos: str) -> Path:
    """Where the perplexity of this model on this text under this protocol is cached."""
    from ..io.files import cache_dir
    from ..pipeline.stats import fingerprint

    text = hashlib.sha1(data.load_text(source).encode()).hexdigest()
    where = [str(next(model.parameters()).dtype), model_device(model).type]  # the digits depend on both
    key = json.dumps([PROTOCOL, fingerprint(model), *where, text, context_length, stride, max_windows, bos])
    return cache_dir() / "perplexity" / f"{hashlib.sha1(key.encode()).hexdigest()[:20]}.json"


def evaluate_sources(model: nn.Module, tokenizer, sources: list[str], context_length: int, stride: int | None,
                     batch_size: int, max_windows: int | None, bos: data.Bos = "auto", cache: bool = False) -> dict[str, dict]:
    """Perplexity on each named source (cached per model, text and protocol with ``cache``)."""
    return {s: evaluate_text(model, tokenizer, s, context_length, stride, batch_size, max_windows, bos, cache=cache)
            for s in sources}
