"""gqa: key/value heads merged into groups (mean-pooled, or by calibrated principal components
folded into q/o); the config follows so stock transformers runs it."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from wscompress import compress
from wscompress.errors import UsageError
from wscompress.io import storage

from conftest import assert_roundtrip, tiny_model

CALIB = {"dataset": "pydoc", "num_samples": 8, "seq_len": 64, "batch_size": 4, "dtype": "float32"}


def logits(model):
    x = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        return model(x).logits


def duplicate_kv_heads(model, heads: int, groups: int) -> None:
    """Make the kv heads of each future group identical, so pooling them changes nothing."""
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.k_proj, layer.self_attn.v_proj):
                w = proj.weight.view(groups, heads // groups, -1, proj.weight.shape[1])
                w.copy_(w[:, :1].expand_as(w))
                if proj.bias is not None:
                    b = proj.bias.view(groups, heads // groups, -1)
                    b.copy_(b[:, :1].expand_as(b))


@pytest.mark.parametrize("kind, heads, groups", [("llama_mha", 4, 2), ("llama_mha", 4, 1), ("llama", 2, 1), ("qwen2", 2, 1)])
@pytest.mark.parametrize("init", ["mean", "pca"])
def test_merging_identical_heads_is_exact_and_stock_transformers_runs_it(kind, heads, groups, init, tokenizer, tmp_path):
    model = tiny_model(kind)
    duplicate_kv_heads(model, heads, groups)
    before, params = logits(model), storage.stats(model)["params"]
    (row,) = compress(model, [{"method": "gqa", "groups": groups, "init": init}], tokenizer, CALIB)
    assert (row["kv_heads_before"], row["kv_heads_after"]) == (heads, groups)
    assert model.config.num_key_value_heads == groups
    assert model.model.layers[0].self_attn.k_proj.out_features == groups * 16
    has_bias = model.model.layers[0].self_attn.k_proj.bias is not None  # Qwen2 has k/v biases
    saved = 4 * 2 * (heads - groups) * 16 * (64 + has_bias)
    assert params - storage.stats(model)["params"] == saved
    torch.testing.assert_close(logits(model), before, atol=1e-5, rtol=1e-4)
    reloaded = assert_roundtrip(model, tokenizer, tmp_path / "m")
    storage.export_dense(reloaded, tokenizer, tmp_path / "dense")
    stock = AutoModelForCausalLM.from_pretrained(tmp_path / "dense")
    assert stock.config.num_key_value_heads == groups
    torch.testing.assert_close(logits(stock), before, atol=1e-5, rtol=1e-4)


def test_pooled_heads_are_the_mean():
    model = tiny_model("llama_mha")
    w = model.model.layers[1].self_attn.v_proj.weight.detach().clone().view(4, 16, 64)
    compress(model, [{"method": "gqa", "groups": 2, "init": "mean"}])
    pooled = model.model.layers[1].self_attn.v_proj.weight.view(2, 16, 64)
    torch.testing.assert_close(pooled, torch.stack([(w[0] + w[1]) / 2, (w[2] + w[3]) / 2]))


@pytest.mark.parametrize("init", ["mean", "pca"])
def test_groups_equal_to_kv_heads_change_nothing(init, tokenizer):
    model = tiny_model("llama")
    before = logits(model)
    compress(model, [{"method": "gqa", "groups": 2, "init": init}], tokenizer, CALIB)
    torch.testing.assert_close(logits(model), before, atol=1e-5, rtol=1e-4)


def test_groups_not_dividing_the_heads_is_a_usage_error():
    with pytest.raises(UsageError, match="does not divide the model's 4 key/value heads") as err:
        compress(tiny_model("llama_mha"), [{"method": "gqa", "groups": 3}])
    assert "[1, 2, 4]" in err.value.fix
    with pytest.raises(UsageError, match="greater than or equal to 1"):
        compress(tiny_model("llama_mha"), [{"method": "gqa", "groups": 0}])


def test_model_without_kv_head_config_is_a_usage_error():
    with pytest.raises(UsageError, match="num_key_value_heads"):
        compress(tiny_model("gpt2"), [{"method": "gqa", "groups": 2}])


def test_projections_shared_across_layers_stay_shared(tokenizer, tmp_path):
    model = tiny_model("llama_mha")
    compress(model, [{"method": "cross_layer", "what": "attn", "group_size": 2, "init": "mean", "refit": False},
                     {"method": "gqa", "groups": 2, "init": "mean"}])
    layers = model.model.layers
    assert layers[0].self_attn.k_proj is layers[1].self_attn.k_proj
    assert layers[0].self_attn.k_proj.out_features == 32
    assert_roundtrip(model, tokenizer, tmp_path / "m")
    with pytest.raises(UsageError, match="init: mean pools shared projections"):
        compress(tiny_model("llama_mha"), [{"method": "cross_layer", "what": "attn", "group_size": 2, "init": "mean", "refit": False},
                                           {"method": "gqa", "groups": 2}], tokenizer, CALIB)


def transform_heads(model, heads: int, groups: int, seed: int = 0) -> None:
    """Make each group's kv heads transforms of its first one that the pca merge can undo
    exactly: keys a complex factor per RoPE pair (dimensions j, j + d/2), values any invertible
    map; biases (Qwen2) alike."""
    gen = torch.Generator().manual_seed(seed)
    g = heads // groups
    with torch.no_grad():
        for layer in model.model.layers:
            k, v = layer.self_attn.k_proj, layer.self_attn.v_proj
            d = k.weight.shape[0] // heads
            for proj in (k, v):
                for t in range(1, g):
                    if proj is k:
                        c = torch.complex(*torch.randn(2, d // 2, generator=gen))
                        first = torch.complex(*proj.weight.view(groups, g, 2, d // 2, -1)[:, 0].unbind(1))
                        z = c[:, None] * first
                        proj.weight.view(groups, g, 2, d // 2, -1)[:, t].copy_(torch.stack([z.real, z.imag], 1))
                        if proj.bias is not None:
                            b = c * torch.complex(*proj.bias.view(groups, g, 2, d // 2)[:, 0].unbind(1))
                            proj.bias.view(groups, g, 2, d // 2)[:, t].copy_(torch.stack([b.real, b.imag], 1))
                    else:
                        m = torch.randn(d, d, generator=gen) + 3 * torch.eye(d)
                        proj.weight.view(groups, g, d, -1)[:, t].copy_(m @ proj.weight.view(groups, g, d, -1)[:, 0])
                        if proj.bias is not None:
                            proj.bias.view(groups, g, d)[:, t].copy_(proj.bias.view(groups, g, d)[:, 0] @ m.T)


@pytest.mark.parametrize("kind, heads, groups", [("llama_mha", 4, 1), ("llama_mha", 4, 2), ("qwen2", 2, 1)])
def test_pca_is_exact_where_heads_are_rope_compatible_transforms_of_each_other(kind, heads, groups, tokenizer):
    """Keys that differ by a complex factor per RoPE pair and values that differ by any
    invertible map lose nothing: the factors move into the queries and o_proj, at every position."""
    model = tiny_model(kind)
    transform_heads(model, heads, groups)
    before = logits(model)
    (row,) = compress(model, [{"method": "gqa", "groups": groups}], tokenizer, CALIB)
    assert row["init"] == "pca" and row["value_energy_kept"] == pytest.approx(1) and row["key_energy_kept"] == pytest.approx(1)
    torch.testing.assert_close(logits(model), before, atol=1e-4, rtol=1e-3)
    mean = tiny_model(kind)
    transform_heads(mean, heads, groups)
    compress(mean, [{"method": "gqa", "groups": groups, "init": "mean"}])
    assert (logits(mean) - before).norm() > 100 * (logits(model) - before).norm()


@pytest.mark.parametrize("kind", ["llama_mha", "mistral"])
def test_pca_keeps_the_model_closer_than_mean_pooling_on_held_out_text(kind, tokenizer):
    """Random heads share nothing exactly; the calibrated merge still keeps the logits on text
    it was not calibrated on closer to the original's than averaging does."""
    ids = tokenizer("The river ran past the old mill, and the miller counted his sacks twice.",
                    return_tensors="pt").input_ids[:, :24] % 512
    errors = {}
    for init in ("mean", "pca"):
        model = tiny_model(kind)
        with torch.no_grad():
            before = model(ids).logits
        compress(model, [{"method": "gqa", "groups": 1, "init": init}], tokenizer, CALIB)
        with torch.no_grad():
            errors[init] = ((model(ids).logits - before).norm() / before.norm()).item()
    assert errors["pca"] < 0.8 * errors["mean"], errors


