"""cross_layer: groups of layers share one attention / FFN / block (same module objects)."""

import pytest
import torch
from torch import nn

from conftest import REPO, WIKI_TRAIN, assert_roundtrip, tiny_model
from wscompress import compress, storage
from wscompress.arch import discover
from wscompress.errors import UsageError
from wscompress.recipe import load_recipe
from wscompress.sharing import part_leaves

CALIBRATION = {"dataset": WIKI_TRAIN, "num_samples": 4, "seq_len": 32, "batch_size": 2}


class AttentionOnly(nn.Module):
    """A decoder stack whose layers have attention and no FFN."""

    def __init__(self):
        super().__init__()
        self.config = type("Config", (), {"num_attention_heads": 2, "hidden_size": 8})()
        self.layers = nn.ModuleList(nn.ModuleDict({"self_attn": nn.ModuleDict(
            {p: nn.Linear(8, 8) for p in ("q_proj", "k_proj", "v_proj", "o_proj")})}) for _ in range(4))


@pytest.mark.parametrize("kind", ["llama", "llama_mha", "gpt2"])
def test_ffn_groups_share_module_objects_and_store_them_once(kind, tokenizer, tmp_path):
    model = tiny_model(kind)
    before = storage.stats(model)["params"]
    arch = discover(model)
    ffn = sum(p.numel() for m in part_leaves(arch, 0, "ffn").values() for p in m.parameters())
    (row,) = compress(model, [{"method": "cross_layer", "what": "ffn", "group_size": 2}], tokenizer)
    assert row["groups"] == [[0, 1], [2, 3]]
    for a, b in ((0, 1), (2, 3)):
        mine, theirs = part_leaves(arch, a, "ffn"), part_leaves(arch, b, "ffn")
        assert all(m is theirs[n.replace(f".{a}.", f".{b}.")] for n, m in mine.items())
    assert part_leaves(arch, 1, "ffn") != part_leaves(arch, 2, "ffn")
    assert row["params_saved"] == 2 * ffn
    assert storage.stats(model)["params"] == before - 2 * ffn
    assert_roundtrip(model, tokenizer, tmp_path / "m")


def test_block_sharing_keeps_each_layers_attention_module(tokenizer, tmp_path):
    model = tiny_model("llama")
    compress(model, [{"method": "cross_layer", "what": "block", "groups": [[0, 3]], "init": "representative",
                      "representative": 1}], tokenizer)
    layers = model.model.layers
    assert layers[0].self_attn is not layers[3].self_attn  # each keeps its layer_idx for the KV cache
    assert layers[0].self_attn.layer_idx == 0 and layers[3].self_attn.layer_idx == 3
    assert layers[0].self_attn.q_proj is layers[3].self_attn.q_proj
    assert layers[0].input_layernorm is layers[3].input_layernorm
    assert_roundtrip(model, tokenizer, tmp_path / "m")


def test_mean_init_averages_the_group():
    model = tiny_model("llama")
    w = [model.model.layers[i].self_attn.q_proj.weight.detach().clone() for i in (1, 2)]
    compress(model, [{"method": "cross_layer", "what": "attn", "groups": [[1, 2]]}])
    torch.testing.assert_close(model.model.layers[2].self_attn.q_proj.weight, (w[0] + w[1]) / 2)


def test_best_init_picks_the_layer_with_least_group_error(tokenizer):
    model = tiny_model("llama")
    layers = model.model.layers
    layers[1].mlp.load_state_dict(layers[0].mlp.state_dict())  # 0 and 1 agree, 2 is the odd one out
    (row,) = compress(model, [{"method": "cross_layer", "what": "ffn", "groups": [[0, 1, 2]], "init": "best"}],
                      tokenizer, CALIBRATION)
    assert row["sources"][0] in (0, 1)
    assert layers[2].mlp.up_proj is layers[row["sources"][0]].mlp.up_proj


@pytest.mark.parametrize("options, message", [
    ({"groups": [[0, 1], [1, 2]]}, "must not overlap"),
    ({"groups": [[2, 4]]}, "does not exist"),
    ({"groups": [[2]]}, "fewer than 2"),
    ({"group_size": 5}, "exceeds"),
    ({"groups": [[0, 1]], "init": "representative", "representative": 2}, "not a position"),
])
def test_bad_groups_are_usage_errors(options, message):
    model = tiny_model("llama")
    with pytest.raises(UsageError, match=message):
        compress(model, [{"method": "cross_layer", **options}])


def test_grouping_needs_exactly_one_of_group_size_and_groups():
    with pytest.raises(UsageError, match="exactly one of group_size or groups"):
        compress(tiny_model("llama"), [{"method": "cross_layer", "group_size": 2, "groups": [[0, 1]]}])


def test_ffn_sharing_on_a_model_without_ffn_names_the_fix():
    with pytest.raises(UsageError, match="no FFN layers") as err:
        compress(AttentionOnly(), [{"method": "cross_layer", "what": "ffn", "group_size": 2}])
    assert "attn" in err.value.fix
    (row,) = compress(model := AttentionOnly(), [{"method": "cross_layer", "what": "attn", "group_size": 2}])
    assert model.layers[0].self_attn.q_proj is model.layers[1].self_attn.q_proj and row["params_saved"] == 2 * 4 * 72


@pytest.mark.parametrize("path", sorted(REPO.glob("configs/structural*.yaml")), ids=lambda p: p.name)
def test_structural_recipes_are_valid(path):
    recipe = load_recipe(path)
    assert recipe.compress and recipe.finetune is not None
