"""What a test that runs a script of scripts/ as a subprocess needs: the environment the suite
runs in (offline), with scripts/ importable (the scripts import each other's helpers)."""

import importlib
import os
import subprocess
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def script_env() -> dict[str, str]:
    path = os.pathsep.join(filter(None, [str(SCRIPTS), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1", "PYTHONPATH": path}
    if os.environ.get("PYTEST_XDIST_WORKER"):  # one test process a core: its scripts compute on one thread too
        env["OMP_NUM_THREADS"] = "1"
    return env


def run_script(name: str, *args: str) -> str:
    """scripts/``name`` run with ``args`` in the suite's environment; its output (the test fails
    with the end of its errors where it fails)."""
    done = subprocess.run([sys.executable, str(SCRIPTS / name), *args], cwd=SCRIPTS.parent, env=script_env(),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def script_module(name: str):
    """The module of scripts/``name``.py imported in this process (scripts/ on the path: they import each other)."""
    if str(SCRIPTS) not in sys.path:
        sys.path.insert(0, str(SCRIPTS))
    return importlib.import_module(name)
