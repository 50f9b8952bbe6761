"""Safetensors storage: shared tensors stored once, sharing restored on load, dense export."""

import json

import pytest
import torch
from safetensors import safe_open

from wscompress.errors import UsageError
from wscompress.io import files, storage
from wscompress.io.checkpoints import load_model
from wscompress.model.arch import set_module
from wscompress.recipe.schema import ModelConfig

from conftest import tiny_model


def share_ffn(model):
    """Layers 0 and 1 use the very same MLP projections (what cross-layer sharing produces)."""
    for proj in ("gate_proj", "up_proj", "down_proj"):
        set_module(model, f"model.layers.1.mlp.{proj}", model.get_submodule(f"model.layers.0.mlp.{proj}"))
    return model


def logits(model, seed=0):
    x = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model(x).logits


def test_sizes_count_bytes_and_dense_equivalent_parameters():
    """Sizes lead with bytes and bits a weight; parameters are the dense-equivalent count: a
    palettized weight counts as one parameter (its bits fall, not its count), a float16 one
    too, while a factorisation counts its factors, and the tied table once."""
    from wscompress import compress

    model = tiny_model("llama")
    dense = storage.stats(model)
    assert dense["bits_per_weight"] == 32 and dense["tensor_bytes"] == 4 * dense["params"]
    compress(model, [{"method": "kmeans", "bits": 4, "sensitivity": "none", "error_feedback": False, "refit": False,
                      "outliers": 0, "targets": ["mlp"]}, {"method": "half"}])
    packed = storage.stats(model)
    assert packed["params"] == dense["params"]  # every weight is still there, in fewer bits
    assert packed["tensor_bytes"] < dense["tensor_bytes"] / 2 and 4 < packed["bits_per_weight"] < 16
    model = tiny_model("llama")
    compress(model, [{"method": "svd", "ratio": 0.4, "whitening": False, "targets": ["mlp"]}])
    factored = storage.stats(model)
    assert factored["params"] < dense["params"] and factored["bits_per_weight"] == 32


def test_shared_modules_stored_once_and_retied(tmp_path, tokenizer):
    model = share_ffn(tiny_model("llama"))
    unique = storage.stats(model)["params"]
    assert unique == sum(p.numel() for p in model.parameters())  # parameters() dedups: the true count
    saved = storage.save(model, tokenizer, tmp_path / "m")
    with safe_open(str(tmp_path / "m" / storage.WEIGHTS), "pt") as f:
        names = list(f.keys())
    assert not any("layers.1.mlp" in n for n in names)
    assert "lm_head.weight" not in names  # tied to the embedding: stored once
    assert saved["params"] == unique
    assert saved["file_bytes"] == pytest.approx(unique * 4, rel=0.01)

    loaded, tok = storage.load(tmp_path / "m")
    assert loaded.model.layers[1].mlp.up_proj is loaded.model.layers[0].mlp.up_proj
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    assert torch.equal(logits(model), logits(loaded))
    assert tok is not None and json.loads((tmp_path / "m" / "config.json").read_text())["compression"]["format"] == "wscompress"


def test_load_skips_the_random_init(tmp_path, tokenizer, monkeypatch):
    """Every weight comes from the file, so loading must not spend time (minutes for a 7B
    model) drawing random ones first; the loaded model is still exactly the saved one."""
    model = share_ffn(tiny_model("llama"))
    storage.save(model, tokenizer, tmp_path / "m")

    def forbidden(*_args, **_kwargs):
        raise AssertionError("random init ran during load")
    for name in ("normal_", "uniform_", "kaiming_uniform_", "zeros_", "ones_"):
        monkeypatch.setattr(torch.nn.init, name, forbidden)
    loaded, _ = storage.load(tmp_path / "m")
    assert torch.equal(logits(model), logits(loaded))


def test_untied_model_keeps_both_matrices(tmp_path, tokenizer):
    model = tiny_model("llama_mha")
    storage.save(model, tokenizer, tmp_path / "m")
    loaded, _ = storage.load(tmp_path / "m")
    assert loaded.lm_head.weight is not loaded.model.embed_tokens.weight
    assert torch.equal(logits(model), logits(loaded))


def test_export_dense_loads_in_stock_transformers(tmp_path, tokenizer):
    from transformers import AutoModelForCausalLM

    model = share_ffn(tiny_model("llama"))
    storage.export_dense(model, tokenizer, tmp_path / "dense")
    stock = AutoModelForCausalLM.from_pretrained(tmp_path / "dense").eval()
    assert torch.allclose(logits(model), logits(stock), atol=1e-5)
    assert stock.model.layers[1].mlp.up_proj is not stock.model.layers[0].mlp.up_proj
    assert stock.lm_head.weight is stock.model.embed_tokens.weight


def test_save_is_atomic(tmp_path, tokenizer):
    model = tiny_model("llama")
    storage.save(model, tokenizer, tmp_path / "m")
    with pytest.raises(RuntimeError):
        with files.atomic_dir(tmp_path / "m") as tmp:
            (tmp / "partial").write_text("x")
            raise RuntimeError("crash mid-write")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]  # old output intact, no temp left
    assert (tmp_path / "m" / storage.WEIGHTS).is_file() and not (tmp_path / "m" / "partial").exists()


