"""Layer-wise calibration: Gram matrices, sharing between modules, saved statistics."""

from __future__ import annotations

import pytest
import torch

from wscompress.errors import UsageError
from wscompress.io import data
from wscompress.model.arch import discover, get_module
from wscompress.pipeline import calibration, layerwise
from wscompress.pipeline.context import Context
from wscompress.pipeline.stats import Stats, fingerprint
from wscompress.recipe.load import load_recipe
from wscompress.workflow import stats_dir, step_calibrate

from conftest import tiny_model


def batches(n: int = 3, seq_len: int = 16, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return list(torch.randint(0, 512, (n * 2, seq_len), generator=gen).split(2))


def all_projections(model) -> list[str]:
    arch = discover(model)
    return [n for i in range(arch.num_layers) for n in arch.projections(i).values()]


@pytest.mark.parametrize("kind", ["llama", "gpt2", "opt"])
def test_grams_equal_direct_computation(kind):
    model = tiny_model(kind)
    names = all_projections(model)
    stats = calibration.collect_grams(model, batches(), names)
    # the reference: inputs of every linear captured during ordinary whole-model forwards
    seen: dict[str, list[torch.Tensor]] = {n: [] for n in names}
    handles = [get_module(model, n).register_forward_hook(lambda m, a, o, n=n: seen[n].append(a[0].detach()))
               for n in names]
    with torch.no_grad():
        for b in batches():
            model(input_ids=b, use_cache=False)
    for h in handles:
        h.remove()
    for name in names:
        x = torch.cat([t.reshape(-1, t.shape[-1]) for t in seen[name]]).double()
        torch.testing.assert_close(stats.of(name), x.T @ x, rtol=1e-4, atol=1e-6)


def test_modules_fed_the_same_input_share_one_gram():
    model = tiny_model("llama")
    names = all_projections(model)
    stats = calibration.collect_grams(model, batches(), names)
    owner, p = stats.owner, discover(model).projections(1)
    assert owner[p["q"]] == owner[p["k"]] == owner[p["v"]] != owner[p["o"]]
    assert owner[p["gate"]] == owner[p["up"]] != owner[p["down"]]
    assert len(stats) == 4 * discover(model).num_layers  # attn in, o in, mlp in, down in


def test_layers_run_one_after_another():
    """Peak memory is one layer's activations: every batch passes layer i before any reaches
    layer i + 1, and capturing the inputs runs no layer at all."""
    model = tiny_model("llama")
    arch = discover(model)
    order: list[int] = []
    for i, layer in enumerate(arch.layers):
        layer.register_forward_pre_hook(lambda m, a, i=i: order.append(i))
    hidden, calls = layerwise.capture_inputs(model, arch, batches())
    assert order == [] and len(hidden) == 3 and [len(c) for c in calls] == [3] * arch.num_layers
    order.clear()
    calibration.collect_grams(model, batches(), all_projections(model))
    assert order == sorted(order) and set(order) == set(range(arch.num_layers))


def test_outside_layers_is_a_usage_error():
    model = tiny_model("llama_mha")
    with pytest.raises(UsageError, match="outside the layers"):
        calibration.collect_grams(model, batches(), ["lm_head"])


def test_statistics_stream_to_one_file_per_layer_and_are_checked(tmp_path, monkeypatch):
    """Each layer's Gram matrices go to their own file as soon as the layer has run, before the
    next layer runs (memory holds one layer's); reading back gives the same matrices; a folder
    made for another model or calibration set is refused, a damaged one reported."""
    model = tiny_model("llama")
    arch = discover(model)
    names = all_projections(model)
    meta = {"model": fingerprint(model), "dataset": "a.txt"}
    events: list[tuple[str, int]] = []
    for i, layer in enumerate(arch.layers):
        layer.register_forward_pre_hook(lambda m, a, i=i: events.append(("run", i)) if events[-1:] != [("run", i)] else None)
    write = calibration.StatsWriter.layer
    monkeypatch.setattr(calibration.StatsWriter, "layer", lambda self, i, *a: (events.append(("write", i)), write(self, i, *a)))
    stats = calibration.collect_grams(model, batches(), names, tmp_path / "stats", meta)
    assert events == [(what, i) for i in range(arch.num_layers) for what in ("run", "write")]
    assert sorted(f.name for f in (tmp_path / "stats").glob("layer-*.safetensors")) == \
        [f"layer-{i:04d}.safetensors" for i in range(arch.num_layers)]
    loaded = Stats(tmp_path / "stats", meta)
    assert loaded.owner == stats.owner and all(torch.equal(loaded[k], stats[k]) for k in stats)
    other = tiny_model("llama", seed=1)
    with pytest.raises(UsageError, match="model="):
        Stats(tmp_path / "stats", {**meta, "model": fingerprint(other)})
    with pytest.raises(UsageError, match="dataset="):
        Stats(tmp_path / "stats", {**meta, "dataset": "b.txt"})
    next((tmp_path / "stats").glob("layer-*.safetensors")).write_bytes(b"garbage")
    with pytest.raises(UsageError, match="unreadable"):
        [loaded[k] for k in loaded]


def test_scratch_statistics_are_deleted_with_their_object():
    import gc

    model = tiny_model("llama")
    stats = calibration.collect_grams(model, batches(), all_projections(model))
    folder = stats.folder
    assert folder.is_dir()
    del stats
    gc.collect()
    assert not folder.exists()


def test_fingerprint_of_a_compressed_model():
    import wscompress

    model = tiny_model("llama")
    before = fingerprint(model)
    wscompress.compress(model, [{"method": "svd", "whitening": False, "ratio": 0.5}])
    assert fingerprint(model) != before


def test_caches_are_keyed_by_every_tensor(tmp_path, tiny_dir, tokenizer, monkeypatch):
    """Two checkpoints that differ only in the last layer's down projection: their fingerprints
    differ, so neither reads the other's cached perplexity (or reuses its statistics)."""
    from wscompress.evaluation import perplexity as ppl
    from wscompress.io.checkpoints import load_model
    from wscompress.recipe.schema import ModelConfig

    monkeypatch.setenv("WSCOMPRESS_CACHE", str(tmp_path / "cache"))
    a = tiny_dir("llama")
    model, tok = load_model(ModelConfig(path=str(a)))
    with torch.no_grad():
        model.model.layers[-1].mlp.down_proj.weight.zero_()
    model.save_pretrained(tmp_path / "b")
    tok.save_pretrained(tmp_path / "b")
    models = [load_model(ModelConfig(path=str(p)))[0] for p in (a, tmp_path / "b")]
    assert fingerprint(models[0]) != fingerprint(models[1])
    assert fingerprint(models[0]) == fingerprint(load_model(ModelConfig(path=str(a)))[0])  # the same weights: the same
    calls = []
    real = ppl.perplexity
    monkeypatch.setattr(ppl, "perplexity", lambda *a, **k: calls.append(1) or real(*a, **k))
    results = [ppl.evaluate_text(m, tok, "pydoc", 32, max_windows=2, cache=True)["ppl"] for m in models]
    assert calls == [1, 1] and results[0] != results[1]


def test_step_calibrate_file_is_reused_and_checked(tmp_path, tiny_dir, monkeypatch):
    recipe = load_recipe(data={"model": {"path": str(tiny_dir("llama"))},
                               "calibration": {"dataset": "pydoc", "num_samples": 4, "seq_len": 32, "batch_size": 2},
                               "output": {"dir": str(tmp_path / "run")}})
    out = step_calibrate(recipe)
    assert (stats_dir(recipe) / "stats.json").is_file() and out["modules"] == 7 * 4
    from wscompress.io.checkpoints import load_model

    model, tok = load_model(recipe.model)
    names = all_projections(model)
    ctx = Context(recipe.calibration, tok, saved=stats_dir(recipe))
    direct = calibration.collect_grams(model, ctx.calibration(), names, dtype=ctx.dtype(model))
    monkeypatch.setattr(calibration, "collect_grams", lambda *a, **k: pytest.fail("statistics were recomputed"))
    stats = Context(recipe.calibration, tok, saved=stats_dir(recipe)).stats(model, names)
    assert stats.owner == direct.owner and all(torch.allclose(stats[k], direct[k]) for k in direct)
    # the same output folder with another calibration set: reported, not silently reused
    other = recipe.model_copy(update={"calibration": recipe.calibration.model_copy(update={"seed": 1})})
    with pytest.raises(UsageError, match="seed="):
        Context(other.calibration, tok, saved=stats_dir(other)).stats(model, names)
    # statistics computed in another dtype than this run's: the same
    dtype = "float32" if ctx.dtype(model) == torch.bfloat16 else "bfloat16"
    other = recipe.model_copy(update={"calibration": recipe.calibration.model_copy(update={"dtype": dtype})})
    with pytest.raises(UsageError, match="dtype="):
        Context(other.calibration, tok, saved=stats_dir(other)).stats(model, names)


@pytest.mark.parametrize("kind", ["llama", "gpt2", "opt", "gemma3"])
def test_a_bfloat16_pass_keeps_the_statistics_and_the_model(kind):
    """calibration.dtype: the modules read bfloat16 inputs, the Gram matrices and sensitivities
    match float32's to bfloat16's precision, and the model keeps its own float32 weights."""
    model = tiny_model(kind)
    names = all_projections(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    seen: set[torch.dtype] = set()
    handle = get_module(model, names[-1]).register_forward_pre_hook(lambda _m, a: seen.add(a[0].dtype))
    low = calibration.collect_grams(model, batches(), names, sensitivity_samples=2, dtype=torch.bfloat16)
    handle.remove()
    full = calibration.collect_grams(model, batches(), names, sensitivity_samples=2)
    assert seen == {torch.bfloat16}
    after = model.state_dict()
    assert all(after[k].dtype == v.dtype and torch.equal(after[k], v) for k, v in before.items())
    for name in full:
        error = (low[name] - full[name]).norm() / full[name].norm()
        assert 0 < error < 3e-2, name  # bfloat16 keeps 8 bits: ~0.4 % a value, compounding over layers
    assert low.sensitivity == pytest.approx(full.sensitivity, rel=0.05)


def test_auto_compute_dtype_is_bfloat16_only_where_native(monkeypatch):
    model = tiny_model("llama")
    for native, want in ((True, torch.bfloat16), (False, torch.float32)):
        monkeypatch.setattr(layerwise, "native_bfloat16", lambda _device, native=native: native)
        assert layerwise.compute_dtype("auto", model) == want
    assert layerwise.compute_dtype("float32", model) == torch.float32
    monkeypatch.setattr(layerwise, "native_bfloat16", lambda _device: True)
    assert layerwise.compute_dtype("auto", model.half()) == torch.float16  # a 16-bit model computes in its own


def test_calibration_batches_are_deterministic(tokenizer):
    a = data.calibration_batches(tokenizer, "pydoc", 4, 32, 2, seed=0)
    b = data.calibration_batches(tokenizer, "pydoc", 4, 32, 2, seed=0)
    assert len(a) == 2 and all(torch.equal(x, y) for x, y in zip(a, b))


def _sliding(kind: str):
    """Tiny models whose layers get different masks or rotary embeddings by layer type."""
    from transformers import AutoModelForCausalLM

    from conftest import tiny_config

    torch.manual_seed(0)
    if kind == "gemma3":  # sliding layers with local RoPE, every 6th layer full attention with global RoPE
        config = tiny_config("gemma3", layers=7)
        config.sliding_window = 4
    elif kind == "qwen2":  # the first 2 layers full, the others sliding
        config = tiny_config("qwen2", layers=4)
        config.update({"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 2})
        config.layer_types = ["full_attention" if i < 2 else "sliding_attention" for i in range(4)]
    else:  # GPT-2 passes its causal mask positionally; eager attention does not infer causality
        config = tiny_config("gpt2")
    config._attn_implementation = "eager"
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize("kind", ["gemma3", "qwen2", "gpt2"])
def test_layer_inputs_equal_the_full_models_hidden_states(kind):
    """Each layer is calibrated with its own arguments (mask, rotary embeddings): the inputs
    that layerwise feeds every layer equal the hidden states of an ordinary forward."""
    model = _sliding(kind)
    if kind != "gpt2":
        assert len(set(model.config.layer_types)) == 2
    with torch.no_grad():
        reference = [torch.cat(t) for t in zip(*(model(input_ids=b, output_hidden_states=True).hidden_states
                                                 for b in batches(seq_len=16)))]
    for i, _layer, inputs in layerwise.layerwise(model, batches(seq_len=16)):
        torch.testing.assert_close(torch.cat(inputs.hidden), reference[i], rtol=1e-5, atol=1e-5, msg=f"layer {i}")
    # started at layer 2 with what enters it, every later layer gets the same inputs (and layer 2 the
    # given ones), its own arguments included
    entering = list(reference[2].split(batches(seq_len=16)[0].shape[0]))
    seen = []
    for i, _layer, inputs in layerwise.layerwise(model, batches(seq_len=16), first=2, hidden=entering):
        seen.append(i)
        torch.testing.assert_close(torch.cat(inputs.hidden), reference[i], rtol=1e-5, atol=1e-5, msg=f"layer {i}")
    assert seen == list(range(2, len(reference) - 1))
    with pytest.raises(ValueError, match="hidden states entering"):
        next(layerwise.layerwise(model, batches(seq_len=16), first=2))
