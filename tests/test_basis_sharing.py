"""The `basis_sharing` stage: exactness, shared bases, rank budget, storage, bad input."""

from __future__ import annotations

import contextlib
import copy
import json

import pytest
import torch
from safetensors import safe_open

import wscompress
from wscompress.errors import UsageError
from wscompress.io import data, storage
from wscompress.methods.basis_sharing import relative
from wscompress.model.arch import discover
from wscompress.model.forms.wscompress_lowrank import LowRankLinear, SharedBasisLinear

from conftest import (
    WIKI_TEST,
    WIKI_TRAIN,
    final_inputs,
    first_layers,
    hidden_state_error,
    layer_reference_inputs,
    real_texts,
    tiny_model,
)

CALIB = {"dataset": "pydoc", "num_samples": 8, "seq_len": 64, "batch_size": 4, "dtype": "float32"}  # exact float32 references
IDS = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(1))


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).logits


def compress(model, tokenizer, calibration: dict = CALIB, **options) -> dict:
    """One basis_sharing stage; uniform allocation unless asked (its ranks follow the paper's formula)."""
    stage = {"method": "basis_sharing", "allocation": "uniform", "refit": False, **options}
    return wscompress.compress(model, [stage], tokenizer, calibration)[0]


def layer(model, i):
    return discover(model).layers[i]


@pytest.mark.parametrize("kind", ["llama", "gpt2", "opt"])
def test_full_rank_group_of_one_is_exact(kind, tokenizer):
    model = tiny_model(kind)
    ref = logits(model)
    compress(model, tokenizer, group_size=1, rank=10_000)
    assert any(isinstance(m, SharedBasisLinear) for m in model.modules())
    torch.testing.assert_close(logits(model), ref, atol=1e-4, rtol=1e-4)


def test_llama_gqa_defaults_share_q_gate_up(tokenizer):
    model = tiny_model("llama")  # 4 query / 2 kv heads
    row = compress(model, tokenizer, group_size=2, ratio=0.2)
    assert row["shared"] == ["q", "gate", "up"] and row["private"] == ["k", "v", "o", "down"]
    a, b, c = layer(model, 0), layer(model, 1), layer(model, 2)
    assert a.self_attn.q_proj.basis is b.self_attn.q_proj.basis is not c.self_attn.q_proj.basis
    assert a.mlp.up_proj.basis is b.mlp.up_proj.basis and a.mlp.gate_proj.basis is b.mlp.gate_proj.basis
    assert type(a.self_attn.k_proj) is LowRankLinear and a.self_attn.k_proj.basis is not b.self_attn.k_proj.basis
    # k = floor((1 - r)·n·d_in·d_out / (d_in + n·d_out)) per group, n = 1 for private layers
    assert a.self_attn.q_proj.rank == int(0.8 * 2 * 64 * 64 / (64 + 2 * 64))
    assert a.mlp.up_proj.rank == int(0.8 * 2 * 64 * 128 / (64 + 2 * 128))
    assert a.mlp.down_proj.rank == int(0.8 * 128 * 64 / (128 + 64))


def test_mha_shares_k_v_and_roles_are_configurable(tokenizer):
    model = tiny_model("llama_mha")
    row = compress(model, tokenizer, group_size=2, ratio=0.3)
    assert row["shared"] == ["q", "k", "v", "gate", "up"]
    assert layer(model, 0).self_attn.v_proj.basis is layer(model, 1).self_attn.v_proj.basis
    model = tiny_model("llama_mha")
    row = compress(model, tokenizer, group_size=2, ratio=0.3, shared=["down"], private=[])
    assert row["shared"] == ["down"] and row["private"] == []
    assert type(layer(model, 0).mlp.up_proj).__name__ == "Linear"
    assert layer(model, 0).mlp.down_proj.basis is layer(model, 1).mlp.down_proj.basis


def test_remainder_group_gets_its_own_budget(tokenizer):
    model = tiny_model("llama", layers=5)
    row = compress(model, tokenizer, group_size=2, ratio=0.4)
    assert row["groups"] == 3 and "last 1 layers" in row["remainder"]
    last = layer(model, 4).self_attn.q_proj
    assert last.basis is not layer(model, 3).self_attn.q_proj.basis
    assert last.rank == int(0.6 * 64 * 64 / (64 + 64))
    assert compress(tiny_model("llama"), tokenizer, group_size=2, ratio=0.4)["remainder"] is None


