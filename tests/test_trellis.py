"""Trellis-coded quantization (``trellis``): the Viterbi search finds the least-error walk (the
compiled search and the torch path agree with an exhaustive one), streams pack and unpack, the
code beats the best scalar codebook on Gaussian weights, error feedback lowers a layer's output
error, and the stage runs after ``rotate`` on a model (loading back the three ways is
``test_transformers.FORMS``' ``rotated_trellis``)."""

from __future__ import annotations

import itertools

import pytest
import torch

import wscompress
from wscompress import kernels
from wscompress.errors import UsageError
from wscompress.maths import trellis
from wscompress.maths.clustering import GramFactors
from wscompress.model.forms.wscompress_rotated import RotatedLinear
from wscompress.model.forms.wscompress_trellis import TrellisLinear, code, pack, stream_bytes, unpack

from conftest import tiny_model

CALIBRATION = {"dataset": "pydoc", "num_samples": 8, "seq_len": 64, "batch_size": 4}


def cost(w, h, values, states):
    return (h * (w - values[states]) ** 2).sum(1)


def follows(states, bits, state_bits):
    """Whether each state keeps all but ``bits`` bits of the one before, as the stream stores them."""
    return bool(((states[:, 1:] >> bits) == (states[:, :-1] & ((1 << (state_bits - bits)) - 1))).all())


@pytest.fixture(params=["compiled", "torch"])
def path(request, monkeypatch):
    if request.param == "compiled" and kernels.trellis() is None:
        pytest.skip("the trellis kernel is not built here")
    if request.param == "torch":
        monkeypatch.setattr(kernels, "trellis", lambda: None)
    return request.param


@pytest.mark.parametrize("bits, state_bits", [(1, 3), (2, 4)])
def test_the_search_finds_the_least_error_walk(path, bits, state_bits):
    """Free, and held to an overlap: the first state beginning and the last ending with its bits."""
    g = torch.Generator().manual_seed(0)
    w, h = torch.randn(3, 4, generator=g), torch.rand(3, 4, generator=g) + 0.1
    values, mask = code(state_bits), (1 << state_bits) - 1
    walks = []  # every walk: any first state, then `bits` new bits a step
    for first in range(1 << state_bits):
        for new in itertools.product(range(1 << bits), repeat=3):
            walks.append([first])
            for b in new:
                walks[-1].append(((walks[-1][-1] << bits) | b) & mask)
    walks = torch.tensor(walks)
    overlap = torch.tensor([-1, 1, 2])
    found = trellis.viterbi(w, h, values, bits, overlap)
    for row in range(3):
        keep = walks if overlap[row] < 0 else walks[(walks[:, 0] >> bits == overlap[row])
                                                    & (walks[:, -1] % (1 << state_bits - bits) == overlap[row])]
        least = cost(w[row].expand(len(keep), -1), h[row].expand(len(keep), -1), values, keep).min().item()
        assert cost(w[row:row + 1], h[row:row + 1], values, found[row:row + 1])[0].item() == pytest.approx(least, rel=1e-6)
    assert follows(found, bits, state_bits)
    assert (found[1:, 0] >> bits).tolist() == [1, 2] and (found[1:, -1] % (1 << state_bits - bits)).tolist() == [1, 2]


def test_compiled_and_torch_searches_agree(monkeypatch):
    if kernels.trellis() is None:
        pytest.skip("the trellis kernel is not built here")
    g = torch.Generator().manual_seed(1)
    w, h = torch.randn(40, 24, generator=g), torch.rand(40, 24, generator=g) + 0.5  # 40: three blocks of lanes
    compiled = trellis.tail_biting(w, h, code(10), 3)
    monkeypatch.setattr(kernels, "trellis", lambda: None)
    torch.testing.assert_close(cost(w, h, code(10), compiled), cost(w, h, code(10), trellis.tail_biting(w, h, code(10), 3)))


