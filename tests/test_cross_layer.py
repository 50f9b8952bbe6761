"""cross_layer: groups of layers share one attention / FFN / block (same module objects)."""

import pytest
import torch
from torch import nn

from wscompress import compress
from wscompress.errors import UsageError
from wscompress.io import storage
from wscompress.methods._sharing import part_leaves
from wscompress.model.arch import discover
from wscompress.recipe.load import load_recipe

from conftest import REPO, WIKI_TRAIN, assert_roundtrip, tiny_model

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
    (row,) = compress(model, [{"method": "cross_layer", "what": "ffn", "group_size": 2}], tokenizer, CALIBRATION)
    assert row["groups"] == [[0, 1], [2, 3]] and row["init"] == "fit" and row["refit"]
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
                      "representative": 1}], tokenizer, CALIBRATION)
    layers = model.model.layers
    assert layers[0].self_attn is not layers[3].self_attn  # each keeps its layer_idx for the KV cache
    assert layers[0].self_attn.layer_idx == 0 and layers[3].self_attn.layer_idx == 3
    assert layers[0].self_attn.q_proj is layers[3].self_attn.q_proj
    assert layers[0].input_layernorm is layers[3].input_layernorm
    assert_roundtrip(model, tokenizer, tmp_path / "m")


def test_mean_init_averages_the_group():
    model = tiny_model("llama")
    w = [model.model.layers[i].self_attn.q_proj.weight.detach().clone() for i in (1, 2)]
    compress(model, [{"method": "cross_layer", "what": "attn", "groups": [[1, 2]], "init": "mean", "refit": False}])
    torch.testing.assert_close(model.model.layers[2].self_attn.q_proj.weight, (w[0] + w[1]) / 2)


def test_best_init_picks_the_layer_with_least_group_error(tokenizer):
    model = tiny_model("llama")
    layers = model.model.layers
    layers[1].mlp.load_state_dict(layers[0].mlp.state_dict())  # 0 and 1 agree, 2 is the odd one out
    (row,) = compress(model, [{"method": "cross_layer", "what": "ffn", "groups": [[0, 1, 2]], "init": "best", "refit": False}],
                      tokenizer, CALIBRATION)
    assert row["sources"][0] in (0, 1)
    assert layers[2].mlp.up_proj is layers[row["sources"][0]].mlp.up_proj


def shuffled_twins(kind: str = "llama"):
    """A tiny model whose layer 1 is layer 0 with its FFN neurons shuffled; layer 0 changes the
    stream little, so the two layers' neurons fire alike and alignment can find the shuffle."""
    model = tiny_model(kind)
    arch = discover(model)
    perm = torch.randperm(128, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        arch.layers[0].mlp.down_proj.weight.mul_(0.1)
        arch.layers[0].self_attn.o_proj.weight.mul_(0.1)
        arch.layers[1].load_state_dict(arch.layers[0].state_dict())
        for name in ("gate_proj", "up_proj"):
            getattr(arch.layers[1].mlp, name).weight.copy_(getattr(arch.layers[0].mlp, name).weight[perm])
        arch.layers[1].mlp.down_proj.weight.copy_(arch.layers[0].mlp.down_proj.weight[:, perm])
    return model


def test_fit_shares_shuffled_copies_exactly_where_the_mean_does_not(tokenizer):
    """FFNs that are the same up to neuron order: init fit aligns the neurons and shares the
    FFN without changing the model; averaging them unaligned mixes unrelated neurons."""
    x = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(1))
    before = shuffled_twins()(x).logits.detach()
    for init, changed in (("fit", False), ("mean", True)):
        model = shuffled_twins()
        (row,) = compress(model, [{"method": "cross_layer", "groups": [[0, 1]], "init": init}], tokenizer, CALIBRATION)
        error = ((model(x).logits.detach() - before).norm() / before.norm()).item()
        assert (error > 1e-2) if changed else (error < 1e-4), (init, error)
        assert row.get("aligned_ffn_neurons", False) is not changed


def test_fitted_weight_serves_the_members_inputs_better_than_the_mean():
    """fitted_modules minimises Σ_l ‖X_l·(W − W_l)ᵀ‖² (up to its small ridge): lower than the mean's."""
    from wscompress.methods._sharing import average_modules, fitted_modules

    gen = torch.Generator().manual_seed(0)
    modules = [nn.Linear(16, 8, bias=False) for _ in range(3)]
    xs = [torch.randn(200, 16, generator=gen) * torch.rand(16, generator=gen) * 3 for _ in modules]
    grams = [x.T @ x for x in xs]

    def loss(shared):
        return sum(((x @ (shared.weight - m.weight).T) ** 2).sum().item() for x, m in zip(xs, modules))
    assert loss(fitted_modules(modules, grams)) < 0.9 * loss(average_modules(modules))


@pytest.mark.parametrize("init, what", [("fit", "ffn"), ("mean", "attn"), ("representative", "block")])
def test_refit_brings_the_model_closer_to_the_original_on_what_it_was_fitted_on(init, what, tokenizer):
    """Re-solving the shared o_proj / down_proj on the shared layers' own inputs (the default)
    brings the logits on the calibration sequences closer to the original's than sharing alone."""
    from wscompress.io import data

    calibration = data.calibration_batches(tokenizer, WIKI_TRAIN, 4, 32, 2, seed=0)
    errors = {}
    for refit in (False, True):
        model = tiny_model("llama")
        with torch.no_grad():
            before = [model(x).logits for x in calibration]
        (row,) = compress(model, [{"method": "cross_layer", "what": what, "group_size": 2, "init": init, "refit": refit}],
                          tokenizer, CALIBRATION)
        assert bool(row.get("refit")) is refit
        with torch.no_grad():
            errors[refit] = sum(((model(x).logits - b).norm() / b.norm()).item() for x, b in zip(calibration, before))
    assert errors[True] < 0.9 * errors[False], errors


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
    (row,) = compress(model := AttentionOnly(), [{"method": "cross_layer", "what": "attn", "group_size": 2, "init": "mean",
                                                  "refit": False}])
    assert model.layers[0].self_attn.q_proj is model.layers[1].self_attn.q_proj and row["params_saved"] == 2 * 4 * 72


@pytest.mark.parametrize("path", sorted(REPO.glob("configs/structural*.yaml")), ids=lambda p: p.name)
def test_structural_recipes_are_valid(path):
    recipe = load_recipe(path)
    assert recipe.compress and recipe.finetune is not None
