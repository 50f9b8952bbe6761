"""The steps of a recipe: calibrate -> compress -> finetune -> eval -> bench.

Each step reads the recipe, does its work and writes ``<output>/reports/<step>.json/.md``.
``compress`` writes the model to ``<output>/model`` (atomically), ``finetune`` replaces it
with the fine-tuned one, ``eval``/``bench`` measure it against the original checkpoint.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Literal

import torch
from torch import nn

from .errors import UsageError, need
from .evaluation import bench, report
from .io import data, distributed, storage, ui
from .io.checkpoints import load_model, model_structure
from .io.offload import offload_of
from .pipeline import calibration
from .pipeline.context import Context
from .recipe.load import recipe_dict
from .recipe.schema import BenchConfig, FinetuneConfig, ModelConfig, Recipe

Section = Literal["calibration", "compress", "finetune", "eval"]


def preflight(recipe: Recipe, sections: set[Section]) -> None:
    """Check what a step will need before it spends any time: the output folder, every text
    source of ``sections``, every lm-eval task and task data file the recipe names, and, on
    the model's structure (its modules on the meta device: no weight is read), every stage's
    options and the fine-tuning targets."""
    out = recipe.out
    for p in (out, *out.parents):
        if p.exists() and not p.is_dir():
            raise UsageError(f"output.dir: {p} is a file, not a folder", f"choose another output folder than {out} (-o DIR)")
    finetune = recipe.finetune if "finetune" in sections and recipe.finetune is not None and recipe.finetune.enabled else None
    if "calibration" in sections or "compress" in sections and recipe.compress:
        need("scipy", "compress", "calibration and compression")
    if "calibration" in sections:
        data.check_source(recipe.calibration.dataset, "calibration.dataset")
    if finetune is not None:
        data.check_source(finetune.dataset, "finetune.dataset")
        check_finetune(recipe)
    if "eval" in sections or "finetune" in sections:  # finetune evaluates on the first eval source
        for source in recipe.eval.perplexity:
            data.check_source(source, "eval.perplexity")
    if "eval" in sections and (recipe.eval.tasks or recipe.eval.task_data):
        from .evaluation.lmeval import task_specs

        task_specs(recipe.eval.tasks, recipe.eval.task_data)
    stages = recipe.compress if "compress" in sections else []
    for i, stage in enumerate(stages):
        check_offload(i, stage.method, recipe.model.offload)
    tuned = finetune is not None and finetune.mode in ("lora", "dkm")
    if sections:
        # the model the stages start from; the run's compressed output, if any, for the steps after compress
        model = model_structure(recipe.model if stages else _trained_model_config(recipe))
        if model is not None:
            check_structure(model, recipe, stages, finetune if tuned else None, sections)


def check_offload(index: int, method: str, offload: str) -> None:
    """A stage that needs every layer at once cannot run on layers that rest on disk."""
    from .methods import METHODS

    if METHODS[method].whole_model and offload == "disk":
        raise UsageError(f"compress.{index}: {method} needs every decoder layer in memory at once, which "
                         "model.offload: disk does not keep", "use model.offload: cpu (or none) for this recipe")


def check_finetune(recipe: Recipe) -> None:
    """Fine-tuning options that a run would otherwise refuse only once it trains."""
    cfg = recipe.finetune
    processes = distributed.world()[1]
    if cfg.batch_size % processes:
        raise UsageError(f"finetune.batch_size {cfg.batch_size} does not split over {processes} processes",
                         f"use a batch size divisible by {processes} (it is the global batch: each process takes its share)")
    if recipe.model.offload == "disk" or recipe.model.offload == "cpu" and recipe.model.device.startswith("cuda"):
        raise UsageError(f"finetune trains the whole model at once; model.offload: {recipe.model.offload} keeps its "
                         "layers elsewhere", "set model.offload: none (a model too large for one device: accelerate "
                         "launch with an FSDP config, see docs/scale.md)")
    if cfg.mode == "lora":
        need("peft", "finetune", "finetune.mode: lora")
    if cfg.mode == "dkm":
        from .recovery.dkm import kmeans_stage

        kmeans_stage(cfg.dkm)


def check_structure(model: nn.Module, recipe: Recipe, stages: list, finetune: FinetuneConfig | None,
                    sections: set[Section]) -> None:
    """Options against the model's structure: every stage's exactly (its ``check``) where the
    structure it starts from is known beforehand: the first stage's, and a later targeted stage's
    whose targets are modules of the original model that no stage before it replaces, after
    targeted stages only (they replace just what they target). Another later stage (its targets
    name what an earlier stage creates, e.g. ``coeff``, whose shapes that stage's work decides,
    or it follows a stage that rebuilds layers) has its target patterns matched against the
    names it may meet here, and its full check runs as it starts. The fine-tuning targets
    likewise; and no sequence longer than the model's positions."""
    from .model.arch import match_modules
    from .model.forms.wscompress_format import LAYERS
    from .recipe.schema import TargetedStage

    if stages and not savable(model):
        raise UsageError(f"model.path: {type(model).__name__} ({model.config.model_type}) is not an architecture "
                         "transformers ships, so no compressed folder can name it for loading",
                         "compress a checkpoint of a LLaMA, Mistral, Qwen2, Gemma, GPT-2, OPT, ... architecture")
    names = [n for n, _ in model.named_modules()]
    children = sorted({c for layer in LAYERS.values() for c in layer.CHILDREN})  # what each form declares it holds
    later = names + [f"{n}.{c}" for n in names for c in children]
    replaced: set[str] | None = set()  # what the stages so far replace (None: not known beforehand)
    for i, stage in enumerate(stages):
        targets = _targets(model, stage) if isinstance(stage, TargetedStage) else None
        untargeted = not isinstance(stage, TargetedStage)  # checked on the original structure, as always
        if untargeted or i == 0 or replaced is not None and targets is not None and not targets & replaced:
            stage.check(model)  # it starts from the original structure where it reads it
        else:
            _names_match(later, stage.targets, f"compress.{i}.targets")
        replaced = None if replaced is None or targets is None else replaced | targets
    if finetune is not None:
        patterns, what = (finetune.lora.targets, "finetune.lora.targets") if finetune.mode == "lora" else \
            (finetune.dkm.targets, "finetune.dkm.targets")
        if stages:
            _names_match(later, patterns, what)
        else:
            match_modules(model, patterns, what=what)
    positions = getattr(model.config, "max_position_embeddings", None) or getattr(model.config, "n_positions", None)
    lengths = {"calibration.seq_len": recipe.calibration.seq_len, "eval.context_length": recipe.eval.context_length,
               "finetune.seq_len": recipe.finetune.seq_len if recipe.finetune is not None else 0}
    lengths = {k: v for k, v in lengths.items() if k.split(".")[0] in sections}
    for key, length in lengths.items():
        if positions and length > positions:
            raise UsageError(f"{key} {length} exceeds the {positions} positions the model has",
                             f"use a {key.split('.')[1]} of at most {positions}")


