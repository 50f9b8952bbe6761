"""The ``wscompress`` command line: one subcommand per recipe step, plus ``run`` for all."""

from __future__ import annotations

import os
import signal
import sys
import threading
from enum import Enum
from pathlib import Path
from typing import Callable, List, Optional

import typer

from .errors import UsageError
from .io import ui

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Make HuggingFace language models smaller by weight sharing and weight clustering.")

RecipeArg = typer.Argument(..., help="YAML recipe (see configs/ and docs/recipes.md).")
SetOpt = typer.Option(None, "--set", "-s", help="Override one recipe key, e.g. --set compress.0.ratio=0.3 (repeatable).")
OutOpt = typer.Option(None, "--output", "-o", help="Output directory (overrides output.dir).")
QuietOpt = typer.Option(False, "--quiet", "-q", help="No progress bars or logs (CI); tables and errors still print.")


def _recipe(path: Path, overrides: Optional[List[str]], output: Optional[Path]):
    from .recipe.load import load_recipe

    sets = list(overrides or []) + ([f"output.dir={output}"] if output else [])
    return load_recipe(path, sets)


def _exit_cleanly_on_signals() -> None:
    """SIGTERM and SIGHUP (a CI job cancelled, a terminal closed) end the step as Ctrl-C does:
    by an exception, so ``finally`` blocks and exit handlers remove the half-written output,
    scratch statistics and offload spills. By default they kill the process on the spot."""

    def stop(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    if threading.current_thread() is not threading.main_thread():  # only the main thread may set handlers
        return
    for name in ("SIGTERM", "SIGHUP"):
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), stop)


def _do(quiet: bool, fn: Callable[[], object], processes: bool = False) -> None:
    """Run a step; user errors print one clear message and exit with code 2. With
    ``processes`` the step may run in several processes (torchrun / accelerate launch)."""
    from .io import distributed

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    _exit_cleanly_on_signals()
    if distributed.launched() and not processes:
        typer.echo("error: this command runs in one process; calibrate, finetune and eval run in several "
                   "(torchrun / accelerate launch)\nfix: start it without the launcher", err=True)
        raise typer.Exit(2)
    distributed.init()
    quiet = quiet or not distributed.is_main()  # one process reports progress
    ui.set_quiet(quiet)
    if quiet:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
    try:
        fn()
    except UsageError as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2)


@app.command()
def calibrate(recipe: Path = RecipeArg, set: Optional[List[str]] = SetOpt, output: Optional[Path] = OutOpt, quiet: bool = QuietOpt):
    """Collect input statistics (Gram matrices, layer by layer) into <output>/calibration/ (one file a layer)."""
    from .workflow import step_calibrate

    _do(quiet, lambda: step_calibrate(_recipe(recipe, set, output)), processes=True)


@app.command()
def compress(recipe: Path = RecipeArg, set: Optional[List[str]] = SetOpt, output: Optional[Path] = OutOpt, quiet: bool = QuietOpt):
    """Apply the recipe's compress stages and save the model to <output>/model (safetensors)."""
    from .workflow import step_compress

    _do(quiet, lambda: step_compress(_recipe(recipe, set, output)))


@app.command()
def finetune(recipe: Path = RecipeArg, set: Optional[List[str]] = SetOpt, output: Optional[Path] = OutOpt,
             resume: bool = typer.Option(False, "--resume", help="Continue from <output>/finetune-checkpoint."),
             quiet: bool = QuietOpt):
    """Recovery fine-tuning of <output>/model (or the recipe's model) per the finetune section."""
    from .workflow import step_finetune

    _do(quiet, lambda: step_finetune(_recipe(recipe, set, output), resume=resume), processes=True)


@app.command("eval")
def eval_(recipe: Path = RecipeArg, set: Optional[List[str]] = SetOpt, output: Optional[Path] = OutOpt,
          model: Optional[str] = typer.Option(None, "--model", "-m", help="Checkpoint to evaluate (default: <output>/model, else the recipe's model)."),
          quiet: bool = QuietOpt):
    """Perplexity (and lm-eval tasks, samples) of the model, next to the original checkpoint."""
    from .workflow import step_eval

    _do(quiet, lambda: step_eval(_recipe(recipe, set, output), model), processes=True)


@app.command()
def bench(recipe: Path = RecipeArg, set: Optional[List[str]] = SetOpt, output: Optional[Path] = OutOpt, quiet: bool = QuietOpt):
    """Latency, throughput, memory and size of the original vs the compressed model."""
    from .workflow import step_bench

    _do(quiet, lambda: step_bench(_recipe(recipe, set, output)))