def test_corrupt_compressed_checkpoint(tmp_path, tokenizer):
    storage.save(tiny_model("llama"), tokenizer, tmp_path / "m")
    (tmp_path / "m" / storage.WEIGHTS).write_bytes(b"garbage")
    with pytest.raises(UsageError, match="corrupt"):
        load_model(ModelConfig(path=str(tmp_path / "m")))


def test_missing_and_corrupt_hf_checkpoints(tmp_path, tiny_dir):
    with pytest.raises(UsageError, match="not a checkpoint directory"):
        load_model(ModelConfig(path=str(tmp_path / "nowhere")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(UsageError, match="no config.json"):
        load_model(ModelConfig(path=str(tmp_path / "empty")))
    path = tiny_dir("llama")
    (path / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(UsageError, match="could not load"):
        load_model(ModelConfig(path=str(path)))


@pytest.mark.parametrize("kind", ["gpt2", "opt", "gemma3"])
def test_round_trip_other_families(tmp_path, tokenizer, kind):
    model = tiny_model(kind)
    storage.save(model, tokenizer, tmp_path / kind)
    loaded, _ = storage.load(tmp_path / kind)
    assert torch.equal(logits(model), logits(loaded))


GPT2_STAGES = {
    "svd": [{"method": "svd", "ratio": 0.3}],
    "basis_sharing": [{"method": "basis_sharing", "ratio": 0.3}],
    "kmeans": [{"method": "kmeans", "bits": 3}],
    "kmeans_vector": [{"method": "kmeans", "bits": 4, "cluster_dim": 2, "granularity": "per_tensor"}],
    "soft_share": [{"method": "soft_share", "window": 2, "rank": 4, "starts": [1]}],
    "cross_layer": [{"method": "cross_layer", "what": "block", "group_size": 2, "init": "mean", "refit": False}],
    "merge": [{"method": "merge", "n": 2}],
    "merge_drop": [{"method": "merge_drop", "n": 2}],
    "factorize_embeddings": [{"method": "factorize_embeddings", "rank": 16}],
    "dkm": [],  # trained by finetune mode dkm, below
}


@pytest.mark.parametrize("method", sorted(GPT2_STAGES))
def test_gpt2_export_after_every_method_loads_in_stock_transformers(method, tmp_path, tokenizer):
    """GPT-2 stores its weights (in, out) in Conv1D: every compressed layer's dense export
    writes that layout back, so stock from_pretrained loads it and computes the same logits."""
    from transformers import AutoModelForCausalLM

    import wscompress
    from wscompress.recipe.load import load_recipe
    from wscompress.recovery.finetune import finetune

    model = tiny_model("gpt2")
    wscompress.compress(model, GPT2_STAGES[method], tokenizer,
                        {"dataset": "pydoc", "num_samples": 8, "seq_len": 64, "batch_size": 4})
    if method == "dkm":
        recipe = load_recipe(data={"output": {"dir": str(tmp_path / "run")}, "eval": {"perplexity": []},
                                   "finetune": {"mode": "dkm", "steps": 2, "seq_len": 32, "batch_size": 2,
                                                "dataset": "pydoc", "dkm": {"bits": 3}}})
        model, _ = finetune(model, tokenizer, recipe)
    storage.save(model, tokenizer, tmp_path / "m")
    loaded, _ = storage.load(tmp_path / "m")
    storage.export_dense(loaded, tokenizer, tmp_path / "dense")
    stock = AutoModelForCausalLM.from_pretrained(tmp_path / "dense").eval()
    torch.testing.assert_close(logits(stock), logits(model), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("exchange", [True, False])
def test_atomic_replace_never_leaves_neither(tmp_path, monkeypatch, exchange):
    """Replacing an existing output: the old one stays in place until the new one takes its
    place in one step (or, where the system cannot swap atomically, is put back on failure)."""
    target = tmp_path / "m"
    target.mkdir()
    (target / "old").write_text("old")
    if not exchange:
        monkeypatch.setattr(files, "_exchange", lambda a, b: False)
    with files.atomic_dir(target) as tmp:
        (tmp / "new").write_text("new")
    assert sorted(p.name for p in target.iterdir()) == ["new"] and sorted(p.name for p in tmp_path.iterdir()) == ["m"]
    if exchange:
        return
    real = type(target).rename

    def failing(self, dest):  # the new folder cannot take the old one's place
        if self.name.startswith(".m.") and not self.name.startswith(".m.old"):
            raise OSError("disk trouble")
        return real(self, dest)
    monkeypatch.setattr(type(target), "rename", failing)
    with pytest.raises(OSError, match="disk trouble"):
        with files.atomic_dir(target) as tmp:
            (tmp / "newer").write_text("x")
    assert sorted(p.name for p in target.iterdir()) == ["new"] and sorted(p.name for p in tmp_path.iterdir()) == ["m"]
