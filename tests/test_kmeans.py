"""The kmeans stage: clustering quality, the PalettizedLinear layer, storage and bad input."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import torch
from safetensors import safe_open

import wscompress
from wscompress.errors import UsageError
from wscompress.io import storage
from wscompress.maths import clustering
from wscompress.maths.clustering import cluster
from wscompress.model.forms.wscompress_palettized import PalettizedLinear
from wscompress.recipe.load import load_recipe
from wscompress.recovery.finetune import finetune

from conftest import (
    REPO,
    WIKI_TRAIN,
    final_inputs,
    first_layers,
    hidden_state_error,
    kernel_tolerance,
    layer_reference_inputs,
    real_texts,
    tiny_model,
)
from test_finetune import recipe

pytestmark = pytest.mark.usefixtures("one_thread")
# the data-free path: plain k-means, nearest centroids, nothing aside, fp32 codebooks
FAST = {"sensitivity": "none", "error_feedback": False, "refit": False, "outliers": 0, "codebook_dtype": "float32"}
CALIB = {"dataset": "pydoc", "num_samples": 8, "seq_len": 64, "batch_size": 4}


def naive_kmeans(x: np.ndarray, k: int, seeds: int = 5, iters: int = 300) -> float:
    """Reference: plain Lloyd over every point (k-means++ seeding), best of several seeds; MSE."""
    best = np.inf
    for seed in range(seeds):
        rng = np.random.default_rng(seed)
        c = x[[rng.integers(len(x))]]
        for _ in range(1, k):
            d2 = ((x[:, None] - c[None]) ** 2).sum(-1).min(1)
            c = np.vstack([c, x[rng.choice(len(x), p=d2 / d2.sum())]])
        for _ in range(iters):
            a = ((x[:, None] - c[None]) ** 2).sum(-1).argmin(1)
            new = np.array([x[a == j].mean(0) if (a == j).any() else c[j] for j in range(k)])
            if np.allclose(new, c, rtol=0, atol=0):
                break
            c = new
        best = min(best, ((x - c[a]) ** 2).sum(-1).mean())
    return best


def mse(groups: torch.Tensor, bits: int, **kw) -> float:
    codebook, idx = cluster(groups, bits, **kw)
    rec = torch.gather(codebook, 1, idx[..., None].expand(-1, -1, groups.shape[-1]))
    assert torch.isfinite(codebook).all()
    return ((rec - groups) ** 2).sum(-1).mean().item()


def laplace(*shape, seed=0) -> torch.Tensor:
    return torch.distributions.Laplace(0.0, 0.02).sample(shape) if seed is None else \
        torch.from_numpy(np.random.default_rng(seed).laplace(0, 0.02, shape).astype(np.float32))


@pytest.mark.parametrize("bits", [1, 2, 4])
def test_scalar_per_tensor_matches_or_beats_naive_lloyd(bits):
    """Same number of restarts; the histogram and prefix sums must cost no quality."""
    w = laplace(10_000)
    ours = mse(w.view(1, -1, 1), bits, n_init=5)
    assert ours <= naive_kmeans(w.numpy()[:, None].astype(np.float64), 2 ** bits, seeds=5) * 1.002


def test_scalar_per_channel_is_one_batch_matching_naive_per_row():
    w = laplace(6, 300, seed=1)
    codebook, idx = cluster(w[..., None], 3, n_init=5)
    assert codebook.shape == (6, 8, 1) and idx.shape == (6, 300)
    ours = ((torch.gather(codebook[..., 0], 1, idx) - w) ** 2).mean().item()
    naive = np.mean([naive_kmeans(w[r].numpy()[:, None].astype(np.float64), 8, seeds=5) for r in range(6)])
    assert ours <= naive * 1.01  # per row either may find the better local optimum; not on average


def test_vector_clustering_matches_naive_and_chunking_changes_nothing(monkeypatch):
    w = laplace(1, 600, 2, seed=2)
    ours = mse(w, 3, n_init=5)
    assert ours <= naive_kmeans(w[0].numpy().astype(np.float64), 8, seeds=5) * 1.03
    full = cluster(w, 3)
    monkeypatch.setattr(clustering, "CHUNK_ELEMENTS", 64)  # 8 points per distance chunk
    chunked = cluster(w, 3)
    assert torch.equal(full[1], chunked[1]) and torch.allclose(full[0], chunked[0])


@pytest.mark.parametrize("init", ["kmeans++", "linear", "density"])
@pytest.mark.parametrize("d", [1, 2])
def test_every_init_gives_a_sane_codebook(init, d):
    w = laplace(3, 200, d, seed=3)
    assert mse(w, 2, init=init) < (w ** 2).sum(-1).mean().item() / 2


def test_fewer_distinct_values_than_centroids_is_exact_and_finite():
    w = torch.tensor([0.5, -1.0, 0.5, 2.0, -1.0] * 20).view(1, -1, 1)
    for groups in (w, w.view(4, -1, 1)):
        codebook, idx = cluster(groups, 4)
        assert torch.isfinite(codebook).all()
        assert torch.equal(torch.gather(codebook, 1, idx[..., None]), groups)  # zero error
        assert len(torch.unique(codebook)) == 3  # the unused entries repeat used centroids


@pytest.mark.parametrize("groups", [1, 3])
def test_restarts_pick_the_best_run(groups):
    w = laplace(groups, 3000, 1, seed=4)
    assert mse(w, 4, n_init=8) <= mse(w, 4, n_init=1) * 1.001  # (per tensor: chosen on the histogram)


def test_weighted_kmeans_lowers_the_weighted_error():
    """Sensitivity weights pull centroids toward the weights that matter: their weighted error
    falls below plain k-means' (which minimises the unweighted one), per tensor and per channel."""
    w = laplace(4, 2000, 1, seed=5)
    sens = torch.from_numpy((1 + 100 * (np.random.default_rng(6).random((4, 2000)) < 0.02)).astype(np.float32))
    for groups, s in ((w, sens), (w.reshape(1, -1, 1), sens.reshape(1, -1))):
        def weighted_error(codebook, idx):
            return ((torch.gather(codebook[..., 0], 1, idx) - groups[..., 0]) ** 2 * s).sum().item()
        assert weighted_error(*cluster(groups, 3, weights=s)) < 0.9 * weighted_error(*cluster(groups, 3))


