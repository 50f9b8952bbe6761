"""`wscompress report`: several real (tiny) runs merged into one table, CSV and plot."""

from __future__ import annotations

import csv

import pytest
from typer.testing import CliRunner

from wscompress.cli import app
from wscompress.errors import UsageError
from wscompress.evaluation.compare import compare
from wscompress.recipe.load import load_recipe
from wscompress.workflow import step_compress, step_eval

from conftest import WIKI_TEST


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two recipes (plain SVD on attention, on everything) at two ratios: four compress+eval runs."""
    from conftest import make_tokenizer, tiny_model

    root = tmp_path_factory.mktemp("runs")
    model_dir = root / "tiny"
    tiny_model("llama").save_pretrained(model_dir)
    make_tokenizer().save_pretrained(model_dir)
    for name, targets in (("svd-attn", ["self_attn"]), ("svd-all", ["self_attn", "mlp"])):
        for ratio in (0.2, 0.5):
            r = load_recipe(data={
                "name": name, "model": {"path": str(model_dir)},
                "compress": [{"method": "svd", "whitening": False, "ratio": ratio, "targets": targets}],
                "eval": {"perplexity": [WIKI_TEST], "context_length": 64, "max_windows": 2, "batch_size": 2},
                "output": {"dir": str(root / "sweep" / f"{name}-{ratio}")}})
            step_compress(r)
            step_eval(r)
    return root / "sweep"


def test_report_merges_runs_into_csv_markdown_and_plot(runs, tmp_path):
    result = CliRunner().invoke(app, ["report", str(runs), "--out", str(tmp_path / "cmp"), "-q"])
    assert result.exit_code == 0, result.output
    with open(tmp_path / "cmp" / "comparison.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert [(r["method"], float(r["ratio"])) for r in rows] == [("svd-all", 0.2), ("svd-all", 0.5), ("svd-attn", 0.2), ("svd-attn", 0.5)]
    by = {(r["method"], float(r["ratio"])): r for r in rows}
    # compressing more (higher ratio, more modules) removes more bytes
    assert 0 < float(by["svd-attn", 0.2]["size_reduction"]) < float(by["svd-attn", 0.5]["size_reduction"]) < float(by["svd-all", 0.5]["size_reduction"])
    assert all(float(r["ppl wiki.test"]) > 0 and float(r["original ppl wiki.test"]) > 0 for r in rows)
    md = (tmp_path / "cmp" / "comparison.md").read_text()
    assert sum(line.startswith("| svd-") for line in md.splitlines()) == 4 and "comparison.png" in md
    assert (tmp_path / "cmp" / "comparison.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_takes_run_directories_one_by_one(runs, tmp_path):
    out = compare([runs / "svd-all-0.2", runs / "svd-all-0.5"], tmp_path)
    assert [r["run"] for r in out["rows"]] == ["svd-all-0.2", "svd-all-0.5"]
    assert out["rows"][0]["stages"] == "svd" and out["rows"][0]["param_ratio"] < 1


def test_report_bad_input(tmp_path):
    with pytest.raises(UsageError, match="no reports"):
        compare([tmp_path], tmp_path / "out")
    (tmp_path / "run" / "reports").mkdir(parents=True)
    with pytest.raises(UsageError, match="no reports/eval.json"):
        compare([tmp_path / "run"], tmp_path / "out")
    result = CliRunner().invoke(app, ["report", str(tmp_path / "missing"), "--out", str(tmp_path / "o")])
    assert result.exit_code == 2 and "not a directory" in result.output