def test_sharing_removes_the_promised_parameters(tokenizer):
    model = tiny_model("llama_mha")
    row = compress(model, tokenizer, group_size=4, ratio=0.5, shared=["q", "k", "v", "o", "gate", "up", "down"], private=[])
    square, wide = int(0.5 * 4 * 64 * 64 / (64 + 4 * 64)), int(0.5 * 4 * 64 * 128 / (64 + 4 * 128))
    tall = int(0.5 * 4 * 128 * 64 / (128 + 4 * 64))
    kept = 4 * square * (64 + 4 * 64) + 2 * wide * (64 + 4 * 128) + tall * (128 + 4 * 64)
    assert row["params_before"] - row["params_after"] == 4 * (4 * 64 * 64 + 3 * 64 * 128) - kept


def test_save_reload_stores_each_basis_once(tmp_path, tokenizer):
    model = tiny_model("llama")
    compress(model, tokenizer, group_size=2, ratio=0.3)
    out = logits(model)
    saved = storage.save(model, tokenizer, tmp_path / "m")
    with safe_open(str(tmp_path / "m" / storage.WEIGHTS), "pt") as f:
        keys = list(f.keys())
    assert sum(k.endswith("q_proj.basis.weight") for k in keys) == 2  # 4 layers, 2 groups
    assert sum(k.endswith("k_proj.basis.weight") for k in keys) == 4  # private: one a layer
    assert saved["params"] == storage.stats(model)["params"]
    assert abs(saved["file_bytes"] - 4 * saved["params"]) < 0.02 * saved["file_bytes"]
    manifest = json.loads((tmp_path / "m" / "config.json").read_text())["compression"]
    assert manifest["module_aliases"]["model.layers.1.self_attn.q_proj.basis"] == "model.layers.0.self_attn.q_proj.basis"

    loaded, _ = wscompress.load(tmp_path / "m", device="cpu")
    assert layer(loaded, 0).self_attn.q_proj.basis is layer(loaded, 1).self_attn.q_proj.basis
    assert isinstance(layer(loaded, 3).mlp.gate_proj, SharedBasisLinear)
    torch.testing.assert_close(logits(loaded), out)
    assert storage.stats(loaded)["params"] == saved["params"]


def test_dense_export_loads_in_stock_transformers(tmp_path, tokenizer):
    from transformers import AutoModelForCausalLM

    model = tiny_model("opt")
    compress(model, tokenizer, group_size=2, ratio=0.3)
    storage.export_dense(model, tokenizer, tmp_path / "dense")
    stock = AutoModelForCausalLM.from_pretrained(tmp_path / "dense").eval()
    torch.testing.assert_close(logits(stock), logits(model), atol=1e-4, rtol=1e-4)


def test_each_layer_gets_least_squares_coefficients_for_its_own_inputs(tokenizer):
    """The basis serves the group; every layer's coefficients then minimise that layer's own
    output error ‖(W - C·B)·Xᵀ‖: the gradient (C·B - W)·XᵀX·Bᵀ vanishes, and the error is
    below the one of the coefficients read off the group's SVD."""
    from wscompress.maths.linalg import low_rank
    from wscompress.pipeline.calibration import collect_grams

    model = tiny_model("llama")
    batches = data.calibration_batches(tokenizer, CALIB["dataset"], 8, 64, 4, seed=0)
    names = [f"model.layers.{i}.mlp.up_proj" for i in (0, 1)]
    stats = collect_grams(model, batches, names)
    ws = [model.get_submodule(n).weight.detach().double() for n in names]
    gs = [stats.of(n) for n in names]
    compress(model, tokenizer, group_size=2, ratio=0.5)
    group_coeff, _, _ = low_rank(torch.cat(ws), layer(model, 0).mlp.up_proj.rank, sum(map(relative, ws, gs)))
    for i, (w, g, svd_coeff) in enumerate(zip(ws, gs, group_coeff.split(ws[0].shape[0]))):
        up = layer(model, i).mlp.up_proj
        b, c = up.basis.weight.double(), up.coeff.weight.double()
        grad = (c @ b - w) @ g @ b.T
        assert grad.abs().max() < 1e-4 * (w @ g @ b.T).abs().max()
        error = lambda coeff: torch.trace((w - coeff @ b) @ g @ (w - coeff @ b).T)  # noqa: E731
        assert error(c) < error(svd_coeff)


