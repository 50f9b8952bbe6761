"""A size budget over a k-means stage: the exact multiple-choice knapsack (maths.knapsack), each
layout's bytes known before clustering, the budget met to the byte in the written folder, and
budgets no menu can meet refused before any work."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
from safetensors import safe_open
from torch import nn

import wscompress
from wscompress.errors import UsageError
from wscompress.io import storage
from wscompress.maths.knapsack import choose
from wscompress.methods.kmeans import MENU, KMeansConfig, layout_bytes, palettize
from wscompress.model.forms.wscompress_format import VARIANT
from wscompress.model.forms.wscompress_palettized import PalettizedLinear
from wscompress.recipe.load import load_recipe

from conftest import tiny_model

CALIBRATION = {"dataset": "pydoc", "num_samples": 8, "seq_len": 64, "batch_size": 4}
QUICK = {"iterations": 20, "sensitivity_samples": 2, "outliers": 0}  # a tiny model's stage, in seconds


@pytest.fixture(autouse=True)
def own_measurements(tmp_path, monkeypatch):
    """Each test measures for itself (none reads what an earlier run kept)."""
    from wscompress.methods import kmeans

    monkeypatch.setattr(kmeans, "cache_dir", lambda: tmp_path / "cache")
MIXED = [{"bits": 2, "granularity": "per_channel"}, {"bits": 3, "granularity": "per_channel"},
         {"bits": 4, "granularity": "per_channel"}, {"bits": 6, "cluster_dim": 2, "granularity": "grouped", "group_size": 16}]


def brute_force(costs: np.ndarray, sizes: np.ndarray, budget: int) -> float:
    """The least summed cost over every combination that fits (inf where none does)."""
    rows = range(len(costs))
    return min((sum(costs[i, c[i]] for i in rows) for c in itertools.product(range(costs.shape[1]), repeat=len(costs))
                if sum(sizes[i, c[i]] for i in rows) <= budget), default=np.inf)


def test_the_solver_is_exact_against_brute_force():
    rng = np.random.default_rng(0)
    solved = 0
    for _ in range(200):
        n, m = rng.integers(1, 6), rng.integers(1, 5)
        sizes, costs = rng.integers(1, 60, (n, m)), rng.random((n, m))
        costs[rng.random((n, m)) < 0.1] = np.inf  # a choice this matrix may not take
        budget = int(rng.integers(sizes.min(1).sum(), sizes.max(1).sum() + 5))
        best = brute_force(costs, sizes, budget)
        if not np.isfinite(best):
            with pytest.raises(UsageError):
                choose(costs, sizes, budget, quantum=1)
            continue
        got = choose(costs, sizes, budget, quantum=1)
        assert sum(sizes[i, j] for i, j in enumerate(got)) <= budget
        assert sum(costs[i, j] for i, j in enumerate(got)) == pytest.approx(best, abs=1e-12)
        solved += 1
    assert solved > 150


def test_a_coarse_quantum_still_fits_the_budget_in_bytes():
    rng = np.random.default_rng(1)
    sizes, costs = rng.integers(1000, 5000, (40, 4)), rng.random((40, 4))
    budget = int(sizes.mean(1).sum())
    got = choose(costs, sizes, budget, quantum=97)
    assert sum(sizes[i, j] for i, j in enumerate(got)) <= budget
    assert sum(costs[i, j] for i, j in enumerate(got)) < costs.max(1).sum()
    with pytest.raises(UsageError, match="below the smallest choices"):
        choose(costs, sizes, int(sizes.min(1).sum()) - 1)


@pytest.mark.parametrize("layout", MENU + MIXED + [{"bits": 4, "granularity": "per_tensor", "outliers": 0.01}])
def test_layout_bytes_are_the_stored_bytes(layout):
    """What the budget counts before clustering is what the palettized layer stores."""
    cfg = KMeansConfig.model_validate({"sensitivity": "none", "error_feedback": False, "iterations": 5,
                                       "group_size": None, **layout})
    linear = nn.Linear(128, 64, bias=False)
    assert layout_bytes(64, 128, cfg) * 8 == palettize(linear, cfg).storage_bits()


def test_a_budget_is_met_to_the_byte_in_the_written_folder(tokenizer, tmp_path):
    model = tiny_model("llama")
    weights = sum(m.weight.numel() for n, m in model.named_modules() if isinstance(m, nn.Linear) and ".layers." in n)
    report = wscompress.compress(model, [{"method": "kmeans", "budget": {"bits_per_weight": 3.2}, "menu": MIXED,
                                          **QUICK}], tokenizer, CALIBRATION)[0]
    budget = report["budget"]
    assert budget["bytes"] == int(3.2 * weights // 8) and budget["used_bytes"] <= budget["bytes"]
    chosen = {name: MIXED[j] for name, j in budget["choices"].items()}
    assert len({str(sorted(v.items())) for v in chosen.values()}) > 1  # the matrices got different layouts
    layers = {n: m for n, m in model.named_modules() if isinstance(m, PalettizedLinear)}
    assert set(layers) == set(chosen)
    for name, layer in layers.items():  # each has the layout chosen for it
        assert (layer.bits, layer.cluster_dim) == (chosen[name]["bits"], chosen[name].get("cluster_dim", 1))
    storage.save(model, tokenizer, tmp_path / "model")
    stored = 0
    with safe_open(tmp_path / "model" / f"model.{VARIANT}.safetensors", "pt") as f:
        for key in f.keys():
            if key.rpartition(".")[0] in layers:
                stored += f.get_tensor(key).nbytes
    assert stored == budget["used_bytes"] <= budget["bytes"]
    assert report["bits_per_weight"] == pytest.approx(8 * stored / weights)


def test_budgets_no_menu_can_meet_are_refused_before_any_work():
    model = tiny_model("llama")

    def stage(**options) -> KMeansConfig:
        return load_recipe(data={"compress": [{"method": "kmeans", **options}]}).compress[0]

    stage(budget={"bits_per_weight": 4.5}).check(model)  # (a tiny model: codebooks weigh) each target has a layout of the default menu that tiles it
    with pytest.raises(UsageError, match="below the menu's smallest layouts"):
        stage(budget={"bits_per_weight": 1.0}, menu=MIXED[:2]).check(model)
    with pytest.raises(UsageError, match="no smaller than the dense targets"):
        stage(budget={"bytes": "10MB"}).check(model)
    with pytest.raises(UsageError, match="cluster_dim=3 does not divide"):  # no layout tiles them
        stage(budget={"bits_per_weight": 3.0}, menu=[{"bits": 6, "cluster_dim": 3}]).check(model)
    for options, problem in (({"menu": MIXED}, "give budget too"),
                             ({"budget": {"bits_per_weight": 3.0, "bytes": "1MB"}}, "one of bits_per_weight or bytes"),
                             ({"budget": {"bits_per_weight": 3.0}, "entropy_coding": True}, "entropy_coding: false"),
                             ({"budget": {"bits_per_weight": 3.0}, "menu": [{"bits": 4, "init": "linear"}]}, "a mapping of")):
        with pytest.raises(UsageError, match=problem):
            stage(**options)


def test_the_report_and_the_card_picture_each_matrix_bits(tmp_path, tiny_dir):
    import yaml
    from typer.testing import CliRunner

    from wscompress.cli import app

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({
        "model": {"path": str(tiny_dir("llama"))}, "output": {"dir": str(tmp_path / "out")}, "calibration": CALIBRATION,
        "compress": [{"method": "kmeans", "budget": {"bits_per_weight": 3.2}, "menu": MIXED, "refit": False, **QUICK}]}))
    done = CliRunner().invoke(app, ["compress", str(recipe), "-q"])
    assert done.exit_code == 0, done.output
    stage = json.loads((tmp_path / "out" / "reports" / "compress.json").read_text())["stages"][0]
    for text in ((tmp_path / "out" / "reports" / "compress.md").read_text(),
                 (tmp_path / "out" / "model" / "README.md").read_text()):
        picture = text[text.index("## Bits a weight each matrix got"):]
        assert "| layer | q_proj | k_proj | v_proj | o_proj | gate_proj | up_proj | down_proj |" in picture
        for row in stage["per_layer"]:  # every matrix's bits in its layer's row
            layer, part = row["layer"].split(".")[2], row["layer"].rpartition(".")[2]
            line = next(li for li in picture.splitlines() if li.startswith(f"| {layer} |"))
            header = next(li for li in picture.splitlines() if li.startswith("| layer |"))
            column = [c.strip() for c in header.split("|")].index(part)
            assert [c.strip() for c in line.split("|")][column] == f"{row['bits_per_weight']:.2f}"


def test_a_second_budget_reuses_the_measurements(tokenizer, tmp_path, monkeypatch):
    """The measurements are kept (keyed by the calibration statistics' keys, the stage's options
    and the menu): another budget on the same model and data solves without measuring again,
    and a changed option measures anew."""
    from wscompress.methods import kmeans

    calls = []
    measure = kmeans.measure
    monkeypatch.setattr(kmeans, "measure", lambda *args: calls.append(1) or measure(*args))

    def run(bits: float, **options) -> dict:
        stage = {"method": "kmeans", "budget": {"bits_per_weight": bits}, "menu": MIXED, "refit": False, **QUICK, **options}
        return wscompress.compress(tiny_model("llama"), [stage], tokenizer, CALIBRATION)[0]["budget"]

    first, second = run(3.2), run(3.6)
    assert len(calls) == 1 and second["measurements"] == first["measurements"]
    assert first["used_bytes"] <= first["bytes"] < second["bytes"] and second["used_bytes"] <= second["bytes"]
    assert second["estimated_cost"] <= first["estimated_cost"]  # more bytes never cost more
    run(3.2, damp=0.05)
    assert len(calls) == 2


def test_measurement_palettizes_whole_codebook_groups_of_large_matrices():
    """The measurement's sample: every 4th block of rows, a block whole groups of every layout
    that tiles the matrix; a small matrix in full; the sampled cost, scaled, near the whole's."""
    import torch

    from wscompress.methods.kmeans import MEASURE_EVERY, measured_rows

    by_64, by_96 = (KMeansConfig(bits=4, granularity="grouped", group_size=g) for g in (64, 96))
    rows = measured_rows(1536, [by_64, KMeansConfig(bits=4, granularity="per_tensor")])
    assert rows.numel() == 1536 // MEASURE_EVERY
    starts = rows.view(-1, 64)[:, 0]
    assert torch.equal(rows.view(-1, 64), starts[:, None] + torch.arange(64)) and torch.equal(starts % 256, 0 * starts)
    assert measured_rows(1536, [by_64, by_96]).view(-1, 192).shape[0] == 2  # 8 blocks of 192 rows, every 4th
    assert measured_rows(576, [by_64, by_96]) is None and measured_rows(192, [by_64]) is None

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(2048, 64, generator=gen) * torch.rand(2048, 1, generator=gen)  # rows of differing scales
    x = torch.randn(512, 64, generator=gen)
    gram, layout = x.T @ x, KMeansConfig(bits=3, granularity="grouped", group_size=64, iterations=20, outliers=0)

    def cost(weight: torch.Tensor) -> float:
        delta = (palettize(nn.Module(), layout, gram, weight).dense_weight().detach() - weight).double()
        return (delta @ gram.double() * delta).sum().item()

    sample = measured_rows(2048, [layout])
    assert cost(w[sample]) * 2048 / sample.numel() == pytest.approx(cost(w), rel=0.2)


