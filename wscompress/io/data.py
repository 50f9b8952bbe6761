"""Text sources and the one tokenization+chunking path shared by calibration, eval and finetune.

A source is a local file (``.txt``: raw text; ``.jsonl``: a ``text`` field per line), a text
that ships with wscompress (``builtin:wiki.train``, ``builtin:wiki.test``, ``builtin:brown``:
see ``texts/README.md``), one of the papers' HF datasets (``wikitext2``, ``ptb``, ``c4``), or
``pydoc`` (CPython's bundled docs). Sources may name a split: ``wikitext2:train``.
"""

from __future__ import annotations

import json
import lzma
import random
from functools import lru_cache
from pathlib import Path
from typing import Literal

import torch

from ..errors import UsageError, need

# name -> (dataset args, text field, default split); the splits the papers use
HF_SOURCES = {
    "wikitext2": (("wikitext", "wikitext-2-raw-v1"), "text", "test"),
    "ptb": (("ptb_text_only", "penn_treebank"), "sentence", "test"),
    "c4": (("allenai/c4", "en"), "text", "validation"),
}
# texts packaged with wscompress (xz-compressed), so recipes and tests run from a bare clone
TEXTS = Path(__file__).parent / "texts"
BUILTIN = "builtin:"


def builtin_texts() -> dict[str, Path]:
    """Name -> file of the texts that ship with wscompress."""
    return {p.name.removesuffix(".txt.xz"): p for p in sorted(TEXTS.glob("*.txt.xz"))}


def _builtin_file(source: str, what: str) -> Path:
    name = source.removeprefix(BUILTIN)
    texts = builtin_texts()
    if name not in texts:
        raise UsageError(f"{what}: no builtin text {name!r}", f"builtin texts: {', '.join(BUILTIN + n for n in texts)}")
    return texts[name]


def _pydoc_text() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def _hf_text(name: str, split: str) -> str:
    load_dataset = need("datasets", "eval", f"the hub dataset {name!r}").load_dataset
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


def check_source(source: str, what: str) -> None:
    """Refuse a text source that cannot be read, before any work (hub datasets are checked
    when they load: that needs the network)."""
    if source.startswith(BUILTIN):
        _builtin_file(source, what)
        return
    name = source.partition(":")[0]
    if name == "pydoc" or (name in HF_SOURCES and not Path(source).exists()):
        return
    if not Path(source).expanduser().is_file():
        raise UsageError(f"{what}: text source {source!r} not found",
                         f"give an existing .txt/.jsonl file (relative to {Path.cwd()}), a builtin text ("
                         f"{', '.join(BUILTIN + n for n in builtin_texts())}), 'pydoc', or one of {', '.join(HF_SOURCES)}")


def source_label(source: str) -> str:
    """How tables name a source: a file by its name (paths get cut in narrow terminals), a
    builtin text by the name of the file it ships as."""
    if source.startswith(BUILTIN):
        return f"{source.removeprefix(BUILTIN)}.txt"
    return Path(source).name if Path(source).expanduser().is_file() else source


@lru_cache(maxsize=8)
def load_text(source: str) -> str:
    """The whole text of a source, documents joined by blank lines (the papers' protocol)."""
    if source.startswith(BUILTIN):
        return lzma.decompress(_builtin_file(source, "text source").read_bytes()).decode()
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


Bos = Literal["auto", "window", "stream", "none"]
Sampling = Literal["uniform", "gptq"]


def adds_bos(tokenizer) -> bool:
    """Whether the tokenizer starts every encoded text with its BOS token (Gemma, LLaMA-2,
    Mistral do; GPT-2, Qwen2 and SmolLM2 do not)."""
    bos = tokenizer.bos_token_id
    return bos is not None and tokenizer("a").input_ids[:1] == [bos]


def resolve_bos(tokenizer, bos: Bos) -> str:
    """The BOS placement a run uses: ``window`` (a BOS opens every evaluation window, calibration
    sample and training sequence), ``stream`` (one BOS opens the whole text: the LLaMA papers'
    WikiText-2 protocol) or ``none``. ``auto`` is ``window`` when the tokenizer adds a BOS."""
    if bos == "auto":
        return "window" if adds_bos(tokenizer) else "none"
    if bos != "none" and tokenizer.bos_token_id is None:
        raise UsageError(f"bos: {bos} but the tokenizer has no BOS token", "set bos: none (or auto)")
    return bos


