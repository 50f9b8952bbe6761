"""tie_embeddings and factorize_embeddings."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from wscompress import compress
from wscompress.errors import UsageError
from wscompress.io import storage
from wscompress.model.forms.wscompress_embeddings import FactorizedEmbedding, FactorizedLMHead

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


STORED = {"half": ("HalfLinear", 512 * 64 * 2), "int8": ("Int8Linear", 512 * 64 + 512 * 2 * 2)}  # its bytes: 16 bits,
# or 8 a weight and a float16 scale per 32


@pytest.mark.parametrize("stage", sorted(STORED))
@pytest.mark.parametrize("kind", ["llama", "llama_mha"])  # tied, then a separate head
def test_narrow_head_is_stored_once_and_computes_as_its_rounded_weights(kind, stage, tokenizer, tmp_path):
    """The ``half`` and ``int8`` stages store the head in fewer bits: a tied embedding reads the
    same table (stored once, tied after loading), the model computes what the rounded weights give
    (decode steps by the kernel, prefill by the torch path), the file shrinks by what the table
    saves, and a dense export gives stock transformers the same model."""
    from wscompress import kernels
    from wscompress.evaluation.bench import kernel_path
    from wscompress.model.forms.wscompress_format import LAYERS
    from wscompress.model.forms.wscompress_embeddings import PalettizedEmbedding

    form, nbytes = LAYERS[STORED[stage][0]], STORED[stage][1]
    model = tiny_model(kind)
    tied = model.config.tie_word_embeddings
    w = model.get_output_embeddings().weight.detach().clone()
    before, params = storage.stats(model)["tensor_bytes"], storage.stats(model)["params"]
    x = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model.get_output_embeddings().weight.copy_(form.from_weight(w, None).dense_weight())  # the stage's rounding
        rounded = model(x).logits
        model.get_output_embeddings().weight.copy_(w)
    (row,) = compress(model, [{"method": stage}])
    head, emb = model.get_output_embeddings(), model.get_input_embeddings()
    dtypes = [t.dtype for t in head.stored()]
    assert isinstance(head, form) and row["layers"] == 1 and 0 < row["per_layer"][0]["rel_error"] < 0.01
    assert isinstance(emb, PalettizedEmbedding) and emb.table is head if tied else isinstance(emb, torch.nn.Embedding)
    assert storage.stats(model)["tensor_bytes"] == before - 512 * 64 * 4 + nbytes
    assert storage.stats(model)["params"] == params  # the same weights, in fewer bits (not also the scales)
    said = kernel_path(model)  # what bench reports: each form's own account
    assert f"{form.__name__}: kernel with float32 sums" in said or kernels.lowrank() is None and "(torch)" in said
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits, rounded, rtol=1e-5, atol=1e-5)
        out = model(x, use_cache=True)  # a decode step (one row a sequence) on the kernel path
        step = model(x[:, :1], past_key_values=out.past_key_values).logits
        model.get_output_embeddings().weight  # noqa: B018 - a dense copy on request, as peft reads it
    model.to(torch.float64)  # the table stays as stored; rows and products follow the model's dtype
    assert [t.dtype for t in head.stored()] == dtypes and emb(x).dtype == torch.float64
    model.to(torch.float32)
    saved = storage.save(model, tokenizer, tmp_path / "m")
    loaded, _ = storage.load(tmp_path / "m")
    assert saved["tensor_bytes"] == storage.stats(model)["tensor_bytes"]
    assert not tied or loaded.get_input_embeddings().table is loaded.get_output_embeddings()
    with torch.no_grad():
        torch.testing.assert_close(loaded(x).logits, model(x).logits, rtol=0, atol=1e-6)
        out = loaded(x, use_cache=True)
        torch.testing.assert_close(loaded(x[:, :1], past_key_values=out.past_key_values).logits, step, rtol=1e-5, atol=1e-5)
    storage.export_dense(loaded, tokenizer, tmp_path / "dense")
    stock = AutoModelForCausalLM.from_pretrained(tmp_path / "dense")
    with torch.no_grad():
        torch.testing.assert_close(stock(x).logits, rounded, rtol=1e-5, atol=1e-5)


def test_int8_is_exact_on_a_weight_already_on_its_grid_and_refuses_widths_it_cannot_block():
    """A weight that is int8 values times a float16 scale per 32 (a Q8_0 checkpoint's) comes back
    exactly; a head whose width is no multiple of 32 is refused before any work, naming ``half``."""
    from wscompress.model.forms.wscompress_narrow import Int8Linear

    gen = torch.Generator().manual_seed(0)
    q = torch.randint(-127, 128, (96, 64), generator=gen).float()
    q[:, ::32] = 127  # each block reaches its largest magnitude, as absmax rounding makes it
    scale = (torch.rand(96, 2, generator=gen) / 50 + 1e-3).half().float()
    w = (q.view(96, 2, 32) * scale[..., None]).view(96, 64)
    assert torch.equal(Int8Linear.from_weight(w, None).dense_weight(), w)
    model = tiny_model("llama")
    model.lm_head = torch.nn.Linear(40, 512, bias=False)  # checked on its own, before the model ever runs
    with pytest.raises(UsageError, match="(?s)40 inputs, not a multiple of 32.*method: half"):
        compress(model, [{"method": "int8"}])


def test_half_refuses_a_target_that_matches_nothing_before_any_work():
    with pytest.raises(UsageError, match="matches no module"):
        compress(tiny_model("llama"), [{"method": "half", "targets": ["no_such_layer"]}])
