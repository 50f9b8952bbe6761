"""linalg helpers and the `svd` stage (plain truncated SVD and SVD-LLM)."""

from __future__ import annotations

import pytest
import torch

import wscompress
from wscompress.errors import UsageError
from wscompress.io import data, storage
from wscompress.maths.linalg import low_rank, rank_for_ratio, refit_coefficients, truncation_by_iteration, whitening
from wscompress.model.forms.wscompress_lowrank import LowRankLinear

from conftest import WIKI_TEST, tiny_model

CALIB = {"dataset": "pydoc", "num_samples": 8, "seq_len": 64, "batch_size": 4, "dtype": "float32"}  # exact float32 references
IDS = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(1))


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).logits


def test_rank_for_ratio():
    assert rank_for_ratio(576, 576, 0.2) == 230  # 0.8·576²/1152
    assert rank_for_ratio(576, 1536, 0.4, n=2) == int(0.6 * 2 * 576 * 1536 / (576 + 2 * 1536))
    for bad in (0, 1, -0.1, 1.5):
        with pytest.raises(UsageError, match="outside"):
            rank_for_ratio(64, 64, bad)


def test_whitening_cholesky_and_shift_fallback():
    x = torch.randn(200, 16, dtype=torch.float64)
    s, how = whitening(x.T @ x)
    assert how == "cholesky" and torch.allclose(s @ s.T, x.T @ x)
    singular = x[:5].T @ x[:5]  # 5 tokens, 16 features: rank 5
    s, how = whitening(singular)
    assert how == "shifted" and torch.linalg.matrix_rank(s) == 16
    assert torch.allclose(s @ s.T, singular, atol=1e-4 * singular.diagonal().mean().item())
    s, how = whitening(torch.zeros(8, 8))  # a dead input: still invertible
    assert how == "shifted" and torch.all(s.diagonal() > 0)


def test_whitened_truncation_beats_plain_svd_on_the_data():
    torch.manual_seed(0)
    x = torch.randn(500, 32, dtype=torch.float64) * torch.logspace(0, 2, 32, dtype=torch.float64)  # anisotropic inputs
    w = torch.randn(48, 32, dtype=torch.float64)
    c, b, how = low_rank(w, 8, x.T @ x)
    cp, bp, _ = low_rank(w, 8)
    assert how == "cholesky" and c.shape == (48, 8) and b.shape == (8, 32)
    err = lambda c_, b_: torch.linalg.norm(x @ (w - c_ @ b_).T)  # noqa: E731
    assert err(c, b) < 0.9 * err(cp, bp)
    assert torch.linalg.norm(w - cp @ bp) <= torch.linalg.norm(w - c @ b)  # plain SVD wins on the weights
    full_c, full_b, _ = low_rank(w, 100, x.T @ x)  # rank capped at 32: exact
    assert torch.allclose(full_c @ full_b, w)


@pytest.mark.parametrize("shape", [(12, 40), (40, 12)])
def test_truncation_by_iteration_converges_to_the_whitened_truncation(shape):
    """From a random start the subspace iteration reaches low_rank's output error; its Ritz
    vectors warm-start the next call; a subspace as wide as the output is exact at once."""
    gen = torch.Generator().manual_seed(0)
    f64 = {"dtype": torch.float64}
    x = torch.randn(300, shape[1], generator=gen, **f64) * torch.logspace(0, 1, shape[1], **f64)
    w, gram = torch.randn(*shape, generator=gen, **f64), x.T @ x
    err = lambda c, b: torch.linalg.norm(x @ (w - c @ b).T).item()  # noqa: E731
    best = err(*low_rank(w, 3, gram)[:2])
    start = torch.randn(shape[0], 6, generator=gen, **f64)
    c, b, ritz = truncation_by_iteration(w, 3, gram, start, steps=1)
    assert c.shape == (shape[0], 3) and b.shape == (3, shape[1]) and ritz.shape == (shape[0], 6)
    assert err(c, b) > best * (1 + 1e-6)  # one step from a random start is not there yet
    for _ in range(40):  # warm-started calls, as the alternations of shared_plus_deltas
        c, b, ritz = truncation_by_iteration(w, 3, gram, ritz, steps=2)
    assert err(c, b) == pytest.approx(best, rel=1e-9)
    c, b, _ = truncation_by_iteration(w, 3, gram, torch.randn(shape[0], shape[0], generator=gen, **f64), steps=0)
    assert err(c, b) == pytest.approx(best, rel=1e-12)