def _targets(model: nn.Module, stage) -> set[str] | None:
    """The original modules a targeted stage replaces, or None where its patterns name modules
    the original does not have (a form's child, made by an earlier stage)."""
    from .model.arch import target_layers

    try:
        return set(target_layers(model, stage))
    except UsageError:
        return None


def _names_match(names: list[str], patterns: list[str], what: str) -> None:
    """Every regex matches some name (a typo should not silently compress or train nothing)."""
    import re

    for pattern in patterns:
        try:
            rx = re.compile(pattern)
        except re.error as err:
            raise UsageError(f"{what}: {pattern!r} is not a valid regex: {err}") from None
        if not any(rx.search(n) for n in names):
            raise UsageError(f"{what}: pattern {pattern!r} matches no module",
                             f"patterns are regexes searched in module names such as {', '.join(names[4:8])}")


def stats_dir(recipe: Recipe) -> Path:
    return recipe.out / "calibration"


def model_path(recipe: Recipe) -> Path:
    return recipe.out / "model"


def apply_stages(model: nn.Module, tokenizer, recipe: Recipe, workdir: str | Path | None = None) -> list[dict]:
    """Run every compress stage in order on ``model`` (in place); one report row per stage.
    Statistics a stage computes for itself go to a scratch folder in ``workdir``."""
    from .methods import METHODS
    from .model.forms.wscompress_format import adopt

    ctx = Context(recipe.calibration, tokenizer, workdir, stats_dir(recipe))
    rows = []
    offload = offload_of(model)
    for i, stage in enumerate(recipe.compress):
        check_offload(i, stage.method, offload.mode)
        before = storage.stats(model)
        start = time.perf_counter()
        with torch.no_grad():  # compression builds no graphs (a stage that needs gradients enables them itself)
            result = METHODS[stage.method].apply(model, stage, ctx)
        storage.mark_trainable(model, result.get("trains", []))
        ctx.stages_done += 1
        after = storage.stats(model)
        rows.append({"stage": i, "method": stage.method, "bytes_before": before["tensor_bytes"],
                     "bytes_after": after["tensor_bytes"], "bits_per_weight": round(after["bits_per_weight"], 3),
                     "params_before": before["params"], "params_after": after["params"],
                     "seconds": round(time.perf_counter() - start, 2), "calibration": ctx.describe(), **result})
        ui.log(f"stage {i} {stage.method}: {before['tensor_bytes'] / 2**20:,.1f} -> {after['tensor_bytes'] / 2**20:,.1f} MB "
               f"({before['bits_per_weight']:.2f} -> {after['bits_per_weight']:.2f} bits a weight; "
               f"{before['params']:,} -> {after['params']:,} parameters)")
    if savable(model):
        adopt(model)  # a compressed model: its own save_pretrained writes a folder transformers loads back
    return rows