def test_calibrate_saves_the_sensitivities_a_budget_weighs(tmp_path, tiny_dir, monkeypatch):
    """`wscompress calibrate` of a recipe with a budget keeps the output sensitivities beside the
    Gram matrices, so the budget's measurement reads them instead of computing them again."""
    from wscompress.io.checkpoints import load_model
    from wscompress.methods.kmeans import every_use
    from wscompress.model.arch import target_layers
    from wscompress.pipeline import calibration
    from wscompress.pipeline.context import Context
    from wscompress.workflow import stats_dir, step_calibrate

    stage = {"method": "kmeans", "budget": {"bits_per_weight": 3.5}, "menu": MIXED, **QUICK}
    recipe = load_recipe(data={"model": {"path": str(tiny_dir("llama"))}, "calibration": CALIBRATION,
                               "compress": [stage], "output": {"dir": str(tmp_path / "run")}})
    step_calibrate(recipe)
    model, tok = load_model(recipe.model)
    cfg = recipe.compress[0]
    names = every_use(model, target_layers(model, cfg))
    monkeypatch.setattr(calibration, "output_sensitivity", lambda *a, **k: pytest.fail("sensitivities were recomputed"))
    stats = Context(recipe.calibration, tok, saved=stats_dir(recipe)).stats(model, names, cfg.sensitivity_samples)
    assert set(names) <= set(stats.sensitivity) and all(v > 0 for v in stats.sensitivity.values())