def tokenize(tokenizer, source: str, max_tokens: int | None = None, bos: str = "none") -> torch.Tensor:
    """Token ids (1-D LongTensor) of a whole source, opened by one BOS when ``bos`` is
    ``stream``; ``max_tokens`` stops early on huge corpora."""
    text = load_text(source)
    if max_tokens is not None:
        text = text[: max_tokens * 12]  # ~4 chars a token: plenty of margin, avoids tokenizing GBs
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids[0]
    if bos == "stream":
        ids = torch.cat([torch.tensor([tokenizer.bos_token_id]), ids])
    return ids if max_tokens is None else ids[:max_tokens]


def windows(ids: torch.Tensor, length: int, stride: int | None = None, limit: int | None = None,
            bos: bool = False) -> list[tuple[int, int, int]]:
    """(begin, end, first scored position) of each evaluation window over ``ids``.

    Non-overlapping windows when ``stride`` is None or equal to ``length`` (each scores its
    tokens 1..L-1); with a smaller stride each window re-reads context but scores only the
    tokens no earlier window scored. With ``bos`` every window is opened by a BOS that is not
    part of ``ids``: it spans L - 1 tokens of text and scores them all from the first.
    """
    span = length - bos
    stride = min(stride or span, span)
    n = ids.numel()
    out, prev_end = [], 0
    for begin in range(0, max(n - 1 + bos, 1), stride):
        end = min(begin + span, n)
        if end - begin < 2 - bos:
            break
        out.append((begin, end, max(prev_end - begin, 1 - bos)))  # without a BOS, token 0 has no context
        prev_end = end
        if end == n or (limit is not None and len(out) >= limit):
            break
    return out


def sample_batches(ids: torch.Tensor, num_samples: int, seq_len: int, batch_size: int, seed: int,
                   sampling: Sampling = "uniform", bos_id: int | None = None) -> list[torch.Tensor]:
    """``seq_len``-token windows of a token stream at random places, grouped into batches.

    ``uniform`` draws the starts with a torch generator; ``gptq`` is the sampler of the GPTQ,
    SVD-LLM and Basis Sharing scripts (``random.seed(seed)``, then ``random.randint(0, N -
    seq_len - 1)`` per sample), so their calibration sets can be reproduced exactly. With
    ``bos_id`` every sample is that token followed by ``seq_len - 1`` tokens of text.
    """
    span = seq_len - (bos_id is not None)
    if ids.numel() <= span:
        raise UsageError(f"calibration text has {ids.numel()} tokens, fewer than seq_len={seq_len}",
                         "use a longer text or a smaller calibration.seq_len")
    if sampling == "gptq":
        rng = random.Random(seed)
        starts = [rng.randint(0, ids.numel() - span - 1) for _ in range(num_samples)]
    else:
        starts = torch.randint(0, ids.numel() - span, (num_samples,), generator=torch.Generator().manual_seed(seed)).tolist()
    rows = torch.stack([ids[s: s + span] for s in starts])
    if bos_id is not None:
        rows = torch.cat([torch.full((num_samples, 1), bos_id, dtype=rows.dtype), rows], 1)
    return list(rows.split(batch_size))


def first_samples(batches: list[torch.Tensor], n: int | None) -> list[torch.Tensor]:
    """The first ``n`` sequences of ``batches`` (all with None), in batches of the same size."""
    if n is None or n >= sum(len(b) for b in batches):
        return batches
    return list(torch.cat(batches)[:n].split(len(batches[0])))


def calibration_batches(tokenizer, source: str, num_samples: int, seq_len: int, batch_size: int, seed: int,
                        bos: Bos = "none", sampling: Sampling = "uniform") -> list[torch.Tensor]:
    mode = resolve_bos(tokenizer, bos)
    ids = tokenize(tokenizer, source, max_tokens=max(num_samples * seq_len * 20, 200_000), bos=mode)
    return sample_batches(ids, num_samples, seq_len, batch_size, seed, sampling,
                          tokenizer.bos_token_id if mode == "window" else None)
