"""Recovery fine-tuning of a (compressed) model.

Modes: ``method`` trains only the compressed layers' own parameters (coefficients, low-rank
deltas, centroids: whatever ``trainable_parameters()`` of each compressed layer returns, all
its parameters by default), ``full`` trains everything, ``lora`` trains peft LoRA adapters on
the plain linears named by ``lora.targets`` (merged back at the end, so the compressed
structure stays as it was) and ``dkm`` clusters weights with differentiable k-means while
training (see ``dkm.py``).

``finetune`` is the driver; its parts: ``training_loss`` (the LM loss, or distillation from the
original model), ``prepare`` (what trains, by mode), ``Trainer`` (optimiser, schedule, time
budget, mixed precision, processes, checkpoints), ``TrainingText`` (the batches of each step)
and ``evaluator`` (perplexity during and after training).

Resuming is exact: batches are drawn deterministically from (seed, step) and a checkpoint holds
the trained tensors, the optimizer, the schedule, the RNG states and the loss history, so a run
interrupted and resumed ends where an uninterrupted one would.
"""

from __future__ import annotations

import contextlib
import json
import math
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from ..errors import UsageError, need
from ..evaluation.perplexity import evaluate_text
from ..io import data, distributed, storage, ui
from ..io.files import save_tensors
from ..io.offload import model_device, offload_of
from ..model.arch import match_modules
from ..model.forms.wscompress_format import CompressedLinear
from ..recipe.schema import FinetuneConfig, Recipe

CKPT = "finetune-checkpoint"
# what must match for a checkpoint to continue the same run
RESUME_KEYS = ("mode", "dataset", "seq_len", "batch_size", "grad_accum", "steps", "lr", "weight_decay", "schedule",
               "warmup_steps", "max_minutes", "penalty", "norms", "lora", "dkm", "bos", "distill", "seed")


def _run_config(cfg: FinetuneConfig) -> dict:
    """The settings a checkpoint records (as JSON values)."""
    return {k: v.model_dump() if hasattr(v, "model_dump") else v for k in RESUME_KEYS for v in [getattr(cfg, k)]}


def method_parameters(model: nn.Module, norms: bool = False) -> list[nn.Parameter]:
    """What ``mode: method`` trains: each compressed layer's ``trainable_parameters()`` (all its
    parameters by default) and the parameters of the modules structural stages marked
    (``storage.mark_trainable``: shared, merged, pooled modules, factorised embeddings); with
    ``norms`` the normalisation layers' too (each parameter once, however many reach it)."""
    params: dict[int, nn.Parameter] = {}
    for module in model.modules():
        if isinstance(module, CompressedLinear) or hasattr(module, "trainable_parameters"):
            getter = getattr(module, "trainable_parameters", module.parameters)
            params.update((id(p), p) for p in getter())
        elif norms and type(module).__name__.endswith("Norm"):
            params.update((id(p), p) for p in module.parameters())
    for module in storage.trainable_modules(model):
        params.update((id(p), p) for p in module.parameters())
    return list(params.values())