def test_one_factorisation_serves_every_layout_of_a_matrix(monkeypatch):
    """Error feedback's factor of the inverse Gram matrix depends on the input and the vector
    length only: shared through GramFactors, it is computed once per length, and every result is
    the one a fresh factorisation gives."""
    import torch

    from wscompress.maths import clustering

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(256, 32, generator=gen) @ torch.randn(32, 64, generator=gen)
    w, gram = torch.randn(128, 64, generator=gen), x.T @ x
    layouts = [KMeansConfig(bits=b, cluster_dim=d, granularity="grouped", group_size=64, iterations=20, outliers=0.01)
               for b, d in ((3, 2), (4, 2), (5, 2), (6, 4))]
    fresh = [palettize(nn.Module(), cfg, gram, w) for cfg in layouts]
    calls = []
    cholesky = torch.linalg.cholesky
    monkeypatch.setattr(torch.linalg, "cholesky", lambda *a, **k: calls.append(1) or cholesky(*a, **k))
    shared = clustering.GramFactors(gram)
    for cfg, alone in zip(layouts, fresh):
        layer = palettize(nn.Module(), cfg, shared, w)
        assert torch.equal(layer.index_matrix(), alone.index_matrix()) and torch.equal(layer.codebook, alone.codebook)
        assert torch.equal(layer.outlier_value, alone.outlier_value)
    assert len(calls) == 2 * 2  # two Cholesky factorisations a vector length: d = 2 and d = 4