def savable(model: nn.Module) -> bool:
    """Whether a compressed folder can describe ``model``: a transformers causal LM of an
    architecture transformers ships (the folder names it for loading)."""
    from transformers import PreTrainedModel

    from .model.forms.wscompress_format import family

    if not isinstance(model, PreTrainedModel):
        return False
    try:
        family(getattr(model.config, "base_model_type", None) or model.config.model_type)
    except (ValueError, KeyError):
        return False
    return True


def step_calibrate(recipe: Recipe) -> dict:
    """Collect input Gram matrices of every decoder-layer linear (and the output sensitivities
    when a stage allocates ranks) and save them for `compress`."""
    from .model.arch import discover

    preflight(recipe, {"calibration"})
    model, tokenizer = load_model(recipe.model)
    arch = discover(model)
    names = [n for i in range(arch.num_layers) for n in arch.projections(i).values()]
    ctx = Context(recipe.calibration, tokenizer, saved=stats_dir(recipe))
    start = time.perf_counter()
    # the stages that allocate ranks also need the output sensitivities: saved alongside
    samples = max((s.sensitivity_samples for s in recipe.compress if getattr(s, "allocates", False)), default=0)
    with distributed.shared_atomic_dir(stats_dir(recipe)) as folder:
        stats = calibration.collect_grams(model, ctx.calibration(), names, folder, ctx.stats_meta(model), samples,
                                        scratch=False, dtype=ctx.dtype(model))
    out = {"folder": str(stats_dir(recipe)), "calibration": ctx.describe(), "modules": len(stats.owner),
           "gram_matrices": len(stats), "tokens": sum(b.numel() for b in ctx.calibration()),
           "processes": distributed.world()[1], "seconds": round(time.perf_counter() - start, 2),
           "peak_memory_mb": round(report.peak_memory_mb(), 1)}
    if distributed.is_main():
        report.write(recipe.out, "calibrate", out, recipe_dict(recipe))
    return out


def step_compress(recipe: Recipe) -> dict:
    if not recipe.compress:
        raise UsageError(f"{recipe.source or 'recipe'}: compress: no stages", "add e.g. '- method: svd' with its options")
    preflight(recipe, {"calibration", "compress"})
    model, tokenizer = load_model(recipe.model)
    original = storage.stats(model)
    rows = apply_stages(model, tokenizer, recipe, recipe.out)
    saved = storage.save(model, tokenizer, model_path(recipe), recipe.output.max_shard_size)
    out = {"model": str(model_path(recipe)), "original": original, "compressed": saved,
           "size_ratio": saved["tensor_bytes"] / original["tensor_bytes"],
           "param_ratio": saved["params"] / original["params"], "stages": rows,
           "peak_memory_mb": round(report.peak_memory_mb(), 1)}
    report.write(recipe.out, "compress", out, recipe_dict(recipe))
    report.write_model_card(recipe.out)
    ui.show("compress", report.size_rows(out))
    return out


def step_finetune(recipe: Recipe, resume: bool = False) -> dict:
    from .recovery.finetune import finetune

    if recipe.finetune is None or not recipe.finetune.enabled:
        raise UsageError(f"{recipe.source or 'recipe'}: no finetune section", "add 'finetune:' with e.g. steps: 100")
    preflight(recipe, {"finetune"})
    model, tokenizer = load_model(_trained_model_config(recipe))
    model, out = finetune(model, tokenizer, recipe, resume=resume)
    if not distributed.is_main():  # every process trained the same weights; the first writes them
        return out
    out["saved"] = storage.save(model, tokenizer, model_path(recipe), recipe.output.max_shard_size)
    out["peak_memory_mb"] = round(report.peak_memory_mb(), 1)
    report.write(recipe.out, "finetune", out, recipe_dict(recipe))
    report.write_model_card(recipe.out)
    return out


