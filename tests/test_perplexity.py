"""Perplexity protocol against a hand computation, windows, and text sources."""

import math

import pytest
import torch
import torch.nn.functional as F

from wscompress.errors import UsageError
from wscompress.evaluation.perplexity import perplexity
from wscompress.io import data

from conftest import WIKI_TEST, tiny_model


def hand_ppl(model, ids, length):
    """Token by token: each non-overlapping window scores its tokens 1..L-1 given the prefix."""
    nll, n = 0.0, 0
    for begin in range(0, ids.numel(), length):
        window = ids[begin: begin + length]
        if window.numel() < 2:
            continue
        with torch.no_grad():
            logits = model(window[None]).logits[0]
        for t in range(1, window.numel()):
            nll -= F.log_softmax(logits[t - 1].double(), -1)[window[t]].item()
            n += 1
    return math.exp(nll / n), n


def test_matches_hand_computation():
    model = tiny_model("llama")
    ids = torch.randint(0, 512, (250,), generator=torch.Generator().manual_seed(0))
    got = perplexity(model, ids, context_length=64, batch_size=3)
    want, n = hand_ppl(model, ids, 64)
    assert got["tokens"] == n and got["windows"] == 4
    assert got["ppl"] == pytest.approx(want, rel=1e-5)
    assert got["tokens_per_s"] > 0


def test_strided_scores_each_token_once():
    model = tiny_model("llama")
    ids = torch.randint(0, 512, (200,), generator=torch.Generator().manual_seed(1))
    got = perplexity(model, ids, context_length=64, stride=32)
    assert got["tokens"] == ids.numel() - 1  # every token after the first, exactly once
    spans = data.windows(ids, 64, 32)
    assert spans[0] == (0, 64, 1) and spans[1] == (32, 96, 32)


def test_max_windows_limits_work():
    ids = torch.arange(1000)
    assert len(data.windows(ids, 100, limit=3)) == 3


def test_local_text_and_jsonl_sources(tmp_path, tokenizer):
    (tmp_path / "a.jsonl").write_text('{"text": "hello world"}\n{"text": "class def"}\n')
    assert data.load_text(str(tmp_path / "a.jsonl")) == "hello world\n\nclass def"
    assert "wiki" in WIKI_TEST and len(data.load_text(WIKI_TEST)) > 1_000_000
    assert len(data.load_text("pydoc")) > 100_000
    ids = data.tokenize(tokenizer, "pydoc", max_tokens=500)
    assert ids.numel() == 500


def test_bad_sources(tmp_path):
    with pytest.raises(UsageError, match="not found"):
        data.load_text(str(tmp_path / "missing.txt"))
    (tmp_path / "bad.jsonl").write_text('{"sentence": 1}\n')
    with pytest.raises(UsageError, match="'text' field"):
        data.load_text(str(tmp_path / "bad.jsonl"))


def test_calibration_sampling_is_seeded(tokenizer):
    a = data.calibration_batches(tokenizer, "pydoc", 6, 32, 4, seed=3)
    b = data.calibration_batches(tokenizer, "pydoc", 6, 32, 4, seed=3)
    assert [x.shape for x in a] == [(4, 32), (2, 32)]
    assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def bos_tokenizer():
    """The test tokenizer, made to open every encoding with a BOS (as Gemma's and LLaMA-2's do)."""
    from tokenizers.processors import TemplateProcessing

    from conftest import make_tokenizer

    tok = make_tokenizer()
    tok.add_special_tokens({"bos_token": "<bos>"})
    bos = tok.convert_tokens_to_ids("<bos>")
    tok.backend_tokenizer.post_processor = TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", bos)])
    assert tok("a").input_ids[0] == bos
    return tok


def test_bos_placement(tokenizer, bos_tokenizer):
    bos = bos_tokenizer.bos_token_id
    assert data.resolve_bos(bos_tokenizer, "auto") == "window" and data.resolve_bos(tokenizer, "auto") == "none"
    with pytest.raises(UsageError, match="no BOS token"):
        data.resolve_bos(tokenizer, "window")
    plain = data.tokenize(bos_tokenizer, "pydoc", max_tokens=300)
    stream = data.tokenize(bos_tokenizer, "pydoc", max_tokens=301, bos="stream")
    assert bos not in plain.tolist() and stream[0] == bos and torch.equal(stream[1:], plain)
    for mode, first in (("auto", bos), ("window", bos), ("none", None)):
        rows = torch.cat(data.calibration_batches(bos_tokenizer, "pydoc", 6, 32, 4, seed=0, bos=mode))
        assert rows.shape == (6, 32)
        assert (rows[:, 0] == bos).all() if first is not None else bos not in rows.tolist()
    # window mode: each window is BOS + L - 1 tokens of text, and every text token is scored
    spans = data.windows(torch.arange(100), 32, bos=True)
    assert spans[0] == (0, 31, 0) and spans[1] == (31, 62, 0) and spans[-1][1] == 100


def test_perplexity_with_a_bos_per_window_matches_hand_computation():
    model = tiny_model("llama")
    ids = torch.randint(2, 512, (200,), generator=torch.Generator().manual_seed(0))
    got = perplexity(model, ids, context_length=64, batch_size=3, bos_id=1)
    nll, n = 0.0, 0
    for begin in range(0, 200, 63):
        window = torch.cat([torch.tensor([1]), ids[begin: begin + 63]])
        with torch.no_grad():
            logp = F.log_softmax(model(window[None]).logits[0].double(), -1)
        nll -= sum(logp[t - 1, window[t]].item() for t in range(1, window.numel()))
        n += window.numel() - 1
    assert got["tokens"] == n == 200
    assert got["ppl"] == pytest.approx(math.exp(nll / n), rel=1e-5)


def test_gptq_sampling_reproduces_the_reference_scripts(tokenizer):
    """calibration.sampling: gptq draws exactly the windows the GPTQ / SVD-LLM scripts draw."""
    import random

    ids = data.tokenize(tokenizer, "pydoc", max_tokens=5000)
    random.seed(7)
    want = torch.stack([ids[i: i + 64] for i in (random.randint(0, ids.numel() - 64 - 1) for _ in range(5))])
    got = torch.cat(data.sample_batches(ids, 5, 64, 2, seed=7, sampling="gptq"))
    assert torch.equal(got, want)
