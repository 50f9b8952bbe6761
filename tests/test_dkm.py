"""DKM fine-tuning: option checks, chunked attention = unchunked, and a real training run
that beats post-training k-means at the same bits."""

from __future__ import annotations

import copy

import pytest
import torch

import wscompress
from wscompress.errors import UsageError
from wscompress.evaluation.perplexity import perplexity
from wscompress.io import data, storage
from wscompress.maths.clustering import centroid_means, nearest
from wscompress.model.forms.wscompress_palettized import PalettizedLinear
from wscompress.recipe.load import load_recipe
from wscompress.recipe.schema import DKMConfig
from wscompress.recovery.dkm import DKMLinear, kmeans_stage, prepare_dkm
from wscompress.recovery.finetune import finetune

from conftest import WIKI_TEST, WIKI_TRAIN, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

@pytest.mark.parametrize("options,key", [({"bits": 9}, "bits"), ({"temperature": 0}, "temperature"),
                                         ({"iterations": 0}, "iterations"), ({"chunk": 5}, "chunk"),
                                         ({"granularity": "grouped"}, "group_size")])
def test_bad_options(options, key):
    """Options of the dkm mode are checked with the recipe (and as the kmeans stage they amount to)."""
    with pytest.raises(UsageError, match=key):
        kmeans_stage(load_recipe(data={"finetune": {"mode": "dkm", "dkm": options}}).finetune.dkm)


def test_bad_shape_refused_before_wrapping():
    model = tiny_model("llama")
    with pytest.raises(UsageError, match="cluster_dim=3"):
        prepare_dkm(model, DKMConfig(cluster_dim=3))
    assert not any(isinstance(m, DKMLinear) for m in model.modules())


@pytest.mark.parametrize("opts", [{"bits": 3}, {"bits": 2, "granularity": "per_channel", "cluster_dim": 2}])
def test_chunked_attention_gives_the_same_weights_and_gradients(opts):
    grads = []
    for chunk in (1 << 22, 2048):  # one chunk vs 32 small ones (recomputed in backward)
        model = tiny_model("llama").double()  # float64: only the summation order differs
        prepare_dkm(model, DKMConfig(**opts, chunk_size=chunk, targets=[r"layers\.0\.mlp\.up_proj"]))
        layer = model.model.layers[0].mlp.up_proj
        layer.train()
        w = layer.soft_weight()
        (w ** 2).sum().backward()
        grads.append((w.detach(), layer.weight.grad.clone(), layer.centroids.clone()))
    for a, b in zip(*grads):
        assert torch.allclose(a, b, rtol=1e-9, atol=1e-12)
    assert grads[0][1].abs().sum() > 0  # gradients reach the dense weights through the attention


def test_forward_passes_warm_start_and_snap_ends_with_a_hard_lloyd_step():
    from wscompress.recovery.dkm import _sums

    model = tiny_model("llama").double()
    prepare_dkm(model, DKMConfig(bits=2, iterations=1, targets=[r"layers\.0\.mlp\.up_proj"]))
    layer = model.model.layers[0].mlp.up_proj

    def step(c):  # one soft k-means update from c
        num, den = _sums(layer.points(), c, layer.tau)
        return num / den[..., None]
    start = layer.centroids.clone()
    with torch.no_grad():
        first = layer.converged_centroids()
        torch.testing.assert_close(first, step(start))
        assert torch.equal(layer.centroids, first)  # the buffer holds where the pass ended
        torch.testing.assert_close(layer.converged_centroids(), step(first))  # and the next pass starts there
    codebook, idx = layer.snap()
    converged, points = layer.centroids, layer.points().detach()
    torch.testing.assert_close(codebook, centroid_means(points, nearest(points, converged), converged))
    assert torch.equal(idx.reshape(points.shape[:2]), nearest(points, codebook))
    error = lambda c: (points - torch.gather(c, 1, nearest(points, c)[..., None])).pow(2).sum()  # noqa: E731
    assert error(codebook) < error(converged)  # the hard step only lowers the clustering error


def test_dkm_resume_equals_an_uninterrupted_run(tokenizer, tmp_path):
    """The centroid warm starts travel in the checkpoint: a resumed run ends where one run ends."""
    dkm = {"bits": 2, "targets": [r"layers\.0\.mlp"]}
    recipe = lambda out: _recipe("dkm", 4, 1e-3, dkm=dkm, save_every=2, seq_len=32, batch_size=2,  # noqa: E731
                                 output=str(out))
    whole, _ = finetune(tiny_model("llama"), tokenizer, recipe(tmp_path / "a"))
    finetune(tiny_model("llama"), tokenizer, recipe(tmp_path / "b"), stop_after=2)
    resumed, _ = finetune(tiny_model("llama"), tokenizer, recipe(tmp_path / "b"), resume=True)
    for (name, a), b in zip(whole.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name


def _recipe(mode: str, steps: int, lr: float, output: str = "outputs/test-dkm", **kw):
    return load_recipe(data={"output": {"dir": output}, "eval": {"perplexity": [WIKI_TEST]},
                             "finetune": {"mode": mode, "steps": steps, "seq_len": 64, "batch_size": 8, "lr": lr,
                                          "eval_windows": 4, "dataset": WIKI_TRAIN, **kw}})


def test_dkm_training_beats_post_training_kmeans(tokenizer, tmp_path):
    torch.manual_seed(0)
    ids = data.tokenize(tokenizer, WIKI_TEST, max_tokens=64 * 16 + 1)
    ppl = lambda m: perplexity(m, ids, 64, max_windows=16)["ppl"]
    model, _ = finetune(tiny_model("llama"), tokenizer, _recipe("full", 120, 3e-3))  # a real (tiny) LM first
    ptq = copy.deepcopy(model)
    (ptq_report,) = wscompress.compress(ptq, [{"method": "kmeans", "bits": 2, "sensitivity": "none", "error_feedback": False,
                                               "refit": False, "outliers": 0}])
    dkm, report = finetune(copy.deepcopy(model), tokenizer, _recipe("dkm", 40, 1e-3, dkm={"bits": 2}))
    layers = [m for m in dkm.modules() if isinstance(m, PalettizedLinear)]
    assert len(layers) == ptq_report["layers"] and all(m.bits == 2 for m in layers)
    assert not any(isinstance(m, DKMLinear) for m in dkm.modules())
    assert report["dkm"]["bits_per_weight"] == pytest.approx(ptq_report["bits_per_weight"])
    dkm_ppl, ptq_ppl = ppl(dkm), ppl(ptq)
    assert dkm_ppl < ptq_ppl, (dkm_ppl, ptq_ppl)
    storage.save(dkm, tokenizer, tmp_path / "m")
    loaded, _ = storage.load(tmp_path / "m")
    assert ppl(loaded) == pytest.approx(dkm_ppl, rel=1e-6)