@pytest.mark.parametrize("d", [1, 2])
def test_error_feedback_lowers_the_layer_output_error(d):
    """GPTQ-style assignment with the codebook fixed: on correlated inputs the output error
    ||(W - Q) X|| falls well below nearest-centroid assignment's (inputs of low effective rank, as
    LLM activations are); weights kept exact get finite values."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(512, 16, generator=gen) @ torch.randn(16, 64, generator=gen) + 0.1 * torch.randn(512, 64, generator=gen)
    w = laplace(32, 64, seed=8)
    codebook, idx = cluster(w.view(32, -1, d), 2)
    gram = x.T.double() @ x.double()
    err = lambda i: ((w - torch.gather(codebook, 1, i[..., None].expand(-1, -1, d)).reshape(32, 64)) @ x.T).norm()
    fed, _ = clustering.assign(w, codebook, 1, clustering.GramFactors(gram))
    assert err(fed) < 0.8 * err(idx)
    exact = torch.zeros_like(w, dtype=torch.bool)
    exact[3, 5] = exact[10, 60] = True
    _, values = clustering.assign(w, codebook, 1, clustering.GramFactors(gram), exact)
    assert values.shape == (2,) and torch.isfinite(values).all()


def test_row_scales_let_one_codebook_serve_rows_of_any_magnitude():
    """Rows of the same shape but magnitudes 100x apart: one shared codebook of raw values spends
    its centroids on the large rows, one of normalised values (``row_scale``) serves every row;
    the layer then computes with each row's stored scale, and the weights kept aside stay exact."""
    from wscompress.methods.kmeans import KMeansConfig, palettize

    w = laplace(32, 64, seed=3) * torch.logspace(-1, 1, 32)[:, None]
    lin = torch.nn.Linear(64, 32, bias=False)
    lin.weight.data = w
    common = {"bits": 4, "cluster_dim": 2, "granularity": "per_tensor", **FAST, "outliers": 0.01}
    raw, scaled = (palettize(lin, KMeansConfig(**common, row_scale=s)) for s in (False, True))
    rel = lambda layer: (((layer.dense_weight() - w) / w.norm(dim=1, keepdim=True)) ** 2).mean().item()  # noqa: E731
    assert rel(scaled) < 0.5 * rel(raw)  # each row's error relative to its own size
    assert ((scaled.dense_weight() - w) ** 2).mean() <= 1.05 * ((raw.dense_weight() - w) ** 2).mean()
    torch.testing.assert_close(scaled.scale, w.pow(2).mean(1).sqrt())  # each row's RMS (here stored in fp32)
    pos = scaled.outlier_index.long()
    assert torch.equal(scaled.dense_weight().flatten()[pos], w.flatten()[pos])


