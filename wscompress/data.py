"""Text sources and the one tokenization+chunking path shared by calibration, eval and finetune.

A source is a local file (``.txt``: raw text; ``.jsonl``: a ``text`` field per line), one of
the papers' HF datasets (``wikitext2``, ``ptb``, ``c4``), or ``pydoc`` (CPython's bundled
docs, always available). Sources may name a split: ``wikitext2:train``.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import torch

from .errors import UsageError

# name -> (dataset args, text field, default split); the splits the papers use
HF_SOURCES = {
    "wikitext2": (("wikitext", "wikitext-2-raw-v1"), "text", "test"),
    "ptb": (("ptb_text_only", "penn_treebank"), "sentence", "test"),
    "c4": (("allenai/c4", "en"), "text", "validation"),
}


def _pydoc_text() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def _hf_text(name: str, split: str) -> str:
    from datasets import load_dataset

    args, field, _ = HF_SOURCES[name]
    kw = {}
    if name == "c4":  # the papers use one shard of C4
        shard = "train" if split == "train" else "validation"
        kw["data_files"] = {split: f"en/c4-{shard}.00000-of-{'01024' if shard == 'train' else '00008'}.json.gz"}
        args = (args[0],)
    try:
        ds = load_dataset(*args, split=split, **kw)
    except Exception as err:  # datasets raises many types (offline, missing config, ...)
        raise UsageError(f"dataset {name}:{split} could not be loaded: {type(err).__name__}: {str(err)[:300]}",
                         "use a local .txt/.jsonl file or 'pydoc', or allow hub access (HF_DATASETS_OFFLINE=0)") from None
    sep = " " if name == "ptb" else "\n\n"
    return sep.join(ds[field])


@lru_cache(maxsize=8)
def load_text(source: str) -> str:
    """The whole text of a source, documents joined by blank lines (the papers' protocol)."""
    name, _, split = source.partition(":")
    if name == "pydoc":
        return _pydoc_text()
    if name in HF_SOURCES and not Path(source).exists():
        return _hf_text(name, split or HF_SOURCES[name][2])
    path = Path(source).expanduser()
    if not path.is_file():
        raise UsageError(f"text source {source!r} not found",
                         f"give a .txt/.jsonl file, 'pydoc', or one of {', '.join(HF_SOURCES)}")
    if path.suffix == ".jsonl":
        lines = []
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if line.strip():
                try:
                    lines.append(json.loads(line)["text"])
                except (json.JSONDecodeError, KeyError, TypeError):
                    raise UsageError(f"{path}:{n}: expected a JSON object with a 'text' field") from None
        return "\n\n".join(lines)
    return path.read_text()


def tokenize(tokenizer, source: str, max_tokens: int | None = None) -> torch.Tensor:
    """Token ids (1-D LongTensor) of a whole source; ``max_tokens`` stops early on huge corpora."""
    text = load_text(source)
    if max_tokens is not None:
        text = text[: max_tokens * 12]  # ~4 chars a token: plenty of margin, avoids tokenizing GBs
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids[0]
    return ids if max_tokens is None else ids[:max_tokens]


def windows(ids: torch.Tensor, length: int, stride: int | None = None, limit: int | None = None) -> list[tuple[int, int, int]]:
    """(begin, end, first scored position) of each evaluation window.

    Non-overlapping windows when ``stride`` is None or equal to ``length`` (each scores its
    tokens 1..L-1); with a smaller stride each window re-reads context but scores only the
    tokens no earlier window scored.
    """
    stride = stride or length
    n = ids.numel()
    out, prev_end = [], 0
    for begin in range(0, max(n - 1, 1), stride):
        end = min(begin + length, n)
        if end - begin < 2:
            break
        out.append((begin, end, max(prev_end - begin, 1)))  # token 0 of a window has no context
        prev_end = end
        if end == n or (limit is not None and len(out) >= limit):
            break
    return out


def sample_batches(ids: torch.Tensor, num_samples: int, seq_len: int, batch_size: int, seed: int) -> list[torch.Tensor]:
    """Random ``seq_len`` windows of a token stream, grouped into batches (calibration sampling)."""
    if ids.numel() <= seq_len:
        raise UsageError(f"calibration text has {ids.numel()} tokens, fewer than seq_len={seq_len}",
                         "use a longer text or a smaller calibration.seq_len")
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, ids.numel() - seq_len, (num_samples,), generator=gen)
    rows = torch.stack([ids[s: s + seq_len] for s in starts.tolist()])
    return list(rows.split(batch_size))


def calibration_batches(tokenizer, source: str, num_samples: int, seq_len: int, batch_size: int, seed: int) -> list[torch.Tensor]:
    ids = tokenize(tokenizer, source, max_tokens=max(num_samples * seq_len * 20, 200_000))
    return sample_batches(ids, num_samples, seq_len, batch_size, seed)
