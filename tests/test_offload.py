"""The layer-group pipeline and offloading: the same results as before, whatever the placement."""

from __future__ import annotations

import weakref
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import wscompress
from wscompress.errors import UsageError
from wscompress.io import storage
from wscompress.io.checkpoints import load_model
from wscompress.io.offload import offload_of
from wscompress.model.arch import discover
from wscompress.recipe.load import load_recipe
from wscompress.recipe.schema import ModelConfig
from wscompress.workflow import apply_stages

from conftest import text_tokenizer, tiny_model

# logits[..., :64] of each recipe, made before the package was rearranged into folders (on the
# commit before it), with a tokenizer and calibration text that do not depend on the Python version;
# the kmeans ones remade when k-means++ seeding moved into kernels/kmeans.cpp (same law, its
# uniforms drawn at once: other centroids)
GOLDEN = Path(__file__).parent / "data" / "pipeline_logits.safetensors"
CALIB = {"dataset": "builtin:wiki.train", "num_samples": 8, "seq_len": 32, "batch_size": 2, "dtype": "float32"}  # exact float32
RECIPES = {  # name -> stages
    "svd_fisher": [{"method": "svd", "ratio": 0.3, "sensitivity_samples": 4, "refit": False}],
    "basis_sharing_refit": [{"method": "basis_sharing", "ratio": 0.3, "refit": True, "refit_target": "function",
                             "sensitivity_samples": 4}],
    "basis_sharing_uniform": [{"method": "basis_sharing", "ratio": 0.3, "allocation": "uniform", "refit": False}],
    "kmeans": [{"method": "kmeans", "bits": 3, "refit": False}],  # on the original model's statistics
}
X = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(0))


def logits(model) -> torch.Tensor:
    with torch.no_grad(), offload_of(model).running():
        return model(X).logits[..., :64]


@pytest.fixture(scope="module")
def golden_tokenizer():
    return text_tokenizer()


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
@pytest.mark.parametrize("name", list(RECIPES))
def test_results_equal_the_stored_logits(kind, name, golden_tokenizer):
    """The layer-by-layer pipeline (statistics streamed to disk a layer at a time, sensitivities
    layer by layer, per-group method steps) gives the logits stored before the package moved."""
    model = tiny_model(kind)
    wscompress.compress(model, RECIPES[name], tokenizer=golden_tokenizer, calibration=CALIB)
    torch.testing.assert_close(logits(model), load_file(GOLDEN)[f"{kind}.{name}"], rtol=1e-5, atol=1e-5)


@pytest.fixture
def on_disk(tiny_dir, tmp_path):
    """(model with its decoder layers resting on disk, tokenizer)."""
    return load_model(ModelConfig(path=str(tiny_dir("llama")), offload="disk", offload_folder=str(tmp_path / "spill"),
                                  device="cpu"))


def resident_layers(model) -> list[int]:
    return [i for i, layer in enumerate(discover(model).layers) if any(not t.is_meta for t in layer.state_dict().values())]


STAGED = {"basis_sharing_refit": [{"method": "basis_sharing", "ratio": 0.3, "sensitivity_samples": 4}],  # refit_target: layer
          "basis_sharing_refit_function": RECIPES["basis_sharing_refit"],
          "kmeans_refit": [{"method": "kmeans", "bits": 3}],
          # then k-means on the bases and coefficients:
          "basis_sharing_kmeans": RECIPES["basis_sharing_uniform"] + [{"method": "kmeans", "bits": 4}],
          # int8 reads its targets through the same layer-by-layer walk (pipeline.layerwise.replace_each)
          "kmeans_mlp_int8_attention": [{"method": "kmeans", "bits": 3, "targets": ["mlp"]},
                                        {"method": "int8", "targets": ["self_attn"]}]}