def _outputs(model, x):
    with torch.no_grad():
        return model(input_ids=x).logits


def _check_file_size(path, model):
    """The weights file is exactly header + every distinct tensor; palettized layers take
    exactly the bits their report claims."""
    raw = (path / storage.WEIGHTS).read_bytes()
    header = struct.unpack("<Q", raw[:8])[0]
    tensors, _ = storage.unique_tensors(model)
    assert len(raw) == 8 + header + sum(t.numel() * t.element_size() for t in tensors.values())
    palettized = {n: m for n, m in model.named_modules() if isinstance(m, PalettizedLinear)}
    on_disk = sum(t.numel() * t.element_size() for n, t in tensors.items() if n.rpartition(".")[0] in palettized
                  and not n.endswith("bias"))
    assert on_disk * 8 == sum(m.storage_bits() for m in palettized.values())


@pytest.mark.parametrize("stage", [
    {"bits": 4},
    {"bits": 3, "granularity": "per_tensor", **FAST},
    {"bits": 2, "granularity": "grouped", "group_size": 16},
    {"bits": 4, "cluster_dim": 2},
    {"bits": 3, "entropy_coding": True, **FAST},
    {"bits": 5, "granularity": "per_channel", "entropy_coding": True, "cluster_dim": 4, "outliers": 0.01},
    {"bits": 4, "granularity": "grouped", "group_size": 16, "cluster_dim": 2, "row_scale": True, "outliers": 0.01},
])
def test_stage_save_load_identical_outputs_and_honest_size(stage, tokenizer, tmp_path):
    model = tiny_model("llama")
    x = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(0))
    dense = _outputs(model, x)
    (report,) = wscompress.compress(model, [{"method": "kmeans", **stage}], tokenizer, CALIB)
    pal = [m for m in model.modules() if isinstance(m, PalettizedLinear)]
    assert len(pal) == 4 * 7 == report["layers"]
    out = _outputs(model, x)
    assert torch.isfinite(out).all() and (out - dense).abs().max() < 2.0
    storage.save(model, tokenizer, tmp_path / "m")
    loaded, _ = storage.load(tmp_path / "m")
    assert torch.equal(_outputs(loaded, x), out)
    _check_file_size(tmp_path / "m", loaded)
    d = stage.get("cluster_dim", 1)
    value_bits = 32 if stage.get("codebook_dtype") == "float32" else 16
    for row, layer in zip(report["per_layer"], pal):
        n = layer.in_features * layer.out_features
        assert layer.outliers == round(stage.get("outliers", 0.0025) * n)
        codebook_bits = value_bits * layer.codebook.numel() + (value_bits + 32) * layer.outliers
        codebook_bits += value_bits * layer.out_features * stage.get("row_scale", False)
        if stage.get("entropy_coding"):
            assert row["entropy_bits"] <= row["huffman_bits"] < row["entropy_bits"] + 1
        else:  # exactly bits per index plus the codebooks and the weights kept aside
            assert row["bits_per_weight"] == pytest.approx(stage["bits"] / d + codebook_bits / n)
    if stage.get("entropy_coding"):
        assert report["entropy_bits"] <= report["huffman_bits"] < report["entropy_bits"] + 1
    manifest = json.loads((tmp_path / "m" / "config.json").read_text())["compression"]
    assert {e["type"] for e in manifest["modules"].values()} == {"PalettizedLinear"}


