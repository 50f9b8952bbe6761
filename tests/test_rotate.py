"""Incoherence processing (``rotate``): each target's input turned by a random block Hadamard
rotation, its weight the same way, so the model computes what it did; a later stage quantizes
the turned weights (the rotated layers' ``inner``), and the mix loads back the three ways
(``test_transformers.FORMS``)."""

from __future__ import annotations

import pytest
import torch

import wscompress
from wscompress.errors import UsageError
from wscompress.evaluation.bench import kernel_path
from wscompress.io import storage
from wscompress.model.forms.wscompress_palettized import PalettizedLinear
from wscompress.model.forms.wscompress_rotated import RotatedLinear, hadamard

from conftest import tiny_model

CALIBRATION = {"dataset": "pydoc", "num_samples": 8, "seq_len": 64, "batch_size": 4}
INPUT = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(INPUT).logits


@pytest.mark.parametrize("n", [1, 2, 8, 64])
def test_hadamard_is_orthogonal_and_symmetric_with_entries_of_one_size(n):
    h = hadamard(n, torch.float64, torch.device("cpu"))
    torch.testing.assert_close(h @ h, torch.eye(n, dtype=torch.float64))
    assert torch.equal(h, h.T) and torch.allclose(h.abs(), torch.full_like(h, n ** -0.5))


@pytest.mark.parametrize("block", [8, 64])
def test_rotation_keeps_the_function_and_spreads_a_rows_outlier(block):
    model, reference = tiny_model("llama"), tiny_model("llama")
    down = reference.model.layers[0].mlp.down_proj.weight
    with torch.no_grad():  # one large weight in a row: after the rotation its row's block shares it
        for m in (model, reference):
            m.model.layers[0].mlp.down_proj.weight[3, 5] = 50 * down.abs().max()
    (row,) = wscompress.compress(model, [{"method": "rotate", "block": block}])
    layer = model.model.layers[0].mlp.down_proj
    assert isinstance(layer, RotatedLinear) and row["layers"] == 4 * 7 and row["block"] == block
    torch.testing.assert_close(logits(model), logits(reference), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(layer.dense_weight(), reference.model.layers[0].mlp.down_proj.weight, rtol=1e-5, atol=1e-6)
    turned, original = layer.inner.weight[3], reference.model.layers[0].mlp.down_proj.weight[3]
    assert turned.abs().max() < 1.1 * original.abs().max() / block**0.5  # the outlier spread over its block
    assert storage.stats(model)["params"] == storage.stats(reference)["params"]  # signs are bytes, not weights


def test_a_later_stage_quantizes_the_turned_weights(tokenizer):
    model = tiny_model("llama")
    wscompress.compress(model, [{"method": "rotate"}, {"method": "kmeans", "bits": 3}], tokenizer, CALIBRATION)
    layer = model.model.layers[1].self_attn.q_proj
    assert isinstance(layer, RotatedLinear) and isinstance(layer.inner, PalettizedLinear)
    assert "RotatedLinear: the input turned" in kernel_path(model)


@pytest.mark.parametrize("stage, words", [
    ({"method": "rotate", "block": 48}, "block=48 is not a power of two"),
    ({"method": "rotate", "block": 256}, "not a multiple of block=256"),
    ({"method": "rotate", "targets": ["lm_head"]}, "tied to the input embedding"),
])
def test_impossible_rotations_are_refused_before_any_work(stage, words):
    model = tiny_model("llama")
    model.tie_weights()
    with pytest.raises(UsageError, match=words):
        wscompress.compress(model, [stage])


def test_training_after_a_rotation_moves_the_codebooks_not_the_rotation(tmp_path, tokenizer):
    """``finetune.mode: method`` trains what the quantizing stage made inside each rotated layer
    (codebooks, scales, kept-aside weights); the signs and the rotation stay as they are."""
    from test_finetune import recipe

    from wscompress.recovery.finetune import finetune

    model = tiny_model("llama")
    wscompress.compress(model, [{"method": "rotate"}, {"method": "kmeans", "bits": 3, "row_scale": True}], tokenizer,
                        CALIBRATION)
    signs = model.model.layers[0].mlp.down_proj.signs.clone()
    codebook = model.model.layers[0].mlp.down_proj.inner.codebook.float().clone()
    trained, out = finetune(model, tokenizer, recipe(tmp_path, mode="method", steps=2))
    layer = trained.model.layers[0].mlp.down_proj
    assert isinstance(layer, RotatedLinear) and torch.equal(layer.signs, signs)
    assert not torch.equal(layer.inner.codebook.float(), codebook)
    assert out["trainable_params"] > 0
