"""scripts/bench_prefill.py (docs/runtime.md's prefill table) runs its dry run, so the script
the docs cite has not rotted: every shipped layout timed on both paths."""

import json

import pytest
from bench_scripts import run_script

pytestmark = pytest.mark.scripts


def test_bench_prefill_dry_run(tmp_path):
    run_script("bench_prefill.py", "--dry-run", "--out", str(tmp_path))
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert {r["layout"] for r in rows} == {f"configs/kmeans_{b}.yaml" for b in ("4bit", "3bit", "2bit", "4bit_fast")}
    assert all(r["float32 tok/s"] > 0 and r["integer tok/s"] > 0 for r in rows)
