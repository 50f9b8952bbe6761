"""gqa: key/value heads mean-pooled into groups; the config follows so stock transformers runs it."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import assert_roundtrip, tiny_model
from wscompress import compress, storage
from wscompress.errors import UsageError


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
def test_pooling_identical_heads_is_exact_and_stock_transformers_runs_it(kind, heads, groups, tokenizer, tmp_path):
    model = tiny_model(kind)
    duplicate_kv_heads(model, heads, groups)
    before, params = logits(model), storage.stats(model)["params"]
    (row,) = compress(model, [{"method": "gqa", "groups": groups}])
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
    compress(model, [{"method": "gqa", "groups": 2}])
    pooled = model.model.layers[1].self_attn.v_proj.weight.view(2, 16, 64)
    torch.testing.assert_close(pooled, torch.stack([(w[0] + w[1]) / 2, (w[2] + w[3]) / 2]))


def test_groups_equal_to_kv_heads_change_nothing():
    model = tiny_model("llama")
    before = logits(model)
    compress(model, [{"method": "gqa", "groups": 2}])
    torch.testing.assert_close(logits(model), before)


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
    compress(model, [{"method": "cross_layer", "what": "attn", "group_size": 2}, {"method": "gqa", "groups": 2}])
    layers = model.model.layers
    assert layers[0].self_attn.k_proj is layers[1].self_attn.k_proj
    assert layers[0].self_attn.k_proj.out_features == 32
    assert_roundtrip(model, tokenizer, tmp_path / "m")
