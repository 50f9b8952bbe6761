"""lm-eval-harness on the in-memory model (compressed modules included), offline-friendly.

A task in the recipe is one of:

- a standard lm-eval task or group name (``hellaswag``, ``arc_easy``; its data comes from the hub);
- a task shipped with wscompress (``wscompress/evaluation/tasks/<name>.yaml``, e.g. ``wscompress_sentiment``);
- the path of a local task YAML file (lm-eval's task format; ``!function`` and ``include`` work).

Local tasks usually read local JSON/CSV files through ``dataset_kwargs.data_files``. Relative data
paths are resolved when the task runs: ``eval.task_data.<task>`` in the recipe wins, then the
current directory, then the YAML file's own directory, so a task file can travel with its data.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from torch import nn

from ..errors import UsageError, need
from ..io import distributed
from ..io.offload import model_device, offload_of

TASKS_DIR = Path(__file__).resolve().parent / "tasks"


def shipped_tasks() -> dict[str, Path]:
    """Task name -> YAML file of the tasks that ship with wscompress."""
    return {p.stem: p for p in sorted(TASKS_DIR.glob("*.yaml"))}


def _resolve_data(files: Any, yaml_dir: Path, override: str | None, task: str) -> Any:
    """``data_files`` (str, list or split -> str/list) with every relative path made absolute."""
    if override is not None:
        path = Path(override).expanduser()
        if not path.is_file():
            raise UsageError(f"eval.task_data.{task}: {override} not found", "give the path of the task's data file")
        return {split: str(path.resolve()) for split in files} if isinstance(files, dict) else str(path.resolve())
    if isinstance(files, dict):
        return {split: _resolve_data(f, yaml_dir, None, task) for split, f in files.items()}
    if isinstance(files, list):
        return [_resolve_data(f, yaml_dir, None, task) for f in files]
    path = Path(files).expanduser()
    for candidate in ([path] if path.is_absolute() else [Path.cwd() / path, yaml_dir / path]):
        if candidate.is_file():
            return str(candidate.resolve())
    raise UsageError(f"task {task}: data file {files} not found (looked in {Path.cwd()} and {yaml_dir})",
                     f"run from the folder it is relative to, or set eval.task_data.{task}=/path/to/{path.name}")


def local_task(path: Path, task_data: dict[str, str]) -> dict:
    """A local task YAML loaded as an lm-eval config dict, its data paths resolved
    (``task_data``: task name -> data file that replaces the YAML's)."""
    from lm_eval.tasks._yaml_loader import load_yaml

    try:
        cfg = load_yaml(path)
    except (OSError, ValueError, ImportError, AttributeError) as err:
        raise UsageError(f"task file {path}: {type(err).__name__}: {err}", "fix the task YAML (lm-eval task format)") from None
    if "task" not in cfg:
        raise UsageError(f"task file {path}: no 'task:' name", "local task files define one task ('task: NAME')")
    data_override = task_data.get(cfg["task"])
    kwargs = dict(cfg.get("dataset_kwargs") or {})
    if "data_files" in kwargs:
        kwargs["data_files"] = _resolve_data(kwargs["data_files"], path.parent, data_override, cfg["task"])
        cfg["dataset_kwargs"] = kwargs
    elif data_override is not None:
        raise UsageError(f"eval.task_data.{cfg['task']}: task {path} reads no local data files",
                         "remove that key; it only applies to tasks with dataset_kwargs.data_files")
    return cfg


def task_specs(tasks: list[str], task_data: dict[str, str]) -> tuple[list[str | dict], list[Path]]:
    """(specs for lm-eval: names or config dicts, folders to index for includes/groups)."""
    need("lm_eval", "eval", "eval.tasks (lm-eval)")
    shipped = shipped_tasks()
    specs: list[str | dict] = []
    folders = [TASKS_DIR]
    for task in tasks:
        path = shipped.get(task) or (Path(task).expanduser() if task.endswith((".yaml", ".yml")) else None)
        if path is None:
            specs.append(task)
            continue
        if not path.is_file():
            raise UsageError(f"eval.tasks: task file {task} not found", "give an existing lm-eval task YAML or a task name")
        specs.append(local_task(path, task_data))
        folders.append(path.parent.resolve())
    unused = set(task_data) - {s["task"] for s in specs if isinstance(s, dict)}
    if unused:
        raise UsageError(f"eval.task_data: {', '.join(sorted(unused))} is not a local task of eval.tasks",
                         "key task_data by the task's name (its YAML 'task:')")
    return specs, list(dict.fromkeys(folders))


def _metrics(values: dict) -> dict:
    """lm-eval's 'acc,none' keys -> 'acc'; the alias and sample counts dropped."""
    out = {}
    for key, value in values.items():
        metric, _, flt = key.partition(",")
        if metric == "alias" or not isinstance(value, (int, float)):
            continue
        out[metric if flt in ("", "none") else f"{metric}[{flt}]"] = value
    return out


def run_tasks(model: nn.Module, tokenizer, tasks: list[str], limit: int | None = None, batch_size: int = 4,
              task_data: dict[str, str] | None = None, seed: int = 0, bos: str = "auto") -> dict[str, dict]:
    """Evaluate ``model`` on lm-eval tasks; returns task -> metrics (acc, acc_stderr, ...).
    ``bos`` as in ``eval.bos``: ``auto`` leaves it to the tokenizer, ``none`` never adds one,
    ``window``/``stream`` open every request with it."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    specs, folders = task_specs(tasks, task_data or {})
    # indexing lm-eval's thousands of task files takes seconds: only when a task is named
    manager = TaskManager(include_path=[str(f) for f in folders], include_defaults=any(isinstance(s, str) for s in specs))
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size,
              add_bos_token=None if bos == "auto" else bos != "none")
    rank, size = distributed.world()
    if size > 1:  # lm-eval's data-parallel mode: each process answers its share of the requests
        from accelerate import Accelerator

        lm.accelerator, lm._rank, lm._world_size = Accelerator(cpu=model_device(model).type == "cpu"), rank, size
    try:
        with offload_of(model).running():
            results = simple_evaluate(model=lm, tasks=specs, limit=limit, task_manager=manager, log_samples=False,
                                      random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed,
                                      fewshot_random_seed=seed)
    except KeyError as err:
        raise UsageError(f"eval.tasks: {err.args[0] if err.args else err}",
                         "use an lm-eval task name (`lm-eval ls tasks`), a shipped task "
                         f"({', '.join(shipped_tasks())}) or the path of a task YAML") from None
    except ConnectionError as err:
        raise UsageError(f"eval.tasks: a task's dataset could not be fetched ({err})",
                         "allow hub access (HF_DATASETS_OFFLINE=0) or use local task files") from None
    if results is None:  # lm-eval gathers the results in the first process of a launch
        return {}
    return {task: _metrics(values) for task, values in results["results"].items()}