def test_refit_minimises_error_for_a_fixed_basis():
    torch.manual_seed(0)
    f64 = {"dtype": torch.float64}
    x, w, basis = torch.randn(300, 24, **f64), torch.randn(20, 24, **f64), torch.randn(6, 24, **f64)
    drifted = x + 0.3 * torch.randn(300, 24, **f64)  # what a compressed model feeds the layer instead of x
    c = refit_coefficients(w, basis, drifted.T @ drifted, x.T @ drifted)
    best = torch.linalg.lstsq(drifted @ basis.T, x @ w.T).solution.T  # least squares on the data itself
    assert torch.allclose(c, best, atol=1e-6)
    same = refit_coefficients(w, basis, x.T @ x)
    assert torch.allclose(same, torch.linalg.lstsq(x @ basis.T, x @ w.T).solution.T, atol=1e-6)


@pytest.mark.parametrize("kind, whitening_", [("llama", True), ("gpt2", True), ("opt", True), ("llama", False)])
def test_full_rank_is_exact(kind, whitening_, tokenizer):
    model = tiny_model(kind)
    ref = logits(model)
    wscompress.compress(model, [{"method": "svd", "rank": 10_000, "whitening": whitening_}], tokenizer, CALIB)
    assert any(isinstance(m, LowRankLinear) for m in model.modules())
    torch.testing.assert_close(logits(model), ref, atol=1e-4, rtol=1e-4)


def test_ratio_sets_parameters_and_whitening_helps(tokenizer):
    # whitening lowers the error on inputs like the calibration text; on random token ids it
    # helped 24 % under Python 3.11 and not at all under 3.12 (other docs, another tokenizer)
    ids = data.tokenize(tokenizer, WIKI_TEST, max_tokens=4 * 64)[: 4 * 64].view(4, 64)
    base = tiny_model("llama_mha")
    errors = {}
    for whiten in (True, False):
        model = tiny_model("llama_mha")
        row = wscompress.compress(model, [{"method": "svd", "ratio": 0.4, "whitening": whiten, "allocation": "uniform"}], tokenizer, CALIB)[0]
        # 4 layers × (4 of 64x64, 2 of 64x128 + 128x64); ranks floor(0.6·d_in·d_out/(d_in+d_out))
        dense = 4 * (4 * 64 * 64 + 3 * 64 * 128)
        low = 4 * (4 * 19 * 128 + 3 * 25 * 192)
        assert row["params_before"] - row["params_after"] == dense - low
        with torch.no_grad():
            errors[whiten] = (model(input_ids=ids).logits - base(input_ids=ids).logits).norm().item()
    assert errors[True] < errors[False]


def test_targets_and_options_validated(tokenizer):
    model = tiny_model("llama")
    wscompress.compress(model, [{"method": "svd", "ratio": 0.3, "whitening": False, "allocation": "uniform",
                                 "targets": ["mlp"], "ignore": ["down"]}])
    kinds = {n.rsplit(".", 1)[-1]: type(m).__name__ for n, m in model.named_modules() if n.startswith("model.layers.0.")}
    assert kinds["gate_proj"] == kinds["up_proj"] == "LowRankLinear"
    assert kinds["down_proj"] == kinds["q_proj"] == "Linear"
    for bad, match in [({"ratio": 1.0}, "ratio"), ({"ratio": 0}, "ratio"), ({"ratio": 0.2, "rank": 4}, "either ratio or rank"),
                       ({"targets": ["nothing_here"]}, "matches no module")]:
        with pytest.raises(UsageError, match=match):
            wscompress.compress(tiny_model("llama"), [{"method": "svd", "whitening": False, "allocation": "uniform", **bad}])


def test_gpt2_save_load_and_dense_export(tmp_path, tokenizer):
    from transformers import AutoModelForCausalLM

    model = tiny_model("gpt2")
    wscompress.compress(model, [{"method": "svd", "ratio": 0.3}], tokenizer, CALIB)
    out = logits(model)
    saved = storage.save(model, tokenizer, tmp_path / "m")
    loaded, _ = storage.load(tmp_path / "m")
    assert isinstance(loaded.transformer.h[0].attn.c_attn, LowRankLinear)
    torch.testing.assert_close(logits(loaded), out)
    assert abs(saved["file_bytes"] - 4 * saved["params"]) < 0.02 * saved["file_bytes"]
    storage.export_dense(loaded, tokenizer, tmp_path / "dense")
    stock = AutoModelForCausalLM.from_pretrained(tmp_path / "dense").eval()  # Conv1D weights back in (in, out)
    torch.testing.assert_close(logits(stock), out, atol=1e-4, rtol=1e-4)


