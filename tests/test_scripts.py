"""Every benchmark of scripts/ runs end to end by its --dry-run (a toy model or toy shapes, one
round), so a script the docs cite to regenerate a table cannot rot between its uses: its table's
rows and columns come out and its figures are numbers. `make test-scripts` runs these (and the
other scripts' tests: test_bench_prefill, test_gpu_check, test_peers_script)."""

import json
import re

import pytest
from bench_scripts import run_script, script_module

from wscompress import kernels

pytestmark = pytest.mark.scripts
CELL = re.compile(r"(?<!\\)\|")  # a cell's own | is escaped


def table(markdown: str, *cols: str) -> list[dict[str, str]]:
    """The rows of the first Markdown table in ``markdown`` whose header has the columns ``cols``."""
    lines = markdown.splitlines()

    def cells(line: str) -> list[str]:
        return [c.strip().replace("\\|", "|") for c in CELL.split(line.strip())[1:-1]]

    start = next(i for i, line in enumerate(lines) if line.startswith("|") and set(cols) <= set(cells(line)))
    header = cells(lines[start])
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append(dict(zip(header, cells(line))))
    return rows


def test_table_reads_escaped_cells():
    md = "text\n\n| a | b\\|c |\n|---|---|\n| 1 | x\\|y |\n| 2 |  |\n\n| a | d |\n|---|---|\n| 3 | 4 |\n"
    assert table(md, "a") == [{"a": "1", "b|c": "x|y"}, {"a": "2", "b|c": ""}]
    assert table(md, "d") == [{"a": "3", "d": "4"}]


def test_bench_runtime(tmp_path):
    bench = script_module("bench_runtime")
    run_script("bench_runtime.py", "--dry-run", "--layers", "--out", str(tmp_path))
    results = json.loads((tmp_path / "results.json").read_text())
    assert [r["model"] for r in results["rows"]] == list(bench.MODELS)  # every layout built and timed
    assert all(r["decode tok/s"] > 0 and r["prefill tok/s"] > 0 for r in results["rows"])
    resident = {r["model"]: r["resident MB"] for r in results["rows"]}
    assert all(resident[m] < resident["dense"] for m in bench.MODELS if m.startswith(("kmeans", "svd")))
    assert len(results["layers"]) == len(bench.TOY_SHAPES) * (1 + len(bench.LAYER_MODELS))
    rows = table((tmp_path / "results.md").read_text(), "model", "decode tok/s")
    assert [r["model"] for r in rows] == list(bench.MODELS) and all(float(r["decode tok/s"]) > 0 for r in rows)


def test_bench_protocol(tmp_path):
    bench = script_module("bench_protocol")
    run_script("bench_protocol.py", "--dry-run", "--out", str(tmp_path))
    results = json.loads((tmp_path / "results.json").read_text())
    assert [r["method"] for r in results["rows"]] == ["dense", *bench.DRY_ROWS]
    assert all(r["ppl"]["wiki.test"] > 0 and r["ppl"]["brown"] > 0 for r in results["rows"])
    assert [s["step"].split(" (")[0] for s in results["steps"]] == ["wscompress calibrate", "wscompress compress"]
    rows = table((tmp_path / "results.md").read_text(), "method", "wiki.test / dense")
    assert [r["method"] for r in rows] == ["dense", *bench.DRY_ROWS]
    assert all(float(r["brown"]) > 0 and float(r["compress_s"]) >= 0 for r in rows[1:])
    assert len(list(tmp_path.glob("runs/*/reports/eval.json"))) == len(bench.DRY_ROWS)  # what `wscompress report` reads


def test_bench_lowbit(tmp_path):
    run_script("bench_lowbit.py", "--dry-run", "--out", str(tmp_path))
    rows = {r["method"].split(" + ")[0] + (" + training" if " + " in r["method"] else ""): r
            for r in json.loads((tmp_path / "results.json").read_text())["rows"]}
    assert list(rows) == ["dense", "kmeans per channel (default)", "kmeans per channel (default) + training",
                          "rotated, kmeans per channel (default)", "RTN g64", "DKM as it stands (0.05 min from dense)"]
    assert 2 < rows["kmeans per channel (default)"]["bits_per_weight"] < 3 and rows["RTN g64"]["bits_per_weight"] == 2.375
    assert rows["kmeans per channel (default) + training"]["steps"] >= 1
    rotated = rows["rotated, kmeans per channel (default)"]["bits_per_weight"]
    assert rotated > rows["kmeans per channel (default)"]["bits_per_weight"]  # its signs are counted
    md = table((tmp_path / "results.md").read_text(), "method", "wiki.test x")
    assert len(md) == 6 and all(float(r["wiki.test"]) > 0 and float(r["brown"]) > 0 for r in md)


def test_bench_budget(tmp_path):
    run_script("bench_budget.py", "--dry-run", "--out", str(tmp_path))
    rows = {r["run"]: r for r in table((tmp_path / "results.md").read_text(), "run", "bits a weight")}
    assert list(rows) == ["budget-3.0", "uniform-3bit", "trellis-budget-3.0", "trellis-2bit"]
    assert float(rows["budget-3.0"]["bits a weight"]) <= 3.0 < float(rows["uniform-3bit"]["bits a weight"])
    assert 2.5 < float(rows["trellis-budget-3.0"]["bits a weight"]) <= 3.0  # signs, scales and walks within it
    assert 2.0 < float(rows["trellis-2bit"]["bits a weight"]) < 2.5
    assert all(float(r["x dense wiki.test"]) > 0 and float(r["stage s"]) >= 0 for r in rows.values())
    assert float(rows["budget-3.0"]["measure s"]) > 0
    assert (tmp_path / "comparison" / "comparison.md").is_file()  # wscompress report merged the runs