@app.command()
def run(recipe: Path = RecipeArg, set: Optional[List[str]] = SetOpt, output: Optional[Path] = OutOpt, quiet: bool = QuietOpt):
    """The whole recipe: compress, finetune, eval and bench, as far as the recipe has sections."""
    from .workflow import step_run

    _do(quiet, lambda: step_run(_recipe(recipe, set, output)))


class ExportFormat(str, Enum):
    dense = "dense"
    hf = "hf"


@app.command()
def export(model: str = typer.Argument(..., help="Compressed checkpoint folder."),
           output: Path = typer.Argument(..., help="Folder to write."),
           format: ExportFormat = typer.Option(ExportFormat.dense, "--format", "-f",
                                               help="dense: a plain checkpoint of the base architecture (compressed "
                                                    "layers materialised); hf: the compressed folder as transformers "
                                                    "loads it (weights stay compressed, modeling code beside them; "
                                                    "also rewrites folders of earlier wscompress versions)"),
           quiet: bool = QuietOpt):
    """Write the model in another folder: dense for any tool, or compressed for transformers."""

    def go():
        from .io import storage
        from .io.checkpoints import load_model
        from .recipe.schema import ModelConfig

        m, tok = load_model(ModelConfig(path=model, dtype="auto", device="cpu"))
        if format is ExportFormat.dense:
            storage.export_dense(m, tok, output)
        else:
            storage.save(m, tok, output)
            card = Path(model) / "README.md"
            if card.is_file():  # the model card describes the same weights
                (output / "README.md").write_bytes(card.read_bytes())
        ui.log(f"wrote {output}")

    _do(quiet, go)


@app.command()
def report(runs: List[Path] = typer.Argument(..., help="Run output directories (or folders of them) with reports/."),
           out: Path = typer.Option(..., "--out", help="Folder for comparison.csv, comparison.md and comparison.png."),
           quiet: bool = QuietOpt):
    """Merge several runs into one comparison table (CSV, Markdown) and a perplexity-vs-size plot."""

    def go():
        from .evaluation.compare import compare

        result = compare(runs, out)
        ui.show("comparison", result["rows"])
        ui.log(f"wrote {', '.join(result['files'])}")

    _do(quiet, go)


@app.command()
def check(recipe: Path = RecipeArg, set: Optional[List[str]] = SetOpt, quiet: bool = QuietOpt):
    """Validate a recipe (keys, types, methods, text sources, tasks, output folder, and every stage's
    options against the model's structure, made from its config without reading a weight)."""

    def go():
        from .workflow import preflight

        r = _recipe(recipe, set, None)
        named = {s for s in ("calibration", "finetune", "eval") if s in r.model_fields_set}
        preflight(r, named | {"calibration", "compress"} if r.compress else named)
        typer.echo(f"{recipe}: ok ({len(r.compress)} compress stages)")

    _do(quiet, go)


@app.command()
def precompile(model: str = typer.Argument(..., help="Compressed checkpoint folder."),
               batch: int = typer.Option(1, help="Sequences decoded at once."),
               max_length: int = typer.Option(256, help="Positions (prompt and new tokens) at most; rounded up to 256."),
               threads: int = typer.Option(0, help="Threads decoding will run on (default: torch's)."),
               dtype: Optional[str] = typer.Option(None, help="Dtype the model will be loaded in (default: as stored)."),
               key: Optional[str] = typer.Option(None, hidden=True),  # the asking process's: say whether it was made
               quiet: bool = QuietOpt):
    """Compile the decode step generate() uses for a folder on this machine, once (a first
    generate() starts this in the background; docs/runtime.md)."""

    def go():
        from .evaluation.step_cache import precompile as run

        keys, seconds = run(model, batch, max_length, threads or None, dtype)
        if not keys:
            typer.echo(f"error: the decode step of {model} did not compile (the warning above says why); "
                       "generate() decodes it eagerly", err=True)
            raise typer.Exit(1)
        if key is not None and key not in keys:
            raise UsageError(f"precompile: the step compiled from {model} is not the one asked for ({key}): the "
                             "asking process's model differs from the folder's", "nothing to do: it decodes eagerly")
        typer.echo(f"decode step of {model} ready in {seconds:.0f} s: {', '.join(keys)}")

    _do(quiet, go)


def main() -> None:
    app()  # the process was set up before torch loaded (wscompress/__init__.py: the command's own process only)


if __name__ == "__main__":
    sys.exit(main())
