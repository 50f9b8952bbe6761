"""What a test that runs a script of scripts/ as a subprocess needs: the environment the suite
runs in (offline), with scripts/ importable (the scripts import each other's helpers)."""

import os
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def script_env() -> dict[str, str]:
    path = os.pathsep.join(filter(None, [str(SCRIPTS), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1", "PYTHONPATH": path}
