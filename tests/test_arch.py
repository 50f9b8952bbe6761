"""Architecture discovery and module matching on tiny models of every supported family."""

import pytest
import torch

from wscompress.errors import UsageError
from wscompress.model.arch import as_linear, dims_of, discover, match_modules, weight_of

from conftest import tiny_model

EXPECTED = {
    "llama": ("model.layers", {"q", "k", "v", "o", "gate", "up", "down"}),
    "mistral": ("model.layers", {"q", "k", "v", "o", "gate", "up", "down"}),
    "qwen2": ("model.layers", {"q", "k", "v", "o", "gate", "up", "down"}),
    "gemma3": ("model.layers", {"q", "k", "v", "o", "gate", "up", "down"}),
    "gpt2": ("transformer.h", {"qkv", "o", "up", "down"}),
    "opt": ("model.decoder.layers", {"q", "k", "v", "o", "up", "down"}),
}


@pytest.mark.parametrize("kind", list(EXPECTED))
def test_discovery(kind):
    model = tiny_model(kind)
    arch = discover(model)
    path, roles = EXPECTED[kind]
    assert arch.layers_path == path and arch.num_layers == 4
    assert set(arch.projections(0)) == roles
    assert all(name.startswith(f"{path}.2.") for name in arch.projections(2).values())
    assert arch.submodule_name(0, "attn") is not None
    assert arch.embedding_name.endswith(("embed_tokens", "wte"))
    assert arch.num_heads == 4 and arch.head_dim == 16


def test_gqa_detected():
    assert discover(tiny_model("llama")).is_gqa and discover(tiny_model("llama")).num_kv_heads == 2
    assert not discover(tiny_model("llama_mha")).is_gqa


def test_conv1d_weight_is_out_by_in():
    model = tiny_model("gpt2")
    c_fc = model.get_submodule("transformer.h.0.mlp.c_fc")  # Conv1D, weight stored (in, out)
    assert dims_of(c_fc) == (64, 256) and weight_of(c_fc).shape == (256, 64)
    x = torch.randn(3, 64)
    assert torch.allclose(as_linear(c_fc)(x), c_fc(x), atol=1e-6)


def test_match_modules_targets_and_ignore():
    model = tiny_model("llama")
    hits = match_modules(model, [r"q_proj", r"mlp\.(up|down)_proj"], ignore=[r"layers\.0\."])
    assert len(hits) == 3 * 3 and not any(".0." in n for n in hits)


def test_pattern_matching_nothing_is_an_error():
    with pytest.raises(UsageError, match="matches no module"):
        match_modules(tiny_model("llama"), ["qproj"])


def test_invalid_regex_is_an_error():
    with pytest.raises(UsageError, match="not a valid regex"):
        match_modules(tiny_model("llama"), ["("])


def test_architecture_facts_come_from_the_table():
    llama, gemma = discover(tiny_model("llama")), discover(tiny_model("gemma3"))
    assert (llama.qk_norm, llama.ffn_output_norm, llama.rope_in_halves, llama.layer_indexed) == (False, False, True, False)
    assert (gemma.qk_norm, gemma.ffn_output_norm, gemma.rope_in_halves) == (True, True, True)
    llama.config.partial_rotary_factor = 0.5  # RoPE on part of each head: not whole heads in halves
    assert not llama.rope_in_halves
    gpt2 = tiny_model("gpt2")
    gpt2.config.scale_attn_by_inverse_layer_idx = True
    assert discover(gpt2).layer_indexed