@pytest.mark.parametrize("kind", ["llama_mha", "qwen2"])
def test_o_refit_brings_the_model_closer_to_the_original_on_what_it_was_fitted_on(kind, tokenizer):
    """Re-solving o_proj on the merged attention's own contexts (the default) brings the
    logits on the calibration sequences closer to the original's than the merge alone (random
    tiny models have nothing for held-out text to share; the protocol measures that)."""
    from wscompress.io import data

    calibration = data.calibration_batches(tokenizer, CALIB["dataset"], 8, 64, 4, seed=0)
    errors = {}
    for refit in (False, True):
        model = tiny_model(kind)
        with torch.no_grad():
            before = [model(x).logits for x in calibration]
        (row,) = compress(model, [{"method": "gqa", "groups": 1, "refit": refit}], tokenizer, CALIB)
        assert row["refit"] is refit
        with torch.no_grad():
            errors[refit] = sum(((model(x).logits - b).norm() / b.norm()).item() for x, b in zip(calibration, before))
    assert errors[True] < 0.8 * errors[False], errors


def test_keys_are_averaged_under_a_per_head_norm(tokenizer):
    """Gemma 3 normalises each key head before RoPE: no factor can move into the queries, so
    keys are averaged (and the report says why) while values take the calibrated merge."""
    model = tiny_model("gemma3")
    (row,) = compress(model, [{"method": "gqa", "groups": 1}], tokenizer, CALIB)
    assert row["key_energy_kept"].startswith("keys averaged: a per-head norm")
    assert 0 < row["value_energy_kept"] <= 1
    assert model.config.num_key_value_heads == 1 and torch.isfinite(logits(model)).all()
