"""Rank allocation (allocation.py), output sensitivities and the `fisher` option of svd / basis_sharing."""

from __future__ import annotations

import pytest
import torch

import wscompress
from wscompress.errors import UsageError
from wscompress.maths.allocation import Unit, allocate, spectrum
from wscompress.model.arch import discover, get_module
from wscompress.model.forms.wscompress_lowrank import LowRankLinear
from wscompress.pipeline import calibration, layerwise

from conftest import tiny_model

CALIB = {"dataset": "pydoc", "num_samples": 8, "seq_len": 64, "batch_size": 4}


def spent(units: list[Unit], ranks: dict) -> int:
    return sum(u.dense if ranks[u.name] is None else ranks[u.name] * u.cost for u in units)


def test_allocation_meets_the_budget_and_follows_the_loss():
    decay = torch.exp(-torch.arange(64.0) / 8)  # spectra fall like real ones
    units = [Unit(f"m{i}", scale * decay, cost, 64 * 48)
             for i, (scale, cost) in enumerate([(1, 112), (10, 112), (100, 112), (1e8, 112), (3, 100)])]
    for ratio in (0.2, 0.5, 0.8):
        ranks = allocate(units, ratio)
        budget = (1 - ratio) * sum(u.dense for u in units)
        assert budget - 112 < spent(units, ranks) <= budget  # the exact fraction, up to one rank's cost
    ranks = allocate(units, 0.5)
    assert ranks["m3"] is None  # its loss dwarfs the rest: kept dense (break-even rank reached)
    assert ranks["m0"] < ranks["m1"] and ranks["m2"] is None  # more rank where truncation costs more
    with pytest.raises(UsageError, match="ratio"):
        allocate(units, 0.99)


def test_spectrum_is_the_whitened_truncation_loss():
    """Dropping the last ranks of the whitened SVD costs exactly the sum of their spectrum in
    output error ‖(W - CB)Xᵀ‖²."""
    from wscompress.maths.linalg import low_rank

    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(200, 24, generator=gen).double(), torch.randn(16, 24, generator=gen).double()
    s = spectrum(w, x.T @ x)
    coeff, basis, _ = low_rank(w, 10, x.T @ x)
    err = ((w - coeff @ basis) @ x.T).pow(2).sum()
    assert err.item() == pytest.approx(s[10:].sum().item(), rel=1e-6)


def test_output_sensitivity_is_the_mean_squared_output_gradient():
    model = tiny_model("llama")
    names = ["model.layers.0.mlp.down_proj", "model.layers.3.self_attn.q_proj"]
    batches = list(torch.randint(0, 512, (4, 16), generator=torch.Generator().manual_seed(2)).split(2))
    got = calibration.output_sensitivity(model, names, batches, samples=3)
    assert all(p.requires_grad and p.grad is None for p in model.parameters())  # weights untouched
    expected = {}
    for name in names:  # by hand: each sequence's loss, the gradient at the module's output
        total = 0.0
        for ids in torch.cat(batches)[:3].split(1):
            seen = []
            handle = get_module(model, name).register_forward_hook(lambda _m, _a, out: seen.append(out))
            loss = torch.nn.functional.cross_entropy(model(input_ids=ids).logits[0, :-1], ids[0, 1:])
            handle.remove()
            (g,) = torch.autograd.grad(loss, seen[0])
            total += g.double().pow(2).sum().item() / g.shape[-1]
        expected[name] = total / (3 * 16)
    assert got == pytest.approx(expected, rel=1e-4)


def test_output_fisher_is_each_tokens_squared_gradient_on_each_block_of_rows():
    """Per token and block of output channels, the squared gradient summed over the block: by
    hand, each sequence's loss differentiated at the module's output, in batch order."""
    model = tiny_model("llama")
    blocks = {"model.layers.0.mlp.up_proj": 4, "model.layers.2.self_attn.o_proj": 1}
    batches = list(torch.randint(0, 512, (4, 16), generator=torch.Generator().manual_seed(2)).split(2))
    got = calibration.output_fisher(model, blocks, batches)
    assert all(p.requires_grad and p.grad is None for p in model.parameters())  # weights untouched
    for name, count in blocks.items():
        rows = []
        for ids in torch.cat(batches).split(1):
            seen = []
            handle = get_module(model, name).register_forward_hook(lambda _m, _a, out: seen.append(out))
            loss = torch.nn.functional.cross_entropy(model(input_ids=ids).logits[0, :-1], ids[0, 1:])
            handle.remove()
            (g,) = torch.autograd.grad(loss, seen[0])
            rows.append(g[0].pow(2).reshape(16, count, -1).sum(-1))
        assert got[name].shape == (64, count)
        torch.testing.assert_close(got[name], torch.cat(rows), rtol=1e-4, atol=1e-12)


