"""scripts/gpu_check.py (issue 55's GPU measurements) runs its dry run: the same code on the CPU
with tiny shapes, so the script a lent GPU session runs has not rotted in between."""

import json

import pytest
from bench_scripts import run_script

from wscompress import kernels

pytestmark = pytest.mark.scripts


def test_gpu_check_dry_run(tmp_path):
    run_script("gpu_check.py", "--dry-run", "--out", str(tmp_path))
    results = json.loads((tmp_path / "gpu_check.json").read_text())
    products, eager, decode, pipeline = (results[part] for part in ("products", "eager", "decode", "pipeline"))
    assert {r["model"] for r in products} >= {"dense", "kmeans 4-bit per channel",
                                              "kmeans 4-bit, 2-d vectors per 64 channels + row scales + 0.07 % outliers"}
    assert all(r["us per call"] > 0 for r in products)
    palettized = [r for r in products if r["model"] != "dense"]
    assert all(float(r["error"]) < 3e-3 for r in palettized)  # the timed products are the layers' (8-bit activations on CPU)
    if kernels.lut() is not None:
        assert {r["path"] for r in palettized} == {"kernel"}
    assert [r["level"] for r in eager][:3] == ["dense F.linear", "PalettizedLinear call", "kernels.palettized_linear"]
    assert all(r["us per call"] > 0 for r in eager)
    assert [r["model"] for r in decode] == ["dense", "4-bit recipe layout", "rotated + 4-bit recipe layout", "svd 40 %"]
    assert decode[1]["resident MB"] < decode[0]["resident MB"] and decode[2]["resident MB"] < decode[0]["resident MB"]  # the layouts were really swapped in
    assert all(r["decode tok/s"] > 0 for r in decode)
    assert {(r["method"], r["layers"]) for r in pipeline} == {(m, n) for m in ("Basis Sharing 20 %", "SVD-LLM 20 %",
                                                                               "kmeans 4-bit") for n in (2, 4)}
    assert all(r["compress s"] > 0 and r["compress peak MB"] > 0 for r in pipeline)
    assert all("compress s at 32 layers" in r for r in pipeline if r["layers"] == 4)
    table = (tmp_path / "gpu_check.md").read_text()
    assert table.count("\n## ") == 4 and "skipped" not in table and "failed" not in table