def test_bench_q8():
    out = run_script("bench_q8.py", "--dry-run")
    products = table(out, "layout", "byte products µs")
    assert {r["layout"] for r in products} == set(script_module("bench_q8").LAYOUTS)
    assert all(float(r["float µs"]) > 0 for r in products if r["out x in"])
    heads = table(out, "dense weight", "int8 int8_linear µs")
    assert len(heads) == 1 and float(heads[0]["int8 speed-up"][:-1]) > 0
    decoded = table(out, "model", "decode ppl, byte products")
    assert [r["text"] for r in decoded] == ["wiki.test", "brown"]
    assert all(abs(float(r["x float"]) - 1) < 0.01 for r in decoded)  # byte products keep the perplexity
    assert "palettized layers, one token" in out


def test_bench_kmeans_kernels():
    if kernels.kmeans() is None:  # asked here, not when the suite collects: it loads the kernels
        pytest.skip(f"the k-means kernels are not available here: {kernels.status()}")
    rows = table(run_script("bench_kmeans_kernels.py", "--dry-run"), "layout", "compiled ms")
    assert [r["loop"] for r in rows] == ["nearest centroid", "k-means++ seeding"] * 2
    assert all(float(r["torch ms"]) > 0 and float(r["compiled ms"]) > 0 for r in rows)


def test_bench_calibration_kernels():
    if kernels.products() is None or kernels.norms() is None:
        pytest.skip(f"the calibration kernels are not available here: {kernels.calibration_status()}")
    rows = table(run_script("bench_calibration_kernels.py", "--dry-run"), "operation", "kernel (ms)")
    assert [r["operation"].split()[0] for r in rows] == ["Gram", "Gram", "cross", "RMSNorm"]
    assert all(float(r["before (ms)"]) > 0 and float(r["kernel (ms)"]) > 0 for r in rows)


def test_bench_hf_loading(tmp_path):
    forms = script_module("bench_hf_loading").FORMS
    run_script("bench_hf_loading.py", "--dry-run", "--out", str(tmp_path))
    rows = table((tmp_path / "results.md").read_text(), "model", "folder MB")
    assert [r["model"] for r in rows] == ["original", *forms]
    diffs = [float(d) for r in rows[1:] for d in r["max |Δ logit| (load / from_pretrained / without wscompress)"].split("/")]
    assert len(diffs) == 3 * len(forms) and max(diffs) < 1e-3  # the three loads give the saved model's logits
    assert all(float(r["folder MB"]) < float(rows[0]["folder MB"]) for r in rows[1:])


def test_bench_scale(tmp_path):
    run_script("bench_scale.py", "--dry-run", "--out", str(tmp_path))
    rows = table((tmp_path / "results.md").read_text(), "model", "offload")
    assert [r["offload"] for r in rows] == ["none", "disk"]
    assert rows[0]["output sha1"] == rows[1]["output sha1"]  # offloading changes no bit of the result
    assert all(float(r["compress peak GB"]) > 0 and float(r["calibrate s"]) > 0 for r in rows)


def test_bench_steps(tmp_path):
    run_script("bench_steps.py", "--dry-run", "--out", str(tmp_path))
    md = (tmp_path / "results.md").read_text()
    steps = table(md, "recipe", "step")
    assert [r["step"] for r in steps] == ["calibrate", "compress", "finetune", "eval"]
    assert all(float(r["seconds"]) > 0 and float(r["peak MB"]) > 0 for r in steps)
    assert "2 steps, loss" in steps[2]["result"]
    measures = {r["measure"]: r for r in table(md, "model", "measure")}
    assert float(measures["params"]["compressed/original"]) < 1 and "kernel path" in measures


def test_bench_recovery(tmp_path):
    run_script("bench_recovery.py", "--dry-run", "--out", str(tmp_path))
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert [r["recovery"] for r in rows] == ["-", "none (one-shot)", "lm", "kd", "layerwise+kd"]
    assert all(r["steps"] >= 1 and r["curve"] and r["wiki.test"] > 0 for r in rows[2:])
    assert len(table((tmp_path / "results.md").read_text(), "method", "recovery")) == 5


def test_resident_bytes_record():
    """The record behind docs/runtime.md's resident goal, at toy size: a row a shipped layout."""
    rows = table(run_script("experiments/resident_bytes.py", "--tiny"), "layout", "loaded x stored", "compressed x stored")
    assert len(rows) == 4 and all(float(r[c]) >= 1 for r in rows for c in ("loaded x stored", "compressed x stored"))



def test_token_products_record():
    """The record behind docs/runtime.md's products of a token, at toy size: a row a shipped layout."""
    rows = table(run_script("experiments/token_products.py", "--tiny"), "layout", "ms a token", "GB/s of indices")
    assert len(rows) == 4 and all(int(r["products"]) == 14 and float(r["ms a token"]) > 0 for r in rows)