@pytest.mark.parametrize("samples", [3, 4, 6])
def test_sensitivities_with_the_gram_pass_equal_a_pass_of_their_own(samples, monkeypatch):
    """The calibration pass hands its first batch's forward to the sensitivity pass (the first
    chunk is that batch): the same sensitivities as a pass that runs its own forward."""
    model = tiny_model("llama")
    arch = discover(model)
    names = [n for i in range(arch.num_layers) for n in arch.projections(i).values()]
    batches = list(torch.randint(0, 512, (8, 16), generator=torch.Generator().manual_seed(3)).split(2))
    forwards = []
    capture = layerwise.capture_inputs
    for module in (layerwise, calibration):  # the layer-by-layer pass's own, and the sensitivity chunks'
        monkeypatch.setattr(module, "capture_inputs", lambda *a, **k: forwards.append(1) or capture(*a, **k))
    got = calibration.collect_grams(model, batches, names, sensitivity_samples=samples).sensitivity
    assert len(forwards) == 1 + (samples + 1) // 2 - 1  # the Gram pass, then each chunk but the first
    monkeypatch.undo()
    assert got == pytest.approx(calibration.output_sensitivity(model, names, batches, samples), rel=1e-6)


@pytest.mark.parametrize("method", ["svd", "basis_sharing"])
@pytest.mark.parametrize("ratio", [0.2, 0.5])
def test_fisher_allocation_removes_the_exact_share_and_saves(method, ratio, tokenizer, tmp_path):
    from wscompress.io import storage

    model = tiny_model("llama", layers=4)
    arch = discover(model)
    targets = [n for i in range(arch.num_layers) for n in arch.projections(i).values()]
    dense = sum(get_module(model, n).weight.numel() for n in targets)
    (row,) = wscompress.compress(model, [{"method": method, "ratio": ratio}], tokenizer, CALIB)
    assert row["allocation"] == "fisher"
    removed = row["params_before"] - row["params_after"]
    widest = 64 + 2 * 128  # the largest cost of one rank (a pair of layers sharing an up basis)
    assert ratio * dense <= removed < ratio * dense + widest
    ranks = [k for k in row["ranks"].values() if k is not None]
    assert len(set(ranks)) > 2  # not one rank for every matrix of a shape
    ids = torch.randint(0, 512, (2, 16))
    with torch.no_grad():
        out = model(input_ids=ids).logits
    storage.save(model, tokenizer, tmp_path / "m")
    loaded, _ = storage.load(tmp_path / "m")
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, out)
    assert any(isinstance(m, LowRankLinear) for m in loaded.modules())


@pytest.mark.slow
def test_fisher_beats_uniform_on_real_weights(smollm2, method="basis_sharing"):
    """At one budget, on real weights (SmolLM2's first 4 layers, 40 %), the allocated model fits
    held-out text better than one ratio for every matrix (random tiny models have nothing to find)."""
    import copy

    from wscompress.io import data
    from wscompress.methods.merge_drop import drop_layers

    from conftest import WIKI_TEST, WIKI_TRAIN

    model, tok = smollm2
    held_out = data.tokenize(tok, WIKI_TEST, max_tokens=4 * 256)[: 4 * 256].view(4, 256)
    losses = {}
    for allocation in ("uniform", "fisher"):
        short = copy.deepcopy(model)
        drop_layers(short, list(range(4)))  # keep the first 4
        wscompress.compress(short, [{"method": method, "ratio": 0.4, "allocation": allocation, "refit": False}], tok,
                            {"dataset": WIKI_TRAIN, "num_samples": 8, "seq_len": 256, "seed": 0})
        with torch.no_grad():
            losses[allocation] = short(input_ids=held_out, labels=held_out).loss.item()
    assert losses["fisher"] < losses["uniform"] - 0.05  # measured: 19.56 against 20.54