def test_group_basis_does_not_favour_layers_with_larger_activations():
    """Each layer's statistics are scaled by its output energy before they are summed: a layer
    whose inputs are 100x larger (deeper layers' are) gets no more say in the shared basis."""
    from wscompress.maths.linalg import low_rank, refit_coefficients

    gen = torch.Generator().manual_seed(0)
    ws = [torch.randn(12, 16, generator=gen, dtype=torch.float64) for _ in range(2)]
    xs = [torch.randn(200, 16, generator=gen, dtype=torch.float64) for _ in range(2)]
    grams = [x.T @ x for x in xs]
    basis = low_rank(torch.cat(ws), 6, sum(map(relative, ws, grams)))[1]
    scaled = low_rank(torch.cat(ws), 6, sum(map(relative, ws, [grams[0], 1e4 * grams[1]])))[1]
    torch.testing.assert_close(scaled, basis)
    raw = low_rank(torch.cat(ws), 6, grams[0] + 1e4 * grams[1])[1]  # the plain sum: layer 1 takes over

    def layer0_error(b):
        d = ws[0] - refit_coefficients(ws[0], b, grams[0]) @ b
        return torch.trace(d @ grams[0] @ d.T)
    assert layer0_error(raw) > 1.1 * layer0_error(basis)


@pytest.mark.parametrize("target,ridge,samples", [("function", 0.0, None), ("function", 0.1, None), ("layer", 0.0, None),
                                                   ("model", 0.0, None), ("layer", 0.0, 4)])
def test_refit_is_the_least_squares_update_on_the_inputs_each_module_finally_receives(tokenizer, target, ridge, samples):
    """Refit goes module by module in forward order: every coefficient matrix is the (ridge)
    least-squares fit, on exactly the inputs X' the finished compressed model feeds it (o after
    q/k/v were refit, down after gate/up), of the target X·W: the original module on X' itself
    (function), on what it reads in the original layer fed the same layer input (layer) or in
    the original model (model), pulled toward the coefficients it had before. Bases are
    untouched, and no module misses its target by more than before the refit. With
    ``refit_samples`` the fit is on the first sequences only."""
    from wscompress.maths.linalg import refit_coefficients

    batches = data.first_samples(data.calibration_batches(tokenizer, CALIB["dataset"], 8, 64, 4, seed=0), samples)
    base, plain, model = tiny_model("llama_mha"), tiny_model("llama_mha"), tiny_model("llama_mha")
    compress(plain, tokenizer, group_size=2, ratio=0.5)
    compress(model, tokenizer, group_size=2, ratio=0.5, refit=True, ridge=ridge, refit_target=target, refit_samples=samples)
    names = [n for n, m in model.named_modules() if isinstance(m, LowRankLinear)]
    xs = final_inputs(model, names, batches)
    refs = {"function": xs, "model": final_inputs(base, names, batches),
            "layer": layer_reference_inputs(model, base, names, batches) if target == "layer" else None}[target]
    if target != "function":
        assert any(not torch.allclose(refs[n], xs[n]) for n in names)  # the targets differ from the official update's
    for n in names:
        module, before = model.get_submodule(n), plain.get_submodule(n)
        torch.testing.assert_close(module.basis.weight, before.basis.weight)
        w, x, ref = base.get_submodule(n).weight.double(), xs[n], refs[n]
        want = refit_coefficients(w, module.basis.weight, x.T @ x, ref.T @ x, ridge=ridge, prior=before.coeff.weight)
        torch.testing.assert_close(module.coeff.weight.double(), want, rtol=1e-3, atol=1e-4, msg=n)
        error = lambda m: (x @ (m.coeff.weight.double() @ m.basis.weight.double()).T - ref @ w.T).norm()  # noqa: E731
        assert error(module) <= error(before) * (1 + 1e-6), n


@pytest.mark.parametrize("kind,target", [("llama", "layer"), ("llama", "model"), ("llama", "function"), ("gpt2", "layer"),
                                         ("opt", "layer"), ("qwen2", "layer"), ("gemma3", "layer"),
                                         ("llama-mlp-scaled", "layer")])
