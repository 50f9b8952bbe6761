"""merge (averaged FFNs, depth kept) and merge_drop (averaged layers, depth removed)."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from wscompress import compress
from wscompress.errors import UsageError
from wscompress.io import data, storage

from conftest import WIKI_TRAIN, assert_roundtrip, tiny_model


def test_merge_shares_one_averaged_ffn_per_window(tokenizer, tmp_path):
    model = tiny_model("llama", layers=6)
    ups = [model.model.layers[i].mlp.up_proj.weight.detach().clone() for i in range(6)]
    (row,) = compress(model, [{"method": "merge", "n": 2, "start": 0, "num_windows": 2}])
    assert row["windows"] == [[0, 1], [2, 3]]
    layers = model.model.layers
    assert len(layers) == 6 and layers[0].mlp.up_proj is layers[1].mlp.up_proj
    assert layers[1].mlp.up_proj is not layers[2].mlp.up_proj
    torch.testing.assert_close(layers[3].mlp.up_proj.weight, (ups[2] + ups[3]) / 2)
    torch.testing.assert_close(layers[4].mlp.up_proj.weight, ups[4])  # outside the windows: untouched
    assert_roundtrip(model, tokenizer, tmp_path / "m")


@pytest.mark.parametrize("kind", ["llama", "gpt2", "gemma3"])
def test_merge_drop_removes_depth_and_keeps_generate_working(kind, tokenizer, tmp_path):
    model = tiny_model(kind, layers=6)
    layers = model.get_decoder().layers if kind != "gpt2" else model.transformer.h
    before = [dict(layer.named_parameters()) for layer in layers]
    expected = {n: (before[2][n] + before[3][n] + before[4][n]) / 3 for n in before[2]}
    types = getattr(model.config, "layer_types", None)
    (row,) = compress(model, [{"method": "merge_drop", "n": 3, "init": "mean", "search": False, "refit": False}])  # data-free
    assert row["windows"] == [[2, 3, 4]] and row["layers_after"] == 4
    layers = model.get_decoder().layers if kind != "gpt2" else model.transformer.h
    assert model.config.num_hidden_layers == len(layers) == 4
    if types is not None:
        assert model.config.layer_types == [types[i] for i in (0, 1, 2, 5)]
    attn = [m for layer in layers for m in layer.modules() if hasattr(m, "layer_idx")]
    assert sorted({m.layer_idx for m in attn}) == [0, 1, 2, 3]
    for n, p in layers[2].named_parameters():
        torch.testing.assert_close(p, expected[n])
    reloaded = assert_roundtrip(model, tokenizer, tmp_path / "m")
    storage.export_dense(reloaded, tokenizer, tmp_path / "dense")
    stock = AutoModelForCausalLM.from_pretrained(tmp_path / "dense")
    assert stock.config.num_hidden_layers == 4


CALIBRATION = {"dataset": WIKI_TRAIN, "num_samples": 8, "seq_len": 64, "batch_size": 4}


def test_merge_drop_search_finds_the_layers_that_change_the_hidden_state_least(tokenizer):
    """Layers 2 and 3 made identities (their blocks add nothing): the window where the hidden
    state's angle moves least is theirs, at distance 0, and merging it changes nothing."""
    model = tiny_model("llama", layers=6)
    for i in (2, 3):
        for linear in (model.model.layers[i].self_attn.o_proj, model.model.layers[i].mlp.down_proj):
            torch.nn.init.zeros_(linear.weight)
    x = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(input_ids=x).logits
    (row,) = compress(model, [{"method": "merge_drop", "n": 2, "refit": False}], tokenizer, CALIBRATION)
    assert row["windows"] == [[2, 3]] and row["angular_distance"]["2"] < 1e-3
    assert min(row["angular_distance"].values()) == row["angular_distance"]["2"] and len(row["angular_distance"]) == 4
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=x).logits, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
@pytest.mark.parametrize("init", ["mean", "first"])
def test_merge_drop_refit_brings_the_kept_layer_to_the_windows_output(kind, init, tokenizer):
    """refit re-solves the kept layer's down projection: on the calibration sequences its
    output is closer to what the whole window computed; init: first keeps the rest of the
    first layer as it was."""
    original = tiny_model(kind, layers=6)
    batches = data.calibration_batches(tokenizer, WIKI_TRAIN, 8, 64, 4, seed=0)

    def window_error(model) -> float:  # the kept layer (index 3) against the original window's output (layers 3-4)
        with torch.no_grad():
            return sum((model(input_ids=b, output_hidden_states=True).hidden_states[4]
                        - original(input_ids=b, output_hidden_states=True).hidden_states[5]).norm().item() for b in batches)
    errors = {}
    for refit in (False, True):
        model = tiny_model(kind, layers=6)
        stage = {"method": "merge_drop", "n": 2, "search": False, "init": init, "refit": refit}
        (row,) = compress(model, [stage], tokenizer, CALIBRATION)
        assert row["windows"] == [[3, 4]] and model.config.num_hidden_layers == 5
        errors[refit] = window_error(model)
        layer = "layers.3" if kind == "llama" else "h.3"
        kept, first = model.base_model.get_submodule(layer), original.base_model.get_submodule(layer)
        for name, p in kept.named_parameters():
            if init == "first" and "down_proj" not in name and "mlp.c_proj" not in name:
                torch.testing.assert_close(p, first.get_parameter(name))
    assert errors[True] < 0.8 * errors[False], errors


@pytest.mark.parametrize("method", ["merge", "merge_drop"])
@pytest.mark.parametrize("options, message", [
    ({"n": 4}, "need 5 layers"),
    ({"n": 2, "start": 3}, "exceed"),
    ({"groups": [[0, 1], [1, 2]]}, "must not overlap"),
    ({"groups": [[0, 2]]}, "not a run of consecutive layers"),
    ({"n": 1}, "greater than or equal to 2"),
])
def test_bad_windows_are_usage_errors(method, options, message):
    with pytest.raises(UsageError, match=message):
        compress(tiny_model("llama"), [{"method": method, **options}])


def test_merge_refuses_block_with_other_parts():
    with pytest.raises(UsageError, match="already covers"):
        compress(tiny_model("llama"), [{"method": "merge", "parts": ["block", "ffn"]}])


@pytest.mark.slow
def test_smollm2_merge_drop_and_gqa_save_reload_and_generate(smollm2_dir, tmp_path):
    from wscompress import load

    model, tokenizer = load(str(smollm2_dir), device="cpu")
    rows = compress(model, [{"method": "merge_drop", "n": 2}, {"method": "gqa", "groups": 1}], tokenizer,
                    {"dataset": "pydoc", "num_samples": 4, "seq_len": 128})  # gqa's pca reads the merged model's Grams
    distances = rows[0]["angular_distance"]  # searched: the window that moves the hidden state least
    start = int(min(distances, key=distances.get))
    assert rows[0]["windows"] == [[start, start + 1]] and model.config.num_hidden_layers == 29
    assert rows[1]["init"] == "pca" and 0.5 < rows[1]["value_energy_kept"] < 1
    assert model.config.num_key_value_heads == 1
    assert_roundtrip(model, tokenizer, tmp_path / "m")
