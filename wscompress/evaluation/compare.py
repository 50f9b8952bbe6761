"""Merge several runs' reports into one comparison table (CSV, Markdown) and a plot.

A run is an output directory with ``reports/*.json`` (written by compress, finetune, eval,
bench). Runs are grouped into lines by the recipe's ``name``: a sweep runs one recipe at several
ratios into several directories, so each recipe becomes one line of perplexity vs compression.
The x axis is the measured size reduction (1 - compressed / original tensor bytes), which puts
low-rank, shared and clustered models on one scale; the recipe's target ratio is a table column.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

from ..errors import UsageError, need
from ..io.ui import markdown_table


def _read(run: Path, name: str) -> dict | None:
    path = run / "reports" / f"{name}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def run_dirs(paths: list[Path]) -> list[Path]:
    """Run directories among ``paths``: each path that has reports/, else its subfolders with an
    eval report (a sweep's folder also holds e.g. its shared calibration)."""
    runs: list[Path] = []
    for path in paths:
        if (path / "reports").is_dir():
            runs.append(path)
        elif path.is_dir():
            runs += sorted(p for p in path.iterdir() if (p / "reports" / "eval.json").is_file())
        else:
            raise UsageError(f"report: {path} is not a directory", "pass run output directories (output.dir of each recipe)")
    if not runs:
        raise UsageError(f"report: no reports/ under {', '.join(map(str, paths))}",
                         "pass the output directories of finished runs (wscompress run/eval writes reports/)")
    return list(dict.fromkeys(runs))


def run_row(run: Path) -> dict:
    """One table row: what the run did, its size and its quality (compressed model vs original)."""
    compress, evaluation = _read(run, "compress"), _read(run, "eval")
    if evaluation is None:
        raise UsageError(f"report: {run} has no reports/eval.json", f"evaluate it first: wscompress eval <recipe> -o {run}")
    recipe = evaluation.get("recipe") or {}
    stages = recipe.get("compress") or []
    row: dict = {"run": run.name, "method": recipe.get("name") or run.name,
                 "stages": "+".join(s["method"] for s in stages) or "none",
                 "ratio": next((s["ratio"] for s in stages if s.get("ratio") is not None), None),
                 "finetuned": _read(run, "finetune") is not None}
    if compress is not None:
        original, compressed = compress["original"], compress["compressed"]
        row.update(file_mb=compressed["file_bytes"] / 2**20, bits_per_weight=compressed.get("bits_per_weight"),
                   size_reduction=1 - compressed["tensor_bytes"] / original["tensor_bytes"],
                   params=compressed["params"], param_ratio=compressed["params"] / original["params"])
    else:
        row.update(params=evaluation["results"][0]["params"], param_ratio=1.0, size_reduction=0.0)
    label = "compressed" if any(r["model"] == "compressed" for r in evaluation["results"]) else "model"
    for r in evaluation["results"]:
        source = Path(r["source"]).stem
        if r["model"] == label:
            row[f"ppl {source}"] = r["ppl"]
        elif r["model"] == "original":
            row[f"original ppl {source}"] = r["ppl"]
    for t in evaluation.get("tasks", []):
        for metric in ("acc", "rougeL"):  # classification and generation (summarization) tasks
            if t["model"] == label and metric in t:
                row[f"{metric} {t['task']}"] = t[metric]
    bench = _read(run, "bench")
    for b in (bench or {}).get("table", []):
        if b["measure"].startswith(("prefill", "decode")) and b.get("compressed/original") is not None:
            row[f"{b['measure']} x"] = b["compressed/original"]
    return row


def plot(rows: list[dict], path: Path) -> None:
    """PNG: perplexity (first eval source) vs size reduction, one line per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    key = next(k for k in rows[0] if k.startswith("ppl "))
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for method in dict.fromkeys(r["method"] for r in rows):
        points = sorted((r["size_reduction"], r[key]) for r in rows if r["method"] == method and r.get(key) is not None)
        ax.plot([100 * x for x, _ in points], [y for _, y in points], marker="o", label=method)
    baseline = next((r[f"original {key}"] for r in rows if r.get(f"original {key}") is not None), None)
    if baseline is not None:
        ax.axhline(baseline, color="grey", linestyle="--", label=f"original ({baseline:.2f})")
    ax.set(xlabel="size reduction (% of the original tensor bytes)", ylabel=f"perplexity ({key[4:]})", yscale="log",
           title="perplexity vs compression")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def compare(paths: list[Path], out: Path) -> dict:
    """Write comparison.csv, comparison.md and comparison.png into ``out``; returns the rows and files."""
    need("matplotlib", "plot", "wscompress report (its plot)")
    rows = sorted((run_row(r) for r in run_dirs(paths)), key=lambda r: (r["method"], r["size_reduction"]))
    out.mkdir(parents=True, exist_ok=True)
    columns = list(dict.fromkeys(k for r in rows for k in r))
    with open(out / "comparison.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    files = [out / "comparison.csv", out / "comparison.md"]
    figure = ""
    if any(k.startswith("ppl ") for k in rows[0]):
        plot(rows, out / "comparison.png")
        files.append(out / "comparison.png")
        figure = "\n![perplexity vs compression](comparison.png)\n"
    (out / "comparison.md").write_text(f"# Comparison of {len(rows)} runs\n\n{markdown_table(rows)}\n{figure}")
    return {"rows": rows, "files": [str(f) for f in files]}