def test_svd_after_cross_layer_keeps_the_layers_shared(tmp_path, tokenizer):
    """A module cross_layer shared between layers is factorised once, on the statistics of all
    its uses, and stays one module: the parameter count drops as for a single layer."""
    model = tiny_model("llama")
    stages = [{"method": "cross_layer", "what": "ffn", "group_size": 2, "init": "mean", "refit": False},
              {"method": "svd", "ratio": 0.5}]
    wscompress.compress(model, stages, tokenizer, CALIB)
    layers = model.model.layers
    assert isinstance(layers[0].mlp.up_proj, LowRankLinear) and layers[0].mlp.up_proj is layers[1].mlp.up_proj
    assert layers[0].mlp.up_proj is not layers[2].mlp.up_proj
    before = logits(model)
    saved = storage.save(model, tokenizer, tmp_path / "m")
    assert saved["params"] == storage.stats(model)["params"]
    loaded, _ = wscompress.load(tmp_path / "m", device="cpu")
    assert loaded.model.layers[0].mlp.up_proj is loaded.model.layers[1].mlp.up_proj
    torch.testing.assert_close(logits(loaded), before)


def test_shared_module_is_whitened_on_all_its_uses(tokenizer):
    """After cross_layer, the shared up_proj of layers 0 and 1 is whitened on the Gram matrix
    of both layers' inputs to it, not only the first layer's."""
    from wscompress.io import data

    model = tiny_model("llama")
    wscompress.compress(model, [{"method": "cross_layer", "what": "ffn", "group_size": 2, "init": "mean", "refit": False}],
                        tokenizer, CALIB)
    shared = model.model.layers[0].mlp.up_proj
    inputs = []
    hook = shared.register_forward_hook(lambda _m, a, _o: inputs.append(a[0].reshape(-1, a[0].shape[-1]).double()))
    with torch.no_grad():
        for batch in data.calibration_batches(tokenizer, "pydoc", 8, 64, 4, seed=0):
            model(input_ids=batch)
    hook.remove()
    assert len(inputs) == 2 * 2  # two batches, two layers each
    x = torch.cat(inputs)
    w = shared.weight.detach().clone()
    wscompress.compress(model, [{"method": "svd", "ratio": 0.5, "refit": False, "targets": ["layers\\.[01]\\.mlp\\.up"]}],
                        tokenizer, CALIB)
    lowrank = model.model.layers[1].mlp.up_proj
    coeff, basis, _ = low_rank(w, lowrank.rank, x.T @ x)
    torch.testing.assert_close(lowrank.dense_weight().double(), coeff @ basis, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("method", ["basis_sharing", "soft_share"])
def test_per_layer_methods_refuse_modules_shared_by_an_earlier_stage(method, tokenizer):
    model = tiny_model("llama")
    stages = [{"method": "cross_layer", "what": "ffn", "group_size": 2, "init": "mean", "refit": False}, {"method": method}]
    with pytest.raises(UsageError, match="same module as model.layers.0.mlp"):
        wscompress.compress(model, stages, tokenizer, CALIB)


def test_refit_ridge_pulls_toward_the_prior():
    torch.manual_seed(0)
    f64 = {"dtype": torch.float64}
    x, w, basis = torch.randn(300, 24, **f64), torch.randn(20, 24, **f64), torch.randn(6, 24, **f64)
    prior = torch.randn(20, 6, **f64)
    free = refit_coefficients(w, basis, x.T @ x)
    assert torch.allclose(refit_coefficients(w, basis, x.T @ x, ridge=1e-12, prior=prior), free, atol=1e-6)
    assert torch.allclose(refit_coefficients(w, basis, x.T @ x, ridge=1e9, prior=prior), prior, atol=1e-6)
    mid = refit_coefficients(w, basis, x.T @ x, ridge=1.0, prior=prior)
    assert (mid - prior).norm() < (free - prior).norm()


@pytest.mark.parametrize("width", [24, 1100])
def test_gram_by_symmetric_update_equals_the_full_product(width):
    from wscompress.maths.linalg import gram

    x = torch.randn(300, width, dtype=torch.float32)
    ref = x.double().T @ x.double()
    g = gram(x)
    assert g.dtype == torch.float64 and torch.equal(g, g.T)
    torch.testing.assert_close(g, ref, rtol=1e-12, atol=1e-9)
    torch.testing.assert_close(gram(x[:, ::2]), x[:, ::2].double().T @ x[:, ::2].double())  # a strided view


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sixteen_bit_batches_are_summed_to_float64_precision(dtype):
    """A 16-bit batch's products are formed in float32 (they are exact there), then summed in
    float64: the Gram matrix and cross products of the 16-bit values within ~1e-6 of float64's."""
    from wscompress.maths.linalg import add_gram, add_product, product_dtype, symmetrize

    gen = torch.Generator().manual_seed(0)
    x, y = (3 * torch.randn(2, 4096, 96, generator=gen)).to(dtype), torch.randn(2, 4096, 40, generator=gen).to(dtype)
    assert product_dtype(x) == torch.float32 and product_dtype(x.float()) == torch.float64
    g, c = None, None
    for b in range(2):  # two batches into one float64 sum
        g, c = add_gram(g, x[b]), add_product(c, x[b], y[b])
    xd, yd = x.double().flatten(0, 1), y.double().flatten(0, 1)
    assert g.dtype == c.dtype == torch.float64
    torch.testing.assert_close(symmetrize(g), xd.T @ xd, rtol=1e-6, atol=1e-6 * (xd.T @ xd).abs().max().item())
    torch.testing.assert_close(c, xd.T @ yd, rtol=1e-6, atol=1e-6 * (xd.T @ yd).abs().max().item())


def test_factors_are_balanced():
    """Each rank component's coefficient column and basis row have equal norms (a fine-tuning
    step then moves both alike; whitened bases are otherwise orders of magnitude smaller)."""
    gen = torch.Generator().manual_seed(4)
    x, w = 30 * torch.randn(200, 24, generator=gen), torch.randn(16, 24, generator=gen)
    for gram in (None, x.T.double() @ x.double()):
        coeff, basis, _ = low_rank(w, 8, gram)
        torch.testing.assert_close(coeff.norm(dim=0), basis.norm(dim=1))


@pytest.mark.parametrize("through_outputs", [False, True])
def test_refit_normal_equations_agree_by_either_route(through_outputs):
    """The refit's normal equations summed through the input's Gram matrices or through each
    module's outputs (the cheaper route for a wide input) give the least-squares coefficients."""
    from wscompress.pipeline.refit import _Normals

    torch.manual_seed(0)
    x, w, module = torch.randn(300, 40), torch.randn(12, 40), LowRankLinear(40, 12, 5)
    x_ref = x + 0.3 * torch.randn(300, 40)  # what the original layer feeds the module
    normals = _Normals({"m": module}, {"m": w}, same=False, dtype=torch.float32, ridge=0.0)
    assert normals.through_outputs  # 40·(5 + 12) + 5·(12 + 2.5) < 1.5·40²: the outputs are cheaper here
    normals.through_outputs = through_outputs
    for rows in (slice(0, 100), slice(100, 300)):  # two batches
        normals.add(x[rows], x_ref[rows])
    before = module.coeff.weight.detach().clone()
    with torch.no_grad():  # as in the pass
        replaced, changes = normals.finish()
    basis = module.basis.weight.detach()
    best = torch.linalg.lstsq((x @ basis.T).double(), (x_ref @ w.T).double()).solution.T
    assert not replaced  # the module stays; its coefficients change in place
    torch.testing.assert_close(module.coeff.weight.double(), best, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(changes["m"], module.coeff.weight - before)


def test_bfloat16_refit_solves_with_the_model_s_own_weights():
    """In a bfloat16 pass the activations are bfloat16, but the Gram route's solve uses the
    weight and basis as the model holds them (float32), not their bfloat16 roundings."""
    from wscompress.pipeline.refit import _Normals

    torch.manual_seed(0)
    x, w, module = torch.randn(400, 64).bfloat16(), torch.randn(48, 64), LowRankLinear(64, 48, 40)
    normals = _Normals({"m": module}, {"m": w}, same=True, dtype=torch.bfloat16, ridge=0.0)
    assert not normals.through_outputs
    normals.add(x, None)
    prior = module.coeff.weight.detach().clone()
    with torch.no_grad():
        normals.finish()
    xd = x.double()
    want = refit_coefficients(w, module.basis.weight, xd.T @ xd, prior=prior)  # the solve's tiny floor pulls toward it
    torch.testing.assert_close(module.coeff.weight.double(), want.float().double(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [(16, 24), (40, 24)])
def test_a_positive_factor_on_the_gram_leaves_the_factors_unchanged(shape):
    """Basis Sharing weighs a group's Grams against each other; a one-layer part skips the
    weighting because the whitened truncation (both routes, wide and tall) does not see it."""
    gen = torch.Generator().manual_seed(7)
    x, w = torch.randn(300, shape[1], generator=gen) * torch.linspace(0.1, 5, shape[1]), torch.randn(*shape, generator=gen)
    g = x.double().T @ x.double()
    for a, b in zip(low_rank(w, 8, g)[:2], low_rank(w, 8, 1e-3 * g)[:2]):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9 * a.abs().max().item())