def test_refit_replays_finished_blocks_without_changing_the_result(tokenizer, monkeypatch, kind, target):
    """The refit replays a block whose modules are all refit (the attention block, the MLP)
    instead of recomputing it: the blocks run fewer times and every coefficient is the same as
    when each stage recomputes the layer, up to float32 rounding (a block that a module ends is
    replayed as its recorded output plus the coefficient change's share). An MLP that does more
    after its down projection (``-mlp-scaled``) is not one down ends: it is recomputed."""
    from transformers.models.llama.modeling_llama import LlamaMLP

    from wscompress.pipeline.replay import Replays

    scaled = LlamaMLP.forward

    def run(replay: bool) -> tuple[torch.nn.Module, int, int]:
        if not replay:
            monkeypatch.setattr(Replays, "__call__", lambda *_a, **_k: contextlib.nullcontext())
        if kind.endswith("-mlp-scaled"):
            monkeypatch.setattr(LlamaMLP, "forward", lambda self, x: scaled(self, x) * 1.0)
        model, calls = tiny_model(kind.split("-")[0]), {"attn": 0, "mlp": 0}
        for n, block in model.named_modules():
            kind_of = "attn" if n.endswith(("self_attn", ".attn")) else "mlp" if n.endswith(".mlp") else None
            if kind_of:
                block.register_forward_hook(lambda *_, k=kind_of: calls.__setitem__(k, calls[k] + 1))
        compress(model, tokenizer, group_size=2, ratio=0.5, refit=True, refit_target=target)
        monkeypatch.undo()
        return model, calls

    (replayed, fewer), (recomputed, more) = run(True), run(False)
    assert fewer["attn"] < more["attn"]
    if kind.endswith("-mlp-scaled"):
        assert fewer["mlp"] == more["mlp"]
    else:
        assert fewer["mlp"] < more["mlp"] or more["mlp"] == 0  # OPT has no MLP block
    for (n, a), b in zip(replayed.state_dict().items(), recomputed.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=n)


def test_a_bfloat16_refit_streams_bfloat16_and_writes_float32_coefficients(tokenizer):
    """calibration.dtype bfloat16: every layer reads bfloat16 in the Gram pass and while the
    refit streams it; the model keeps float32 tensors and its output is as close to the
    original's as the float32 run's."""
    low, full, original = tiny_model("llama"), tiny_model("llama"), tiny_model("llama")
    seen: set[torch.dtype] = set()
    for layer in discover(low).layers:
        layer.register_forward_pre_hook(lambda _m, args: seen.add(args[0].dtype))
    compress(low, tokenizer, group_size=2, ratio=0.5, refit=True, calibration={**CALIB, "dtype": "bfloat16"})
    compress(full, tokenizer, group_size=2, ratio=0.5, refit=True)
    assert seen == {torch.bfloat16}
    assert all(t.dtype == torch.float32 for t in low.state_dict().values())
    ids = data.calibration_batches(tokenizer, CALIB["dataset"], 8, 64, 8, seed=0)[0]
    with torch.no_grad():
        error = lambda m: (m(input_ids=ids).logits - original(input_ids=ids).logits).norm().item()  # noqa: E731
        assert error(low) <= 1.05 * error(full)


@pytest.mark.slow
def test_refit_brings_real_layers_closer_to_the_original(smollm2):
    """On real weights and shapes (SmolLM2's first 3 layers, 40 %, one ratio for every matrix so
    the three differ in the refit only), fitting each module to the
    original layer's output (the default refit) brings the last hidden states closer to the
    original's than the official update or no refit, on the calibration text it was fitted on
    and on held-out text."""
    model, tok = smollm2
    original, texts = first_layers(model, 3), real_texts(tok)
    errors = {}
    for refit in ({"refit": False}, {"refit_target": "function"}, {"refit_target": "layer"}):
        short = copy.deepcopy(original)
        wscompress.compress(short, [{"method": "basis_sharing", "ratio": 0.4, "group_size": 2, "allocation": "uniform", **refit}], tok,
                            {"dataset": WIKI_TRAIN, "num_samples": 8, "seq_len": 256, "seed": 0})
        errors[next(iter(refit.values()))] = [hidden_state_error(short, original, t) for t in texts]
    for text in (0, 1):  # measured: layer 0.237 / 0.424, function 0.266 / 0.437, none 0.266 / 0.438
        assert errors["layer"][text] < min(errors["function"][text], errors[False][text])


