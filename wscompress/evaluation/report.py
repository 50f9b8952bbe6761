"""Reports: every command writes ``<output>/reports/<name>.json`` (for machines: results plus
recipe, versions, hardware and seed) and ``<name>.md`` (for people)."""

from __future__ import annotations

import json
import os
import platform
import re
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch

from ..io.distributed import is_main
from ..io.ui import cell, markdown_table


def environment() -> dict:
    import transformers

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    try:
        ours = version("wscompress")
    except PackageNotFoundError:  # run from a source tree on PYTHONPATH (a lent GPU machine): no metadata
        ours = "source tree, not installed"
    return {"wscompress": ours, "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "platform": platform.platform(),
            "cpu_count": os.cpu_count(), "threads": torch.get_num_threads(), "gpu": gpu,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


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
            scalars.append(f"- **{key}**: {cell(value)}")
    env = payload.get("environment")
    if env:
        scalars.append(f"- **environment**: torch {env['torch']}, transformers {env['transformers']}, "
                       f"{env['cpu_count']} CPUs, GPU {env['gpu'] or 'none'}")
    return "\n".join(parts[:2] + scalars + [""] + parts[2:])


def bits_picture(stage: dict) -> str:
    """A budgeted stage's choice as a picture: decoder layer x projection, the bits a weight
    each matrix got (matrices outside the layers on rows of their own); empty for other stages."""
    if "budget" not in stage:
        return ""
    grid: dict[str, dict[str, str]] = {}
    for row in stage.get("per_layer", []):
        where = re.search(r"\.(\d+)\.(?:.*\.)?([^.]+)$", row["layer"])
        layer, part = (where.group(1), where.group(2)) if where else (row["layer"], "matrix")
        grid.setdefault(layer, {})[part] = f"{row['bits_per_weight']:.2f}"
    budget = stage["budget"]
    return "\n".join([f"## Bits a weight each matrix got (stage {stage['stage']})", "",
                      f"Budget {budget['bytes']} bytes; used {budget['used_bytes']} "
                      f"({budget['bits_per_weight']:.3f} bits a weight), each matrix's layout chosen from "
                      f"{len(budget['menu'])} (`budget` in reports/compress.json).", "",
                      markdown_table([{"layer": k, **v} for k, v in grid.items()]), ""])


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
    pictures = [bits_picture(stage) for stage in payload.get("stages", []) if isinstance(stage, dict)]
    (reports / f"{name}.md").write_text("\n".join([to_markdown(name, full), *filter(None, pictures)]))
    return path


CARD = "README.md"


def size_rows(compress: dict) -> list[dict]:
    """A compress report's sizes (its ``original`` and ``compressed`` entries), bytes first: MB
    and bits a weight, then the parameters."""
    return [{"model": label, "tensor MB": round(s["tensor_bytes"] / 2**20, 1),
             "file MB": round(s["file_bytes"] / 2**20, 1) if "file_bytes" in s else "-",
             "bits a weight": round(s["bits_per_weight"], 3), "parameters": s["params"]}
            for label, s in (("original", compress["original"]), ("compressed", compress["compressed"]))]


def _fresh(report: Path, model: Path) -> bool:
    """Whether a report describes the model folder as it is (written after it)."""
    return report.stat().st_mtime >= (model / "config.json").stat().st_mtime


def model_card(out_dir: str | Path) -> str | None:
    """The model card of ``<out>/model`` in the hub's format (YAML metadata, then Markdown): base
    model, methods with their options, size before and after, and the perplexities and speeds
    the run's reports measured on this very folder (older reports are left out)."""
    from ..io.checkpoints import BUILTINS

    out = Path(out_dir)
    folder = out / "model"
    if not (folder / "config.json").is_file():
        return None
    reports = {name: json.loads(p.read_text()) for name in ("compress", "finetune", "eval", "bench")
               if (p := out / "reports" / f"{name}.json").is_file() and (name in ("compress", "finetune") or _fresh(p, folder))}
    if "compress" not in reports:
        return None
    compress, recipe = reports["compress"], reports["compress"]["recipe"]
    source = recipe["model"]["path"]
    builtin = BUILTINS.get(source.removeprefix("builtin:")) if source.startswith("builtin:") else None
    base = builtin.origin if builtin else source
    hub_id = base.count("/") == 1 and not Path(base).expanduser().exists()
    methods = list(dict.fromkeys(stage["method"] for stage in compress["stages"]))
    written = json.loads((folder / "config.json").read_text())
    meta = ([f"base_model: {base}"] if hub_id else []) + ["library_name: transformers", "pipeline_tag: text-generation",
                                                          "tags:", "- wscompress", *(f"- {m}" for m in methods)]
    lines = ["---", *meta, "---", "", f"# {recipe.get('name') or folder.name}: {base}, compressed by wscompress", "",
             f"`{base}`{' (de-quantized from its Q4_1 GGUF)' if builtin else ''} compressed with "
             f"{', then '.join(f'`{m}`' for m in methods)} by wscompress {written.get('wscompress_version', '')} "
             f"(with transformers {written.get('transformers_version', '')}). wscompress is not on a package index: "
             "install it from its source tree (`pip install <clone>`; `pip install \"<clone>[all]\"` for the whole "
             "toolkit). The folder loads without it too (below).", "",
             "## Use it", "", "```python", "import wscompress  # registers the compressed layers (and its kernels) with transformers",
             "from transformers import AutoModelForCausalLM, AutoTokenizer", "",
             'model = AutoModelForCausalLM.from_pretrained("PATH")  # PATH: this folder or its hub id',
             'tokenizer = AutoTokenizer.from_pretrained("PATH")', "```", "",
             "Without wscompress installed: `AutoModelForCausalLM.from_pretrained(PATH, trust_remote_code=True)` runs "
             "the torch code in `modeling_wscompress.py` (same logits, no compiled kernels).", "",
             "## Size", "", markdown_table(size_rows(compress)), "",
             f"{compress['size_ratio']:.1%} of the original's bytes ({compress['compressed']['bits_per_weight']:.2f} bits "
             f"a weight). Parameters are the dense-equivalent count: a palettized weight counts as one.", "",
             "## Methods", "", markdown_table([{"stage": s["stage"], "method": s["method"],
                                                "MB after": round(s["bytes_after"] / 2**20, 1),
                                                "bits a weight after": s["bits_per_weight"],
                                                "parameters after": s["params_after"], "seconds": s["seconds"]}
                                               for s in compress["stages"]]), "",
             "Every option of each stage (the recipe as run):", "", "```json",
             json.dumps(recipe["compress"], indent=1), "```", ""]
    lines += [picture for stage in compress["stages"] if (picture := bits_picture(stage))]
    if "finetune" in reports:
        ft = reports["finetune"]
        lines += ["## Recovery fine-tuning", "", f"Mode `{ft['mode']}`, {ft['steps']} steps ({ft['seconds']} s) on "
                  f"`{ft['recipe']['finetune']['dataset']}`.", ""]
    if "eval" in reports:
        ev = reports["eval"]
        e = ev["recipe"]["eval"]
        protocol = [f"windows of {e['context_length']} tokens"] + ([f"the first {e['max_windows']}"] if e["max_windows"] else []) \
            + ([f"stride {e['stride']}"] if e["stride"] else [])
        lines += ["## Perplexity", "", markdown_table([{k: r[k] for k in ("model", "source", "ppl", "tokens", "bos")}
                                                       for r in ev["results"]]), "",
                  f"{', '.join(protocol).capitalize()}; measured by `wscompress eval`.", ""]
        if ev.get("tasks"):
            lines += ["## Tasks (lm-eval)", "", markdown_table(ev["tasks"]), ""]
    if "bench" in reports:
        bench = reports["bench"]
        device = bench["details"]["original"]["device"]
        lines += ["## Speed", "", markdown_table(bench["table"]), "",
                  f"On {device} ({bench['environment']['gpu'] or str(bench['environment']['cpu_count']) + ' CPUs'}); "
                  f"{bench['timing']}; kernels: {bench['kernels'].get('compressed', '-')}.", ""]
    return "\n".join(lines)


def write_model_card(out_dir: str | Path) -> Path | None:
    """Write ``<out>/model/README.md`` (see ``model_card``); None when there is no compressed model."""
    text = model_card(out_dir) if is_main() else None
    if text is None:
        return None
    path = Path(out_dir) / "model" / CARD
    tmp = path.with_suffix(".md.tmp")
    tmp.write_text(text)
    tmp.replace(path)
    return path