@pytest.mark.parametrize("name", list(STAGED))
def test_disk_offload_compresses_to_the_same_model_one_group_at_a_time(name, on_disk, tmp_path, tokenizer):
    """The same logits as the in-memory run, with at most one group of layers in memory."""
    model, tok = on_disk
    reference = tiny_model("llama")
    wscompress.compress(reference, STAGED[name], tokenizer=tokenizer, calibration=CALIB)
    assert resident_layers(model) == []  # nothing of the layers in memory after loading
    arch = discover(model)
    most = [0]
    for layer in arch.layers:  # how many layers hold real tensors whenever one runs
        layer.register_forward_pre_hook(lambda *_: most.__setitem__(0, max(most[0], len(resident_layers(model)))))
    recipe = load_recipe(data={"calibration": CALIB, "compress": STAGED[name]})
    replaced = weakref.ref(arch.layers[0].mlp.down_proj)
    apply_stages(model, tok, recipe, tmp_path)
    assert replaced() is None  # a swapped-out layer is freed with its onloaded weights, not kept by the offloader
    torch.testing.assert_close(logits(model), logits(reference), rtol=1e-6, atol=1e-6)
    assert 1 <= most[0] <= 2 and resident_layers(model) == []  # a group of 2 at most, none at rest
    saved = storage.save(model, tok, tmp_path / "out", max_shard_size=50_000)  # shard by shard
    files = storage.weight_files(tmp_path / "out")
    def fits(f: Path) -> bool:  # the tensors of a shard within the limit, or one larger tensor alone
        tensors = load_file(f)
        return sum(t.numel() * t.element_size() for t in tensors.values()) <= 50_000 or len(tensors) == 1
    assert len(files) > 1 and all(map(fits, files))
    assert saved["file_bytes"] == sum(f.stat().st_size for f in files)
    for placement in ("none", "disk"):
        again, _ = load_model(ModelConfig(path=str(tmp_path / "out"), offload=placement, device="cpu"))
        torch.testing.assert_close(logits(again), logits(model), rtol=0, atol=0)


def test_disk_offload_evaluates_like_memory(tiny_dir):
    from wscompress.evaluation.perplexity import evaluate_text

    path = str(tiny_dir("llama"))
    ppl = {mode: evaluate_text(*load_model(ModelConfig(path=path, offload=mode)), "pydoc", 64, max_windows=4)["ppl"]
           for mode in ("none", "disk")}
    assert ppl["disk"] == pytest.approx(ppl["none"], rel=1e-6)


def test_disk_offload_refuses_what_needs_the_whole_model(on_disk, tmp_path):
    from wscompress.recovery.finetune import finetune

    model, tok = on_disk
    recipe = load_recipe(data={"compress": [{"method": "merge_drop", "groups": [[1, 2]]}]})
    with pytest.raises(UsageError, match="every decoder layer in memory"):
        apply_stages(model, tok, recipe, tmp_path)
    with pytest.raises(UsageError, match="offload: disk"):
        finetune(model, tok, load_recipe(data={"finetune": {"steps": 1}}))


def test_nested_onloads_keep_a_layer_until_the_last_leaves(on_disk):
    model, _ = on_disk
    offload = offload_of(model)
    with offload.onload([1, 2]):
        with offload.onload([2]):
            assert resident_layers(model) == [1, 2]
        assert resident_layers(model) == [1, 2]
    assert resident_layers(model) == []
    with pytest.raises(UsageError):
        load_model(ModelConfig(path=str(Path(offload.folder)), offload="disk"))  # no checkpoint there


def mapped_pages(t: torch.Tensor) -> int:
    """How many of the whole pages under ``t`` this process has mapped (the present bit of
    /proc/self/pagemap)."""
    import mmap
    import struct

    page = mmap.PAGESIZE
    begin = t.untyped_storage().data_ptr()
    lo, hi = -(-begin // page), (begin + t.untyped_storage().nbytes()) // page
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(lo * 8)
        return sum(struct.unpack("Q", f.read(8))[0] >> 63 for _ in range(hi - lo))


@pytest.mark.skipif(not Path("/proc/self/pagemap").exists(), reason="Linux only")
def test_disk_offload_hands_the_embedding_pages_back_after_a_lookup(tiny_dir):
    """The input embedding of a disk-offloaded model is read from the checkpoint's mapping for
    a few rows; read-ahead would keep the whole table resident (most of 1 GB on a 1B model)."""
    import os

    model, _ = load_model(ModelConfig(path=str(tiny_dir("llama_mha", vocab_size=8192)), offload="disk", device="cpu"))  # 2 MB
    os.sync()  # a checkpoint just written has dirty pages, which the kernel keeps; one on disk has none
    table = model.get_input_embeddings().weight
    table.sum()  # every page read
    pages = mapped_pages(table)
    assert pages > 500
    with torch.no_grad(), offload_of(model).running():
        model(X)
    assert mapped_pages(table) < pages // 4  # best effort: pages still in a per-CPU LRU batch stay