def _trained_model_config(recipe: Recipe, path: str | None = None) -> ModelConfig:
    """The model section pointed at the run's own output when there is one (or at ``path``)."""
    target = path or (str(model_path(recipe)) if storage.is_compressed(model_path(recipe)) else None)
    return recipe.model if target is None else recipe.model.model_copy(update={"path": target, "gguf_file": None})


def evaluate(model: nn.Module, tokenizer, recipe: Recipe, original: bool = False) -> dict:
    """Perplexity (+ lm-eval tasks, samples) of ``model``; the ``original`` checkpoint's
    perplexities are computed once per model, text and protocol and then read from the cache."""
    e = recipe.eval
    from .evaluation.perplexity import evaluate_sources

    out = {"perplexity": evaluate_sources(model, tokenizer, e.perplexity, e.context_length, e.stride, e.batch_size,
                                          e.max_windows, e.bos, cache=original),
           **storage.stats(model)}
    if e.tasks:
        from .evaluation.lmeval import run_tasks

        out["tasks"] = run_tasks(model, tokenizer, e.tasks, e.limit, e.batch_size, e.task_data, recipe.seed, e.bos)
    if e.prompts:
        from .evaluation.samples import generate_samples

        out["samples"] = generate_samples(model, tokenizer, e.prompts, e.max_new_tokens)
    return out


def step_eval(recipe: Recipe, path: str | None = None) -> dict:
    """Evaluate the run's model (or ``path``) and, when it differs, the original checkpoint."""
    preflight(recipe, {"eval"})
    cfg = _trained_model_config(recipe, path)
    runs = {"model": cfg} if cfg == recipe.model else {"original": recipe.model, "compressed": cfg}
    results = {}
    for label, mcfg in runs.items():
        model, tokenizer = load_model(mcfg)
        results[label] = evaluate(model, tokenizer, recipe, original=mcfg == recipe.model)
        del model
    rows = [{"model": label, "source": data.source_label(src),
             **{k: r["perplexity"][src][k] for k in ("ppl", "tokens", "bos", "tokens_per_s")},
             "params": r["params"]} for label, r in results.items() for src in r["perplexity"]]
    out = {"results": rows, "details": results, "peak_memory_mb": round(report.peak_memory_mb(), 1)}
    tasks = [{"model": label, "task": task, **metrics} for label, r in results.items() for task, metrics in r.get("tasks", {}).items()]
    # one row per prompt, models side by side; whitespace folded for the Markdown table (raw text in details)
    samples = [{"prompt": s["prompt"], **{label: " ".join(r["samples"][i]["completion"].split()) for label, r in results.items()}}
               for i, s in enumerate(next(iter(results.values())).get("samples", []))]
    if tasks:
        out["tasks"] = tasks
    if samples:
        out["samples"] = samples
    report.write(recipe.out, "eval", out, recipe_dict(recipe))
    if path is None:  # the run's own model: its card gets the figures
        report.write_model_card(recipe.out)
    ui.show("eval", rows)
    if tasks:
        ui.show("lm-eval", tasks)
    return out


def step_run(recipe: Recipe) -> dict:
    """The whole recipe, as far as it has sections: compress (stages), finetune, eval, bench."""
    preflight(recipe, {"calibration", "compress", "finetune", "eval"})
    out = {}
    if recipe.compress:
        out["compress"] = step_compress(recipe)
    if recipe.finetune is not None and recipe.finetune.enabled:
        out["finetune"] = step_finetune(recipe)
    if "eval" in recipe.model_fields_set:
        out["eval"] = step_eval(recipe)
    if recipe.bench is not None:
        out["bench"] = step_bench(recipe)
    return out


def step_bench(recipe: Recipe) -> dict:
    """Benchmark the recipe's model and, when ``compress`` wrote one, ``<output>/model``."""
    preflight(recipe, set())
    cfg = recipe.bench or BenchConfig()
    models = {"original": recipe.model}
    if storage.is_compressed(model_path(recipe)):
        models["compressed"] = recipe.model.model_copy(update={"path": str(model_path(recipe)), "gguf_file": None})
    out = bench.compare(models, cfg)
    report.write(recipe.out, "bench", out, recipe_dict(recipe))
    report.write_model_card(recipe.out)
    ui.show("bench", out["table"])
    return out
