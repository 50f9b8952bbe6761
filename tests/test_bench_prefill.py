"""scripts/bench_prefill.py (docs/runtime.md's prefill table) runs its dry run, so the script
the docs cite has not rotted: every shipped layout timed on both paths."""

import json
import subprocess
import sys
from pathlib import Path

from bench_scripts import script_env

REPO = Path(__file__).resolve().parents[1]


def test_bench_prefill_dry_run(tmp_path):
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_prefill.py"), "--dry-run", "--out", str(tmp_path)],
                          env=script_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert {r["layout"] for r in rows} == {f"configs/kmeans_{b}.yaml" for b in ("4bit", "3bit", "2bit", "4bit_fast")}
    assert all(r["float32 tok/s"] > 0 and r["int8 tok/s"] > 0 for r in rows)