def test_report_formula_and_errors():
    model = tiny_model("llama")
    q = model.model.layers[0].self_attn.q_proj.weight.detach().clone()
    (report,) = wscompress.compress(model, [{"method": "kmeans", "bits": 4, "granularity": "per_tensor", **FAST,
                                              "targets": [r"layers\.0\.self_attn\.q_proj"]}])
    (row,) = report["per_layer"]
    n = q.numel()
    assert row["ratio_formula"] == pytest.approx(32 * n / (32 * 16 + n * 4))
    layer = model.model.layers[0].self_attn.q_proj
    assert row["mse"] == pytest.approx(((layer.dense_weight() - q) ** 2).mean().item())
    assert row["clusters_used"] == 16


def test_default_is_one_codebook_per_output_channel():
    """Per-tensor 4-bit destroys real LLMs (SmolLM2: ppl ~6e4 against ~18 per channel)."""
    from wscompress.methods.kmeans import KMeansConfig
    from wscompress.recipe.schema import DKMConfig

    assert KMeansConfig().granularity == DKMConfig().granularity == "per_channel"
    model = tiny_model("llama")
    wscompress.compress(model, [{"method": "kmeans", **FAST, "targets": [r"layers\.0\.self_attn\.q_proj"]}])
    assert model.model.layers[0].self_attn.q_proj.codebook.shape == (64, 16, 1)


def test_per_channel_centroids_follow_their_rows():
    model = tiny_model("llama")
    layer = model.model.layers[1].mlp.down_proj
    w = layer.weight.detach().clone()
    wscompress.compress(model, [{"method": "kmeans", "bits": 2, "granularity": "per_channel", **FAST,
                                 "targets": ["layers.1.mlp.down_proj"]}])
    pal = model.model.layers[1].mlp.down_proj
    assert pal.codebook.shape == (64, 4, 1)
    rebuilt = pal.dense_weight()
    for r in (0, 17, 63):  # every value of row r is one of row r's own 4 centroids
        assert set(rebuilt[r].tolist()) <= set(pal.codebook[r, :, 0].tolist())
    assert ((rebuilt - w) ** 2).mean() < (w ** 2).mean() / 4


def test_gpt2_conv1d_and_untied_lm_head(tokenizer, tmp_path):
    for kind, targets in (("gpt2", []), ("llama_mha", ["lm_head", r"mlp\."])):
        model = tiny_model(kind)
        x = torch.randint(0, 512, (1, 16))
        (report,) = wscompress.compress(model, [{"method": "kmeans", "bits": 6, "targets": targets}], tokenizer, CALIB)
        # lm_head lies outside the decoder layers that calibration covers: clustered without statistics
        assert report["without_statistics"] == (["lm_head"] if kind == "llama_mha" else [])
        storage.save(model, tokenizer, tmp_path / kind)
        loaded, _ = storage.load(tmp_path / kind)
        assert torch.equal(_outputs(loaded, x), _outputs(model, x))
        assert report["max_rel_error"] < 0.05


