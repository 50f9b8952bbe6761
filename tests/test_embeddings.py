"""tie_embeddings and factorize_embeddings."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from wscompress import compress
from wscompress.errors import UsageError
from wscompress.io import storage
from wscompress.model.modeling_wscompress import FactorizedEmbedding, FactorizedLMHead

from conftest import assert_roundtrip, tiny_model


@pytest.mark.parametrize("init", ["input", "output", "mean"])
def test_tie_separate_embeddings(init, tokenizer, tmp_path):
    model = tiny_model("llama_mha")
    emb, head = model.model.embed_tokens.weight.detach().clone(), model.lm_head.weight.detach().clone()
    before = storage.stats(model)["params"]
    (row,) = compress(model, [{"method": "tie_embeddings", "init": init}])
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.config.tie_word_embeddings
    assert row["params_saved"] == 512 * 64 == before - storage.stats(model)["params"]
    torch.testing.assert_close(model.lm_head.weight, {"input": emb, "output": head, "mean": (emb + head) / 2}[init])
    reloaded = assert_roundtrip(model, tokenizer, tmp_path / "m")
    assert reloaded.lm_head.weight is reloaded.model.embed_tokens.weight


def test_tie_on_a_tied_model_is_reported_not_applicable():
    model = tiny_model("llama")
    (row,) = compress(model, [{"method": "tie_embeddings"}])
    assert row["applicable"] is False and row["params_saved"] == 0 and row["params_after"] == row["params_before"]


@pytest.mark.parametrize("kind", ["llama", "gpt2", "llama_mha"])
def test_factorize_embeddings(kind, tokenizer, tmp_path):
    model = tiny_model(kind)
    tied = model.config.tie_word_embeddings
    w = model.get_input_embeddings().weight.detach().clone()
    before = storage.stats(model)["params"]
    (row,) = compress(model, [{"method": "factorize_embeddings", "rank": 16}])
    emb = model.get_input_embeddings()
    assert isinstance(emb, FactorizedEmbedding) and row["tied_head"] == tied
    assert before - storage.stats(model)["params"] == row["params_saved"] == 512 * 64 - 16 * (512 + 64)
    s = torch.linalg.svdvals(w)
    assert (emb.dense_weight() - w).pow(2).sum().item() == pytest.approx(s[16:].pow(2).sum().item(), rel=1e-3)  # optimal rank-16
    head = model.get_output_embeddings()
    if tied:  # the head computes with the embedding's own factors, not a dense copy
        assert isinstance(head, FactorizedLMHead) and head.embed is emb.embed and head.proj is emb.proj
        torch.testing.assert_close(head.dense_weight(), emb.dense_weight())
    else:
        assert isinstance(head, torch.nn.Linear)
    reloaded = assert_roundtrip(model, tokenizer, tmp_path / "m")
    storage.export_dense(reloaded, tokenizer, tmp_path / "dense")
    stock = AutoModelForCausalLM.from_pretrained(tmp_path / "dense")
    x = torch.randint(0, 512, (1, 10))
    with torch.no_grad():
        torch.testing.assert_close(stock(x).logits, model(x).logits, atol=1e-5, rtol=1e-4)


def test_factorize_keeps_gemma_embedding_scale(tokenizer, tmp_path):
    model = tiny_model("gemma3")
    compress(model, [{"method": "factorize_embeddings", "rank": 16}])
    emb = model.get_input_embeddings()
    ids = torch.arange(10)
    torch.testing.assert_close(emb(ids), emb.dense_weight()[ids] * 64 ** 0.5)
    reloaded = assert_roundtrip(model, tokenizer, tmp_path / "m")
    storage.export_dense(reloaded, tokenizer, tmp_path / "dense")
    stock = AutoModelForCausalLM.from_pretrained(tmp_path / "dense")
    with torch.no_grad():
        torch.testing.assert_close(stock(ids[None]).logits, model(ids[None]).logits, atol=1e-5, rtol=1e-4)


def test_factorize_rank_that_saves_nothing_is_a_usage_error():
    with pytest.raises(UsageError, match="saves nothing") as err:
        compress(tiny_model("llama"), [{"method": "factorize_embeddings", "rank": 60}])
    assert "below 56" in err.value.fix


def test_factorize_twice_names_the_fix():
    model = tiny_model("llama")
    compress(model, [{"method": "factorize_embeddings", "rank": 8}])
    with pytest.raises(UsageError, match="not an nn.Embedding"):
        compress(model, [{"method": "factorize_embeddings", "rank": 4}])