@pytest.mark.parametrize("bits, state_bits, steps", [(2, 8, 36), (3, 12, 256), (4, 17, 6), (1, 2, 16)])
def test_streams_pack_and_unpack(bits, state_bits, steps):
    """A stream of steps·k random bits read circularly gives a tail-biting walk, which packs to
    that stream again."""
    stream = torch.randint(0, 256, (6, steps * bits // 8), generator=torch.Generator().manual_seed(2), dtype=torch.uint8)
    bit = torch.cat([(stream[:, :, None] >> torch.arange(7, -1, -1)) & 1] * 2, 1).reshape(6, -1).long()
    states = torch.stack([sum(bit[:, t * bits + i] << (state_bits - 1 - i) for i in range(state_bits))
                          for t in range(steps)], 1)
    assert follows(states, bits, state_bits)
    assert torch.equal(unpack(stream, steps, bits, state_bits), states)
    assert torch.equal(pack(states, bits, state_bits), stream) and stream.shape[1] == stream_bytes(steps, bits)


def test_the_code_is_gaussian_and_its_error_below_the_best_scalar_codebooks():
    values = code(12)
    assert values.mean().abs() < 0.02 and values.std() == pytest.approx(1.0, abs=0.02)
    w = torch.randn(256, 256, generator=torch.Generator().manual_seed(3))
    for bits, lloyd_max in ((2, 0.1175), (3, 0.03454)):  # the best scalar codebook's error on N(0, 1)
        states, scale = trellis.search(w, bits, 12, None)
        mse = (values[states] * scale[:, None] - w).pow(2).mean().item()
        assert mse < 0.75 * lloyd_max, (bits, mse)


def test_error_feedback_lowers_the_layers_output_error():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2048, 64, generator=g) @ (torch.randn(64, 64, generator=g) * 0.3 + torch.eye(64))  # correlated
    w = torch.randn(48, 64, generator=g)
    gram = (x.T @ x).double()
    errors = {}
    for name, grams in (("plain", None), ("feedback", GramFactors(gram))):
        states, scale = trellis.search(w, 2, 10, grams)
        errors[name] = (x @ (code(10)[states] * scale[:, None] - w).T).pow(2).mean().item()
    assert errors["feedback"] < 0.8 * errors["plain"], errors


def test_the_row_scale_is_the_least_error_one_for_its_walk():
    w = torch.randn(16, 128, generator=torch.Generator().manual_seed(5)) * torch.linspace(0.1, 3, 16)[:, None]
    states, scale = trellis.search(w, 3, 10, None)
    q = code(10)[states]
    for factor in (0.98, 1.02):
        assert ((q * scale[:, None] - w).pow(2).sum(1) <= (q * factor * scale[:, None] - w).pow(2).sum(1) * (1 + 1e-3)).all()


def test_the_stage_codes_the_rotated_weights_of_a_model(tokenizer):
    """On the tiny model the 3-bit trellis (3.25 bits a weight with its scales and first states)
    keeps the logits far closer than the rotated 2-bit k-means layout (3.0 bits: its tables
    weigh more on small matrices)."""
    x = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = tiny_model("llama")(x).logits
    errors, rows = {}, {}
    for method, bits in (("trellis", 3), ("kmeans", 2)):
        model = tiny_model("llama")
        (_, rows[method]) = wscompress.compress(model, [{"method": "rotate", "block": 32},
                                                        {"method": method, "bits": bits}], tokenizer, CALIBRATION)
        with torch.no_grad():
            errors[method] = ((model(x).logits - want).pow(2).mean() / want.var()).item()
        if method == "trellis":
            layer = model.model.layers[1].mlp.up_proj
            assert isinstance(layer, RotatedLinear) and isinstance(layer.inner, TrellisLinear)
    assert rows["trellis"]["layers"] == 4 * 7 and 3.0 < rows["trellis"]["bits_per_weight"] < 3.3  # with row scales
    assert errors["trellis"] < 0.5 * errors["kmeans"], errors


@pytest.mark.parametrize("stage, words", [
    ({"method": "trellis", "bits": 4, "state_bits": 4}, "needs state_bits above it"),
    ({"method": "trellis", "targets": ["lm_head"]}, "tied to the input embedding"),
])
def test_impossible_trellis_stages_are_refused_before_any_work(stage, words):
    model = tiny_model("llama")
    model.tie_weights()
    with pytest.raises(UsageError, match=words):
        wscompress.compress(model, [stage])


@pytest.mark.parametrize("bits, state_bits", [(2, 12), (3, 12), (4, 17), (1, 8)])
@pytest.mark.parametrize("rows", [1, 3, 40])  # decoding (the kernel's products) and prefill (the decoded weight)
def test_the_kernels_compute_what_the_torch_path_does(bits, state_bits, rows):
    if kernels.trellis() is None:
        pytest.skip("the trellis kernel is not built here")
    g = torch.Generator().manual_seed(6)
    w = torch.randn(48, 64, generator=g)
    states, scale = trellis.search(w, bits, state_bits, None)
    layer = TrellisLinear.from_states(states, scale, bits, state_bits, torch.randn(48, generator=g))
    assert torch.equal(layer.states(), states)  # the search's walks bite their tails: the stream holds them whole
    x = torch.randn(rows, 64, generator=g)
    with torch.no_grad():
        fast = layer(x)
        want = torch.nn.functional.linear(x, layer.dense_weight(), layer.bias)
    torch.testing.assert_close(fast, want, rtol=1e-5, atol=1e-5)
    assert "trellis kernel" in layer.compute_path()


def test_training_moves_the_row_scales_not_the_walks(tmp_path, tokenizer):
    """``finetune.mode: method`` trains each trellis layer's row scales (in float32, stored back as
    float16); the walks stay as searched."""
    from test_finetune import recipe

    from wscompress.recovery.finetune import finetune

    model = tiny_model("llama")
    wscompress.compress(model, [{"method": "rotate", "block": 32}, {"method": "trellis", "bits": 2, "state_bits": 8}],
                        tokenizer, CALIBRATION)
    layer = model.model.layers[0].mlp.down_proj.inner
    stream, scale = layer.stream.clone(), layer.scale.clone()
    trained, out = finetune(model, tokenizer, recipe(tmp_path, mode="method", steps=2))
    layer = trained.model.layers[0].mlp.down_proj.inner
    assert out["trainable_params"] > 0 and layer.trained_scale is None and layer.scale.dtype == torch.float16
    assert torch.equal(layer.stream, stream) and not torch.equal(layer.scale, scale)


def test_a_budget_gives_each_matrix_its_bits_within_the_size(tokenizer):
    """``budget: {bits_per_weight: 2.5}`` mixes 2- and 3-bit matrices (and 4-bit ones where they pay)
    to within the budget, everything counted: walks, row scales and the rotations' signs."""
    from wscompress.io import storage

    model = tiny_model("llama")
    (rotated, row) = wscompress.compress(model, [{"method": "rotate", "block": 32},
                                                 {"method": "trellis", "budget": {"bits_per_weight": 2.7},
                                                  "state_bits": 8}], tokenizer, CALIBRATION)
    budget = row["budget"]
    chosen = {m.inner.bits for m in model.modules() if isinstance(m, RotatedLinear)}
    assert len(chosen) > 1 and budget["bits_per_weight"] <= 2.7
    layers = [m for m in model.modules() if isinstance(m, RotatedLinear)]
    stored = sum(m.inner.storage_bits() / 8 + m.signs.numel() for m in layers)
    assert stored == budget["used_bytes"] and row["bits_per_weight"] * row["weights"] / 8 == pytest.approx(stored - sum(
        m.signs.numel() for m in layers))
    assert storage.stats(model)["params"] > 0


def test_an_impossible_budget_is_refused_before_any_work():
    model = tiny_model("llama")
    with pytest.raises(UsageError, match="below the 2 bits a weight for every matrix"):
        wscompress.compress(model, [{"method": "trellis", "budget": {"bits_per_weight": 1.5}, "menu": [2, 3]}])
    with pytest.raises(UsageError, match="no smaller than the dense"):
        wscompress.compress(model, [{"method": "trellis", "budget": {"bits_per_weight": 32}}])