@pytest.mark.parametrize("outliers", [0.0, 0.01])
def test_tied_embedding_and_head_are_one_palettized_table(tokenizer, tmp_path, outliers):
    """Targeting the head of a tied pair palettizes the matrix once: the LM head is the table
    module (LUT matmul) and the embedding looks up rows in it; saved once, tied after loading,
    and a dense export gives stock transformers the same model."""
    from transformers import AutoModelForCausalLM

    from wscompress.model.forms.wscompress_embeddings import PalettizedEmbedding

    model = tiny_model("llama")  # tied
    stage = {"method": "kmeans", "bits": 4, "targets": ["lm_head", r"layers\.0\.mlp"], "outliers": outliers}
    wscompress.compress(model, [stage], tokenizer, CALIB)
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    assert isinstance(emb, PalettizedEmbedding) and emb.table is head and isinstance(head, PalettizedLinear)
    for shape in [(2, 7), (2, 1), (1, 1)]:  # prefill: each distinct row once; a decode step's few: static shapes
        ids = torch.randint(0, 512, shape)
        ids[0, 0] = head.outlier_index[0] // 64 if outliers else 0  # a row with an outlier
        assert torch.equal(emb(ids), head.dense_weight()[ids])  # the row lookup decodes exactly the table's rows
    x = torch.randint(0, 512, (2, 16))
    saved = storage.save(model, tokenizer, tmp_path / "m")
    with safe_open(str(tmp_path / "m" / storage.WEIGHTS), "pt") as f:
        assert not any(k.startswith("lm_head") for k in f.keys())  # stored under the embedding's name only
    assert saved["params"] == 180_800  # the table counted once, as the weights it packs
    assert saved["tensor_bytes"] < 4 * 180_800 - 2 * 512 * 64  # the 512 x 64 float32 table: under 2 bytes a weight
    loaded, _ = storage.load(tmp_path / "m")
    assert loaded.get_input_embeddings().table is loaded.get_output_embeddings()
    torch.testing.assert_close(_outputs(loaded, x), _outputs(model, x), rtol=0, atol=1e-6)
    storage.export_dense(loaded, tokenizer, tmp_path / "dense")
    stock = AutoModelForCausalLM.from_pretrained(tmp_path / "dense")
    torch.testing.assert_close(_outputs(stock, x), _outputs(model, x), rtol=1e-5, atol=kernel_tolerance(model))


def test_values_are_held_as_stored_whatever_the_model_computes_in():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(32, 64, generator=gen)
    codebook, idx = cluster(w.reshape(32, -1, 1), 3)
    layer = PalettizedLinear.from_clusters(codebook, idx.reshape(32, 64), None, codebook_dtype="float16",
                                           outliers=(torch.arange(0, 2048, 97), torch.randn(22, generator=gen)),
                                           scale=torch.rand(32, generator=gen) + 0.5)
    held = [layer.codebook, layer.outlier_value, layer.scale]
    assert all(t.dtype == torch.float16 for t in held) and layer.trainable_parameters() == []
    assert not list(layer.parameters())  # so a model's dtype (its first floating parameter's) is never theirs
    x = torch.randn(3, 64, generator=gen)
    want = layer(x)
    assert want.dtype == layer.dense_weight().dtype == torch.float32
    layer.to(torch.bfloat16)  # computes in bfloat16, holds the values as stored
    assert [t.dtype for t in (layer.codebook, layer.outlier_value, layer.scale)] == [torch.float16] * 3
    assert layer(x.bfloat16()).dtype == layer.dense_weight().dtype == layer.rows(torch.tensor([1, 5])).dtype == torch.bfloat16
    layer.to(torch.float32)
    torch.testing.assert_close(layer(x), want, rtol=0, atol=0)  # nothing was rounded on the way
    trained = layer.train_values()
    assert [p.dtype for p in trained] == [torch.float32] * 3 and all(isinstance(p, torch.nn.Parameter) for p in trained)
    layer.to(torch.float32)  # a parameter being trained stays float32
    assert layer.codebook.dtype == torch.float32
    layer.train_values(False)
    assert layer.codebook.dtype == torch.float16 and layer.trainable_parameters() == []


@pytest.mark.parametrize("row_scale", [False, True])
def test_finetune_method_mode_trains_the_centroids_and_the_weights_kept_aside(tmp_path, tokenizer, row_scale):
    model = tiny_model("llama")  # with the shipped recipes' float16 head, which stays as it is
    wscompress.compress(model, [{"method": "kmeans", "bits": 2, **FAST, "outliers": 0.01, "row_scale": row_scale},
                                {"method": "half"}])
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model, _ = finetune(model, tokenizer, recipe(tmp_path, mode="method"))
    layer = model.model.layers[0].mlp.up_proj
    assert layer.trainable_parameters() == [] and layer.codebook.dtype == getattr(torch, layer.codebook_dtype)  # held again
    assert layer.train_values() == [layer.codebook, layer.outlier_value] + [layer.scale] * row_scale
    layer.train_values(False)
    after = model.state_dict()
    moved = {k for k in after if not torch.equal(after[k], before[k])}
    trained = ("codebook", "outlier_value") + ("scale",) * row_scale
    assert moved and all(k.endswith(trained) for k in moved)  # indices and positions stay
    assert all(any(k.endswith(t) for k in moved) for t in trained)
    storage.save(model, tokenizer, tmp_path / "m")  # the trained values are what the file holds
    x = torch.randint(0, 512, (2, 16))
    torch.testing.assert_close(_outputs(storage.load(tmp_path / "m")[0], x), _outputs(model, x), rtol=0, atol=1e-6)