def test_singular_gram_falls_back_to_a_shift(tokenizer):
    model = tiny_model("llama")
    row = wscompress.compress(model, [{"method": "basis_sharing", "ratio": 0.2, "allocation": "uniform", "refit": False}], tokenizer,
                              {"dataset": "pydoc", "num_samples": 1, "seq_len": 16, "batch_size": 1})[0]
    # 16 tokens cannot span 64 input features: the stacked (tall) groups' whitening needs the shift
    # (a wide matrix is factorised by its output-side projection, which needs no whitening)
    assert row["gram_shifted"]
    assert torch.isfinite(logits(model)).all()


@pytest.mark.parametrize("options, match", [
    ({"group_size": 5}, "exceeds the model's 4 layers"),
    ({"ratio": 1.0}, "ratio"),
    ({"ratio": 0.0}, "ratio"),
    ({"group_size": 0}, "group_size"),
    ({"shared": ["q"], "private": ["q"]}, "both shared and private"),
    ({"shared": ["qkv"]}, "no 'qkv' projection"),
    ({"shared": ["query"]}, "shared"),
])
def test_bad_input(options, match, tokenizer):
    model = tiny_model("llama")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(UsageError, match=match):
        compress(model, tokenizer, **options)
    after = model.state_dict()  # no partial output: the model is untouched
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.slow
def test_smollm2_basis_sharing_end_to_end(smollm2, tmp_path):
    """The real model: GQA defaults (k and v not shared), a sane perplexity, and a checkpoint
    that reloads exactly at the size reported (quality at proper calibration size: scripts/experiments/bench_basis_sharing.py)."""
    from wscompress.evaluation.perplexity import perplexity

    model, tok = smollm2
    model = copy.deepcopy(model)
    ids = data.tokenize(tok, WIKI_TEST, max_tokens=2 * 512)
    base = perplexity(model, ids, 512, max_windows=2)["ppl"]
    # the attention of every layer (the MLPs' wider SVDs would triple the time and test nothing more)
    row = wscompress.compress(model, [{"method": "basis_sharing", "ratio": 0.2, "group_size": 2, "allocation": "uniform",
                                       "refit": False, "targets": ["self_attn"]}], tok,
                              {"dataset": WIKI_TRAIN, "num_samples": 8, "seq_len": 256})[0]
    assert row["shared"] == ["q", "gate", "up"] and row["groups"] == 15  # GQA 9/3: k and v stay private; 30 layers
    ppl = perplexity(model, ids, 512, max_windows=2)["ppl"]
    assert base < ppl < 20 * base  # 2k calibration tokens only; plain SVD at 20 % is above 1e6
    saved = storage.save(model, tok, tmp_path / "m")
    assert abs(saved["file_bytes"] - 4 * saved["params"]) < 0.001 * saved["file_bytes"]
    loaded, _ = wscompress.load(tmp_path / "m", device="cpu")
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids[None, :64]).logits, model(input_ids=ids[None, :64]).logits)


def test_compress_step_checks_statistics_and_saves_what_it_reports(tmp_path, tiny_dir):
    from wscompress.recipe.load import load_recipe
    from wscompress.workflow import model_path, step_calibrate, step_compress

    def recipe(kind: str):
        return load_recipe(data={"model": {"path": str(tiny_dir(kind))}, "calibration": CALIB,
                                 "compress": [{"method": "basis_sharing", "ratio": 0.3, "group_size": 3}],
                                 "output": {"dir": str(tmp_path / "run")}})

    step_calibrate(recipe("llama"))
    with pytest.raises(UsageError, match="model="):  # statistics of another model: refused, nothing written
        step_compress(recipe("llama_mha"))
    assert not model_path(recipe("llama")).exists()
    out = step_compress(recipe("llama"))
    assert "last 1 layers" in out["stages"][0]["remainder"]
    assert abs(out["compressed"]["file_bytes"] - 4 * out["compressed"]["params"]) < 0.02 * out["compressed"]["file_bytes"]
    assert out["compressed"]["params"] < 0.85 * out["original"]["params"]
