"""The one refit pass (pipeline/refit.py) and its options, named once (recipe.schema.Refit):
every method that refits takes refit, refit_samples and ridge, and those whose modules'
outputs can be fitted to several targets take refit_target, and each option does what it says
in every one of them."""

import pytest
import torch

from wscompress import compress
from wscompress.methods import METHODS
from wscompress.recipe.schema import LayerRefit, Refit

from conftest import tiny_model

CALIB = {"dataset": "pydoc", "num_samples": 8, "seq_len": 64, "batch_size": 4, "dtype": "float32"}
X = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(0))

# stage -> the model kind it runs on; one per method that refits
STAGES = {
    "svd": ("llama", {"method": "svd", "ratio": 0.4, "allocation": "uniform"}),
    "basis_sharing": ("llama", {"method": "basis_sharing", "ratio": 0.4, "group_size": 2, "allocation": "uniform"}),
    "kmeans": ("llama", {"method": "kmeans", "bits": 3}),
    "trellis": ("llama", {"method": "trellis", "bits": 2, "state_bits": 8}),
    "cross_layer": ("llama", {"method": "cross_layer", "what": "block", "group_size": 2}),
    "soft_share": ("llama", {"method": "soft_share", "window": 2, "rank": 4, "starts": [1]}),
    "gqa": ("llama_mha", {"method": "gqa", "groups": 1}),
    "merge_drop": ("llama", {"method": "merge_drop", "n": 2, "start": 1, "search": False}),
}


def run(method: str, tokenizer, **options) -> torch.Tensor:
    kind, stage = STAGES[method]
    model = tiny_model(kind)
    compress(model, [{**stage, **options}], tokenizer=tokenizer, calibration=CALIB)
    with torch.no_grad():
        return model(X).logits


def test_every_method_that_refits_takes_the_same_options():
    refitting = {name for name, method in METHODS.items() if issubclass(method.config, Refit)}
    assert refitting == set(STAGES)
    assert {name for name in refitting if issubclass(METHODS[name].config, LayerRefit)} == refitting - {"merge_drop"}


@pytest.mark.parametrize("method", [m for m in STAGES if m not in ("kmeans", "trellis")])
def test_an_endless_ridge_keeps_what_the_stage_made(method, tokenizer):
    """λ → ∞ pulls every refit solution onto what it started from: the model is the one made
    without refit (k-means and the trellis are left out: their refit quantizes on other
    statistics, not only solves)."""
    kept, unrefit = run(method, tokenizer, ridge=1e12), run(method, tokenizer, refit=False)
    refit = run(method, tokenizer)
    torch.testing.assert_close(kept, unrefit, rtol=1e-4, atol=1e-4)
    assert (refit - unrefit).abs().max() > 1e-3


@pytest.mark.parametrize("method", [m for m in STAGES if m != "merge_drop"])
def test_refit_samples_and_target_reach_the_one_pass(method, tokenizer, monkeypatch):
    """The pass every method runs gets the first refit_samples calibration sequences and the
    refit_target, and the target changes the result."""
    import importlib

    from wscompress.pipeline import refit

    seen = []

    def spy(model, arch, batches, *args, **kwargs):
        seen.append((torch.cat(batches), args[2]))
        return fit_pass(model, arch, batches, *args, **kwargs)

    fit_pass = refit.fit_pass
    monkeypatch.setattr(refit, "fit_pass", spy)
    module = importlib.import_module(METHODS[method].run.__module__)
    if hasattr(module, "fit_pass"):
        monkeypatch.setattr(module, "fit_pass", spy)
    by_target = {t: run(method, tokenizer, refit_samples=4, refit_target=t) for t in ("function", "layer", "model")}
    assert [target for _, target in seen] == ["function", "layer", "model"]
    assert all(rows.shape[0] == 4 for rows, _ in seen)
    assert torch.equal(seen[0][0], seen[1][0])  # the same first sequences every time
    assert (by_target["function"] - by_target["layer"]).abs().max() > 1e-4
    assert (by_target["model"] - by_target["layer"]).abs().max() > 1e-4