@pytest.mark.parametrize("layout", [{"granularity": "grouped", "group_size": 16, "cluster_dim": 2},
                                    {"granularity": "per_tensor", "cluster_dim": 2}, {"granularity": "per_channel"}])
def test_blocks_of_rows_with_their_own_gram_matrices(layout):
    """``objective: fisher`` hands palettize one Gram matrix a block of rows: blocks that all hold
    the layer's one matrix give exactly its result (the codebook's groups sliced right), and a
    block whose outputs count 10^4 times less gets almost none of the weights kept aside."""
    from wscompress.methods.kmeans import KMeansConfig, fisher_blocks, palettize

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(256, 32, generator=gen) @ torch.randn(32, 32, generator=gen)
    gram = (x.T @ x).double()
    layer = torch.nn.Linear(32, 64, bias=False)
    cfg = KMeansConfig(bits=3, outliers=0.02, row_scale=True, **layout)
    assert fisher_blocks(cfg, 64) == 4 and fisher_blocks(cfg.model_copy(update={"fisher_blocks": 3}), 64) == 2
    one = palettize(layer, cfg, gram)
    four = palettize(layer, cfg, [clustering.GramFactors(gram)] * 4)
    torch.testing.assert_close(four.dense_weight(), one.dense_weight(), rtol=0, atol=0)
    apart = palettize(layer, cfg, [clustering.GramFactors(gram), clustering.GramFactors(gram * 1e-4)])
    rows = apart.outlier_index.long() // 32  # flat positions in the (64, 32) weight
    assert len(rows) == 41 and (rows < 32).sum() > 4 * (rows >= 32).sum()


def test_fisher_objective_runs_the_gradient_pass_and_compresses(tokenizer, monkeypatch):
    """objective: fisher takes the output gradients once, on the refit's sequences, and palettizes
    every decoder linear on its blocks' weighted Gram matrices: another model than the layer
    objective's, of the same size."""
    import wscompress.methods.kmeans as kmeans_module

    calls = []
    fisher = kmeans_module.output_fisher
    monkeypatch.setattr(kmeans_module, "output_fisher", lambda *a, **k: calls.append(a[1]) or fisher(*a, **k))
    stage = {"method": "kmeans", "bits": 4, "cluster_dim": 2, "granularity": "grouped", "group_size": 16, "row_scale": True}
    ids = torch.randint(0, 500, (2, 32), generator=torch.Generator().manual_seed(4))
    models = {}
    for objective in ("layer", "fisher"):
        models[objective] = tiny_model("llama")
        wscompress.compress(models[objective], [{**stage, "objective": objective}], tokenizer, CALIB)
    assert len(calls) == 1 and len(calls[0]) == 28 and set(calls[0].values()) == {4, 2}  # k/v: 32 rows, 2 blocks of 16
    layers = [{n: m for n, m in models[o].named_modules() if isinstance(m, PalettizedLinear)} for o in models]
    assert layers[0].keys() == layers[1].keys() and any(
        not torch.equal(layers[0][n].dense_weight(), layers[1][n].dense_weight()) for n in layers[0])
    with torch.no_grad():
        assert torch.isfinite(models["fisher"](ids).logits).all()


@pytest.mark.parametrize("stage,where", [
    ({"bits": 0}, "bits"), ({"bits": 9}, "bits"), ({"granularity": "grouped"}, "group_size"),
    ({"group_size": 4}, "group_size"), ({"cluster_dim": 0}, "cluster_dim"), ({"init": "random"}, "init"),
    ({"objective": "fisher", "refit": False}, "objective: fisher"),
])
def test_bad_options_rejected_up_front(stage, where):
    with pytest.raises(UsageError, match=where):
        load_recipe(data={"compress": [{"method": "kmeans", **stage}]})