def test_a_budget_counts_what_the_targets_holders_store_for_them(tokenizer, tmp_path):
    """After ``rotate`` the budget's targets are the turned weights inside each RotatedLinear, and
    the rotation's signs (a byte a column) are within the budget too: the folder's stored bytes of
    the rotated layers, signs included, meet it to the byte."""
    model = tiny_model("llama")
    weights = sum(m.weight.numel() for n, m in model.named_modules() if isinstance(m, nn.Linear) and ".layers." in n)
    report = wscompress.compress(model, [{"method": "rotate", "block": 16},
                                         {"method": "kmeans", "budget": {"bits_per_weight": 3.6}, "menu": MIXED,
                                          **QUICK}], tokenizer, CALIBRATION)[1]
    budget = report["budget"]
    holders = {n.rpartition(".")[0] for n, m in model.named_modules() if isinstance(m, PalettizedLinear)}
    signs = sum(model.get_submodule(n).signs.numel() for n in holders)
    assert budget["beside_bytes"] == signs > 0
    assert budget["bytes"] == int(3.6 * weights // 8) and budget["used_bytes"] <= budget["bytes"]
    storage.save(model, tokenizer, tmp_path / "model")
    stored = 0
    with safe_open(tmp_path / "model" / f"model.{VARIANT}.safetensors", "pt") as f:
        for key in f.keys():
            if key.rpartition(".")[0] in holders or key.rpartition(".")[0].rpartition(".")[0] in holders:
                stored += f.get_tensor(key).nbytes
    assert stored == budget["used_bytes"]
