"""Reports: every command writes ``<output>/reports/<name>.json`` (for machines: results plus
recipe, versions, hardware and seed) and ``<name>.md`` (for people)."""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

import torch

from . import __version__
from .distributed import is_main


def environment() -> dict:
    import transformers

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"wscompress": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "platform": platform.platform(),
            "cpu_count": os.cpu_count(), "threads": torch.get_num_threads(), "gpu": gpu,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def _cell(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, (dict, list)):
        return json.dumps(v)[:80]
    return "-" if v is None else str(v)


def markdown_table(rows: list[dict]) -> str:
    columns = list(dict.fromkeys(k for r in rows for k in r))
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def to_markdown(title: str, payload: dict) -> str:
    """Lists of dicts become tables, dicts of dicts become tables keyed by name, scalars a list."""
    parts, scalars = [f"# {title}", ""], []
    for key, value in payload.items():
        if key in ("recipe", "environment"):
            continue
        if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            parts += [f"## {key}", "", markdown_table(value), ""]
        elif isinstance(value, dict) and value and all(isinstance(v, dict) for v in value.values()):
            parts += [f"## {key}", "", markdown_table([{"name": k, **v} for k, v in value.items()]), ""]
        elif isinstance(value, dict):
            parts += [f"## {key}", "", markdown_table([value]), ""]
        else:
            scalars.append(f"- **{key}**: {_cell(value)}")
    env = payload.get("environment")
    if env:
        scalars.append(f"- **environment**: torch {env['torch']}, transformers {env['transformers']}, "
                       f"{env['cpu_count']} CPUs, GPU {env['gpu'] or 'none'}")
    return "\n".join(parts[:2] + scalars + [""] + parts[2:])


def peak_memory_mb(device: torch.device | None = None) -> float:
    """Peak CUDA allocation on a CUDA ``device`` (default: when CUDA is available), else this
    process's peak resident memory, in MiB. On Linux from VmHWM: ``ru_maxrss`` survives fork and
    exec, so a process started by a large one (a script that loaded a model, a worker pool)
    would report its parent's peak."""
    if (device.type == "cuda") if device is not None else torch.cuda.is_available():
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024
    except (OSError, StopIteration):
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
        return peak / (2**20 if platform.system() == "Darwin" else 1024)


def write(out_dir: str | Path, name: str, payload: dict, recipe: dict | None = None) -> Path:
    """Write reports/<name>.json and .md (by the first process of a launch only); returns the JSON path."""
    reports = Path(out_dir) / "reports"
    if not is_main():
        return reports / f"{name}.json"
    reports.mkdir(parents=True, exist_ok=True)
    full = {**payload, "recipe": recipe, "environment": environment()}
    path = reports / f"{name}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(full, indent=1, default=str))
    tmp.replace(path)
    (reports / f"{name}.md").write_text(to_markdown(name, full))
    return path