@pytest.mark.parametrize("stage,match", [
    ({"cluster_dim": 5}, "cluster_dim=5 does not divide"),
    ({"granularity": "grouped", "group_size": 48}, "group_size=48 does not divide"),
    ({"targets": ["lm_head"], "bits": 3, "cluster_dim": 16}, "whole bytes"),
])
def test_bad_shapes_refused_before_anything_changes(stage, match):
    model = tiny_model("llama")
    before = {n: p.clone() for n, p in model.state_dict().items()}
    with pytest.raises(UsageError, match=match) as err:
        wscompress.compress(model, [{"method": "kmeans", **FAST, **stage}])
    assert err.value.fix
    assert not any(isinstance(m, PalettizedLinear) for m in model.modules())
    assert all(torch.equal(before[n], p) for n, p in model.state_dict().items())


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("kmeans*.yaml")) + sorted((REPO / "configs").glob("dkm*.yaml")))
def test_shipped_recipes_validate(path):
    from wscompress.recovery.dkm import kmeans_stage

    recipe = load_recipe(path)
    if recipe.finetune is not None and recipe.finetune.mode == "dkm":
        assert kmeans_stage(recipe.finetune.dkm).bits in range(1, 9)
    else:
        assert recipe.compress[0].method == "kmeans"


def test_dense_export_loads_in_stock_transformers(tokenizer, tmp_path):
    from transformers import AutoModelForCausalLM

    model = tiny_model("llama")
    wscompress.compress(model, [{"method": "kmeans", "bits": 3, "granularity": "per_channel", "entropy_coding": True}],
                        tokenizer, CALIB)
    storage.export_dense(model, tokenizer, tmp_path / "dense")
    dense = AutoModelForCausalLM.from_pretrained(tmp_path / "dense").eval()
    x = torch.randint(0, 512, (1, 16))
    assert torch.allclose(_outputs(dense, x), _outputs(model, x), atol=1e-5)


def test_basis_sharing_then_kmeans_saves_both_savings(tokenizer, tmp_path):
    """kmeans palettizes the factors of a low-rank model: each shared basis once (still shared
    after reload), every coefficient matrix; the file shrinks again, reloads exactly and exports."""
    from transformers import AutoModelForCausalLM

    model = tiny_model("llama", layers=4)
    x = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(0))
    wscompress.compress(model, [{"method": "basis_sharing", "ratio": 0.3, "allocation": "uniform", "refit": False}], tokenizer, CALIB)
    low_rank = storage.save(model, tokenizer, tmp_path / "bs")
    (report,) = wscompress.compress(model, [{"method": "kmeans", "bits": 4}],
                                    tokenizer, CALIB)
    q = [layer.self_attn.q_proj for layer in model.model.layers]
    assert all(isinstance(m.basis, PalettizedLinear) and isinstance(m.coeff, PalettizedLinear) for m in q)
    assert q[0].basis is q[1].basis and q[2].basis is q[3].basis
    # per pair of layers: 3 shared bases (q, gate, up) and their 2 x 3 coefficients, 2 x 4 private factor pairs
    assert report["layers"] == 2 * (3 + 2 * 3 + 2 * 4 * 2) and not report["without_statistics"]
    out = _outputs(model, x)
    both = storage.save(model, tokenizer, tmp_path / "both")
    assert both["file_bytes"] < 0.6 * low_rank["file_bytes"]
    loaded, _ = storage.load(tmp_path / "both")
    assert torch.equal(_outputs(loaded, x), out)
    assert loaded.model.layers[0].self_attn.q_proj.basis is loaded.model.layers[1].self_attn.q_proj.basis
    _check_file_size(tmp_path / "both", loaded)
    storage.export_dense(loaded, tokenizer, tmp_path / "dense")
    stock = AutoModelForCausalLM.from_pretrained(tmp_path / "dense").eval()
    assert torch.allclose(_outputs(stock, x), out, atol=kernel_tolerance(model))