def lora_target_names(model: nn.Module, patterns: list[str]) -> list[str]:
    """Plain linears matching ``patterns`` that LoRA can be merged into without changing the
    structure: modules referenced under one name only (a shared basis would receive the sum of
    every layer's adapter on merge, changing the function)."""
    names: dict[int, list[str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        names.setdefault(id(module), []).append(name)
    matched = match_modules(model, patterns, what="finetune.lora.targets")
    targets = [n for n, m in matched.items() if len(names[id(m)]) == 1]
    if len(targets) < len(matched):
        ui.log(f"[yellow]LoRA skips {len(matched) - len(targets)} shared modules (trained by mode: method instead)[/]")
    if not targets:
        raise UsageError("finetune.lora.targets: every matching linear is shared between layers",
                         "target per-layer modules (e.g. coeff) or use mode: method")
    return targets


def with_penalty(model: nn.Module, weight: float, extra_loss: Callable | None) -> Callable[[nn.Module], torch.Tensor]:
    """``extra_loss`` plus ``weight`` times the sum of the layers' own ``penalty()`` terms
    (soft_share: the Frobenius norms ||A_l B_l||^2 of its low-rank deltas)."""
    terms = [m for m in model.modules() if callable(getattr(m, "penalty", None))]
    if not terms:
        raise UsageError("finetune.penalty is set but no layer of the model has a penalty term",
                         "set finetune.penalty: 0, or compress with a method that has one (soft_share)")

    def loss(m: nn.Module) -> torch.Tensor:
        total = weight * sum(t.penalty() for t in terms)
        return total if extra_loss is None else total + extra_loss(m)
    return loss


def prepare(model: nn.Module, cfg: FinetuneConfig) -> tuple[nn.Module, list[nn.Parameter], list[torch.Tensor], Callable[[], dict]]:
    """Select the trainable parameters for the mode; returns (model, params, other state a
    resumable checkpoint must hold, finalize)."""
    for p in model.parameters():
        p.requires_grad_(False)
    finalize: Callable[[], dict] = dict
    state: list[torch.Tensor] = []
    if cfg.mode in ("full", "method"):  # palettized and trellis layers hold values as stored: train them in float32
        thawed = [m for m in model.modules() if hasattr(m, "train_values")]
        for m in thawed:
            m.train_values()

        def finalize() -> dict:  # held as stored again, rounded as saving rounds them
            for m in thawed:
                m.train_values(False)
            return {}
    if cfg.mode == "full":
        params = list(model.parameters())
    elif cfg.mode == "method":
        if not method_parameters(model):
            raise UsageError("finetune.mode 'method': the model has no compressed layers or shared modules to train",
                             "use mode: full or lora, or compress the model first")
        params = method_parameters(model, cfg.norms)
    elif cfg.mode == "lora":
        peft = need("peft", "finetune", "finetune.mode: lora")
        LoraConfig, get_peft_model = peft.LoraConfig, peft.get_peft_model

        targets = lora_target_names(model, cfg.lora.targets)
        model = get_peft_model(model, LoraConfig(r=cfg.lora.rank, lora_alpha=cfg.lora.alpha, target_modules=targets))
        params = [p for p in model.parameters() if p.requires_grad]

        def finalize() -> dict:
            return {"lora_modules": len(targets), "lora_merged": True}
    else:  # dkm
        from .dkm import prepare_dkm

        params, state, finalize = prepare_dkm(model, cfg.dkm)
    for p in params:
        p.requires_grad_(True)
    return model, params, state, finalize


def lr_at(step: int, cfg: FinetuneConfig, spent: float = 0.0) -> float:
    """Learning-rate factor: linear warm-up, then constant, linear or cosine decay to 0 over the
    steps or, with ``max_minutes``, over the time budget (``spent``: its used fraction), whichever
    ends first."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    progress = min(max((step - cfg.warmup_steps) / max(cfg.steps - cfg.warmup_steps, 1), spent), 1.0)
    return {"constant": 1.0, "linear": 1.0 - progress, "cosine": 0.5 * (1 + math.cos(math.pi * progress))}[cfg.schedule]


class Clock:
    """Training seconds (evaluations excluded) against an optional budget in minutes. Under
    several processes the first rank out of time stops them all, so every rank stops at the same step."""

    def __init__(self, minutes: float | None, device: torch.device):
        self.budget, self.device = None if minutes is None else 60.0 * minutes, device
        self.before, self._since, self._held = 0.0, None, 0.0

    def start(self) -> None:
        self._since = time.perf_counter()

    def seconds(self) -> float:
        return self.before + (time.perf_counter() - self._since - self._held if self._since is not None else 0.0)

    def spent(self) -> float:
        return 0.0 if self.budget is None else self.seconds() / self.budget

    def out(self) -> bool:
        if self.budget is None:
            return False
        return bool(distributed.reduced(torch.tensor([float(self.seconds() >= self.budget)], device=self.device)) > 0)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        t = time.perf_counter()
        try:
            yield
        finally:
            self._held += time.perf_counter() - t


def _rng_state() -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state.update({f"cuda{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
    return state


def _save_checkpoint(path: Path, step: int, params: list[torch.Tensor], opt, sched, history: list, cfg: FinetuneConfig) -> None:
    """Write the checkpoint next to the old one, then swap: an interruption never leaves half of one."""
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_tensors({f"p{i}": p for i, p in enumerate(params)}, tmp / "params.safetensors")
    torch.save({"optimizer": opt.state_dict(), "scheduler": sched.state_dict(), "rng": _rng_state()}, tmp / "state.pt")
    run = _run_config(cfg)
    (tmp / "progress.json").write_text(json.dumps({"step": step, "history": history, "config": run}))
    shutil.rmtree(path, ignore_errors=True)
    tmp.rename(path)


def _load_checkpoint(path: Path, params: list[torch.Tensor], opt, sched, cfg: FinetuneConfig) -> tuple[int, list]:
    progress = json.loads((path / "progress.json").read_text())
    changed = [k for k, v in _run_config(cfg).items() if progress["config"].get(k) != v]
    if changed:
        raise UsageError(f"{path}: the checkpoint is of another run (finetune.{', finetune.'.join(changed)} differ)",
                         "resume with the recipe the run started with, or drop --resume to start over")
    tensors = load_file(path / "params.safetensors")
    if len(tensors) != len(params) or any(tensors[f"p{i}"].shape != p.shape for i, p in enumerate(params)):
        raise UsageError(f"{path}: the checkpoint's tensors do not match this model's trainable parameters",
                         "resume on the model the run started from, or drop --resume to start over")
    with torch.no_grad():
        for i, p in enumerate(params):
            p.copy_(tensors[f"p{i}"])
    state = torch.load(path / "state.pt", weights_only=True)
    opt.load_state_dict(state["optimizer"])
    sched.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["rng"]["cpu"])
    if torch.cuda.is_available() and "cuda0" in state["rng"]:
        torch.cuda.set_rng_state_all([state["rng"][f"cuda{i}"] for i in range(torch.cuda.device_count())])
    return progress["step"], progress["history"]


def _mixed_precision(cfg: FinetuneConfig, device: torch.device, params: list[nn.Parameter]):
    """(autocast context, grad scaler): half-precision compute on CUDA, plain fp32 elsewhere."""
    if cfg.mixed_precision == "no" or device.type != "cuda":
        if cfg.mixed_precision != "no":
            ui.log(f"[yellow]finetune.mixed_precision {cfg.mixed_precision} applies on CUDA only; training in the model's dtype[/]")
        return contextlib.nullcontext(), torch.amp.GradScaler("cuda", enabled=False)
    dtype = torch.bfloat16 if cfg.mixed_precision == "bf16" else torch.float16
    if dtype == torch.float16 and any(p.dtype == torch.float16 for p in params):
        raise UsageError("finetune.mixed_precision fp16 needs float32 trainable weights (the loss scaler unscales fp32 gradients)",
                         "load the model with model.dtype: float32, or use mixed_precision: bf16")
    return torch.autocast("cuda", dtype=dtype), torch.amp.GradScaler("cuda", enabled=dtype == torch.float16)


def finetune(model: nn.Module, tokenizer, recipe: Recipe, resume: bool = False,
             stop_after: int | None = None, extra_loss: Callable[[nn.Module], torch.Tensor] | None = None,
             teacher: nn.Module | None = None) -> tuple[nn.Module, dict]:
    """Train ``model`` per ``recipe.finetune``; returns (the trained model, losses and perplexities).

    ``stop_after`` ends the loop early (as an interruption would) after saving a checkpoint.
    ``extra_loss`` adds a regulariser (e.g. soft_share's Frobenius penalty on its deltas).
    With ``finetune.distill`` the loss is distillation from ``teacher`` (default: the recipe's
    model, loaded here; see ``distill``).
    """
    cfg = recipe.finetune
    if offload_of(model).moves:
        raise UsageError(f"finetune trains the whole model at once; model.offload: {offload_of(model).mode} keeps its layers "
                         "elsewhere", "set model.offload: none (a model too large for one device: accelerate launch "
                         "with an FSDP config, see docs/scale.md)")
    torch.manual_seed(cfg.seed)
    loss, teacher = training_loss(model, tokenizer, recipe, teacher)
    model, params, state, finalize = prepare(model, cfg)
    if cfg.penalty > 0:
        extra_loss = with_penalty(model, cfg.penalty, extra_loss)
    trainer = Trainer(model, params, state, cfg, recipe.out / CKPT, resume)
    text = TrainingText(tokenizer, cfg)
    evaluate = evaluator(model, tokenizer, recipe)
    start = time.perf_counter()
    trainer.clock.start()
    local = trainer.layerwise(teacher, text) if cfg.distill is not None and cfg.distill.layerwise_steps else None
    stopped = trainer.train(text, loss, extra_loss, evaluate, stop_after)
    if stopped is not None:
        return model, stopped
    final_ppl = trainer.history[-1]["ppl"] if trainer.history and "ppl" in trainer.history[-1] else evaluate()
    model = trainer.finish()
    return model, {"mode": cfg.mode, "steps": trainer.history[-1]["step"] if trainer.history else trainer.first,
                   "bos": text.bos, "distill": None if cfg.distill is None else cfg.distill.model_dump(),
                   "layerwise": local, "trainable_params": sum(p.numel() for p in params),
                   "final_loss": trainer.history[-1]["loss"] if trainer.history else None, "final_ppl": final_ppl,
                   "seconds": round(time.perf_counter() - start, 2), "history": trainer.history, **finalize()}


Loss = Callable[[nn.Module, torch.Tensor, int], torch.Tensor]  # (model, token ids, batch number) -> loss


def training_loss(model: nn.Module, tokenizer, recipe: Recipe, teacher: nn.Module | None) -> tuple[Loss, nn.Module | None]:
    """The loss a step minimises, and the teacher it needs (None: none): the LM loss on the text,
    or with ``finetune.distill`` distillation from the original model (its top-k outputs read
    from a cache on disk when ``cache_topk`` is set and every batch is there)."""
    cfg = recipe.finetune
    if cfg.distill is None:
        return lambda m, x, _batch: m(input_ids=x, labels=x, use_cache=False).loss, None
    from .distill import TeacherCache, check_pair, distill_loss, load_teacher, teacher_key

    d = cfg.distill
    cache = None
    if d.cache_topk:  # the teacher's outputs depend on these, not on the learning rate or the mode
        sampling = {k: getattr(cfg, k) for k in ("dataset", "seq_len", "batch_size", "grad_accum", "steps", "seed", "bos")}
        cache = TeacherCache(recipe.out / "teacher-cache", teacher_key(recipe.model, {
            **sampling, "temperature": d.temperature, "k": d.cache_topk}), d.cache_topk)
    if teacher is not None:
        check_pair(teacher, tokenizer, model, tokenizer)
    elif cache is None or d.layerwise_steps or not cache.complete(range(cfg.steps * cfg.grad_accum)):
        teacher = load_teacher(recipe.model, d, model, tokenizer)
    return distill_loss(teacher, d, cache), teacher


class TrainingText:
    """The training text as tokens, and the batches of each step: drawn from (seed, step), so a
    resumed run sees the batches an uninterrupted one would."""

    def __init__(self, tokenizer, cfg: FinetuneConfig):
        self.cfg = cfg
        self.bos = data.resolve_bos(tokenizer, cfg.bos)
        self.bos_id = tokenizer.bos_token_id if self.bos == "window" else None
        self.ids = data.tokenize(tokenizer, cfg.dataset, bos=self.bos,
                                 max_tokens=max(cfg.steps * cfg.grad_accum * cfg.batch_size * cfg.seq_len, 200_000))

    def batch(self, step: int, micro: int) -> torch.Tensor:
        c = self.cfg
        (x,) = data.sample_batches(self.ids, c.batch_size, c.seq_len, c.batch_size,
                                   seed=c.seed * 1_000_003 + step * c.grad_accum + micro, bos_id=self.bos_id)
        return x

    def sequences(self, n: int) -> list[torch.Tensor]:
        """``n`` sequences for the layer-wise phase, in batches of the training batch size."""
        return data.sample_batches(self.ids, n, self.cfg.seq_len, self.cfg.batch_size, seed=self.cfg.seed, bos_id=self.bos_id)


def evaluator(model: nn.Module, tokenizer, recipe: Recipe) -> Callable[[], float | None]:
    """Perplexity on the first windows of the recipe's first evaluation text (None: it has none)."""
    cfg, source = recipe.finetune, recipe.eval.perplexity[0] if recipe.eval.perplexity else None

    def evaluate() -> float | None:
        if source is None:
            return None
        model.eval()
        ppl = evaluate_text(model, tokenizer, source, cfg.seq_len, max_windows=cfg.eval_windows, bos=recipe.eval.bos,
                            label="finetune eval")["ppl"]
        model.train()
        return ppl
    return evaluate


class Trainer:
    """The training machinery around the model: optimiser and schedule, the time budget, mixed
    precision, several processes (DDP), and the resumable checkpoint in ``ckpt``."""

    def __init__(self, model: nn.Module, params: list[nn.Parameter], state: list[torch.Tensor], cfg: FinetuneConfig,
                 ckpt: Path, resume: bool):
        self.model, self.params, self.state, self.cfg, self.ckpt = model, params, state, cfg, ckpt
        self.device = model_device(model)
        self.rank, self.size = distributed.world()
        if cfg.batch_size % self.size:
            raise UsageError(f"finetune.batch_size {cfg.batch_size} does not split over {self.size} processes",
                             f"use a batch size divisible by {self.size} (it is the global batch: each process takes its share)")
        self.trained = model
        if self.size > 1:  # DDP (or FSDP, from the launch's accelerate config): gradients averaged over the processes
            from accelerate import Accelerator

            self.trained = Accelerator(cpu=self.device.type == "cpu").prepare_model(model)
        self.opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.clock = Clock(cfg.max_minutes, self.device)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: lr_at(s, cfg, self.clock.spent()))
        self.autocast, self.scaler = _mixed_precision(cfg, self.device, params)
        self.first, self.history = 0, []
        if resume:
            if ckpt.is_dir():
                self.first, self.history = _load_checkpoint(ckpt, [*params, *state], self.opt, self.sched, cfg)
                self.clock.before = self.history[-1]["seconds"] if self.history else 0.0
                ui.log(f"resumed from {ckpt} at step {self.first}")
            else:
                ui.log(f"[yellow]no checkpoint at {ckpt}; starting from step 0[/]")

    def layerwise(self, teacher: nn.Module, text: TrainingText) -> dict | None:
        """Layer-wise distillation before the global loss (not again on a resumed run)."""
        if self.first:
            return None
        from .distill import layerwise

        d = self.cfg.distill
        share = None if self.clock.budget is None else d.layerwise_share * self.clock.budget
        batches = [b.to(self.device) for b in text.sequences(d.layerwise_samples)]
        return layerwise(self.model, teacher, batches, self.params, d.layerwise_steps, d.layerwise_lr, seconds=share)

    def step(self, text: TrainingText, step: int, loss: Loss, extra_loss: Callable | None) -> float:
        """One optimiser step over ``grad_accum`` micro-batches; the mean loss."""
        total = 0.0
        for micro in range(self.cfg.grad_accum):
            x = text.batch(step, micro)[self.rank::self.size].to(self.device)  # this process's share of the batch
            with self.autocast:
                value = loss(self.trained, x, step * self.cfg.grad_accum + micro)
                if extra_loss is not None:
                    value = value + extra_loss(self.model)
            self.scaler.scale(value / self.cfg.grad_accum).backward()
            total += value.item() / self.cfg.grad_accum
        self.scaler.unscale_(self.opt)
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.scaler.step(self.opt)
        self.scaler.update()
        self.opt.zero_grad(set_to_none=True)
        self.sched.step()
        return total

    def train(self, text: TrainingText, loss: Loss, extra_loss: Callable | None, evaluate: Callable[[], float | None],
              stop_after: int | None) -> dict | None:
        """The steps from ``first`` on, evaluating and checkpointing as configured, until the steps
        or the time budget run out; a report when ``stop_after`` interrupted it, else None."""
        cfg = self.cfg
        self.model.train()
        for step in ui.track(range(self.first, cfg.steps), "finetune steps", total=cfg.steps - self.first):
            total = self.step(text, step, loss, extra_loss)
            entry = {"step": step + 1, "loss": total, "lr": self.sched.get_last_lr()[0], "seconds": round(self.clock.seconds(), 3)}
            out_of_time = self.clock.out()
            if cfg.eval_every and ((step + 1) % cfg.eval_every == 0 or out_of_time):
                with self.clock.paused():
                    entry["ppl"] = evaluate()
                ui.log(f"step {step + 1}: loss {total:.4f}, ppl {entry['ppl']}")
            self.history.append(entry)
            if out_of_time:
                ui.log(f"finetune: the {cfg.max_minutes:g}-minute budget is spent after {step + 1} steps")
                return None
            interrupted = stop_after is not None and step + 1 >= stop_after
            if (cfg.save_every and (step + 1) % cfg.save_every == 0) or interrupted:
                if distributed.is_main():
                    _save_checkpoint(self.ckpt, step + 1, [*self.params, *self.state], self.opt, self.sched, self.history, cfg)
                distributed.barrier()
            if interrupted:
                return {"interrupted_at": step + 1, "checkpoint": str(self.ckpt), "history": self.history}
        return None

    def finish(self) -> nn.Module:
        """The trained model, frozen (LoRA merged into its linears)."""
        model = self.model
        model.eval()
        if self.cfg.mode == "lora":
            model = model.merge_and_unload()
        for p in model.parameters():
            p.requires_grad_(False)
        return model