@pytest.mark.parametrize("target", ["layer", "function"])
def test_refit_palettizes_each_module_on_the_inputs_it_finally_receives(tokenizer, target):
    """refit goes module by module in forward order: each module is palettized, with the Gram
    matrix G of the inputs X' the finished model feeds it as its statistics, for the weight that
    best reproduces its target on them: the original module on what it reads in the original
    layer fed the same layer input (layer) or on X' itself (function, which leaves W as it is)."""
    from wscompress.io import data
    from wscompress.maths import linalg
    from wscompress.methods.kmeans import KMeansConfig, palettize

    base, model = tiny_model("llama"), tiny_model("llama")
    stage = {"method": "kmeans", "bits": 3, "refit_target": target}
    wscompress.compress(model, [stage], tokenizer, {**CALIB, "dtype": "float32"})  # exact float32 references
    names = [n for n, m in model.named_modules() if isinstance(m, PalettizedLinear)]
    assert len(names) == 4 * 7
    batches = data.calibration_batches(tokenizer, CALIB["dataset"], CALIB["num_samples"], CALIB["seq_len"],
                                       CALIB["batch_size"], seed=0)
    xs = final_inputs(model, names, batches)
    refs = layer_reference_inputs(model, base, names, batches) if target == "layer" else xs
    assert (target == "layer") == any(not torch.allclose(refs[n], xs[n]) for n in names)  # o, gate/up, down: X ≠ X'
    cfg = KMeansConfig(**stage)
    for n in names:
        original, x, ref = base.get_submodule(n), xs[n], refs[n]
        w = original.weight.detach()
        best = linalg.solve_coefficients(x.T @ x, w.double() @ (ref.T @ x), cfg.ridge, w).float()
        want = palettize(original, cfg, x.T @ x, best)
        got = model.get_submodule(n)
        assert (got.index_matrix() == want.index_matrix()).float().mean() > 0.99, n
        torch.testing.assert_close(got.codebook, want.codebook, rtol=1e-3, atol=1e-4, msg=n)


@pytest.mark.slow
def test_refit_brings_real_layers_closer_to_the_original(smollm2):
    """On real weights (SmolLM2's first 2 layers, 3 bits), palettizing each module on the
    compressed model's own inputs for the original layer's output (the default) brings the last
    hidden states closer to the original's than palettizing on the original model's statistics,
    on the calibration text and on held-out text."""
    import copy

    model, tok = smollm2
    original, texts = first_layers(model, 2), real_texts(tok)
    errors = {}
    for refit in (False, True):
        short = copy.deepcopy(original)
        wscompress.compress(short, [{"method": "kmeans", "bits": 3, "refit": refit}], tok,
                            {"dataset": WIKI_TRAIN, "num_samples": 32, "seq_len": 256, "seed": 0})
        errors[refit] = [hidden_state_error(short, original, t) for t in texts]
    for text in (0, 1):
        assert errors[True][text] < errors[False][text]


@pytest.mark.parametrize("refit, bar", [(False, "kmeans 8-bit: matrices"), (True, "kmeans 8-bit: decoder layers clustered and refit")])
def test_progress_shows_the_work_done(refit, bar, monkeypatch, tokenizer):
    """One-shot k-means draws a bar that counts what it does (matrices, or the refit pass's decoder
    layers) with a time estimate, and no empty bar."""
    import io

    from rich.console import Console

    from wscompress.io import ui

    out = io.StringIO()
    monkeypatch.setattr(ui, "console", Console(file=out, width=160, force_terminal=True, color_system=None))
    monkeypatch.setattr(ui, "QUIET", False)
    wscompress.compress(tiny_model("llama"), [{"method": "kmeans", "bits": 8, "refit": refit, "sensitivity": "none",
                                    "error_feedback": False}], tokenizer,
             {"dataset": "pydoc", "num_samples": 4, "seq_len": 32, "batch_size": 4})
    text = out.getvalue()
    assert bar in text and ("28/28" if not refit else "4/4") in text and "0/0" not in text, text[-500:]
