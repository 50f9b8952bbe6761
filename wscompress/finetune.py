"""Recovery fine-tuning of a (compressed) model.

Modes: ``method`` trains only the compressed layers' own parameters (coefficients, low-rank
deltas, centroids: whatever ``trainable_parameters()`` of each compressed layer returns, all
its parameters by default), ``full`` trains everything, ``lora`` trains peft LoRA adapters
(merged back at the end) and ``dkm`` clusters weights with differentiable k-means while
training (see ``methods/dkm.py``). Batches are drawn deterministically from (seed, step), so a
run resumed from a checkpoint sees exactly the data an uninterrupted run would.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from . import data, ui
from .errors import UsageError
from .evaluate.perplexity import perplexity
from .model import model_device
from .modules import CompressedLinear
from .recipe import FinetuneConfig, Recipe

CKPT = "finetune-checkpoint"


def method_parameters(model: nn.Module) -> list[nn.Parameter]:
    params: dict[int, nn.Parameter] = {}
    for module in model.modules():
        if isinstance(module, CompressedLinear) or hasattr(module, "trainable_parameters"):
            getter = getattr(module, "trainable_parameters", module.parameters)
            params.update((id(p), p) for p in getter())
    return list(params.values())


def prepare(model: nn.Module, cfg: FinetuneConfig) -> tuple[nn.Module, list[nn.Parameter], Callable[[], dict]]:
    """Select the trainable parameters for the mode; returns (model, params, finalize)."""
    for p in model.parameters():
        p.requires_grad_(False)
    finalize: Callable[[], dict] = dict
    if cfg.mode == "full":
        params = list(model.parameters())
    elif cfg.mode == "method":
        params = method_parameters(model)
        if not params:
            raise UsageError("finetune.mode 'method': the model has no compressed layers with parameters to train",
                             "use mode: full or lora, or compress the model first")
    elif cfg.mode == "lora":
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, target_modules="|".join(f".*{t}" for t in cfg.lora_targets))
        try:
            model = get_peft_model(model, lora)
        except ValueError as err:
            raise UsageError(f"finetune.lora_targets: {err}", "name nn.Linear modules, e.g. [q_proj, v_proj]") from None
        params = [p for p in model.parameters() if p.requires_grad]

        def finalize() -> dict:
            return {"lora_merged": True}
    else:  # dkm
        from .methods.dkm import prepare_dkm

        params, finalize = prepare_dkm(model, cfg.dkm)
    for p in params:
        p.requires_grad_(True)
    return model, params, finalize


def lr_at(step: int, cfg: FinetuneConfig) -> float:
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(cfg.steps - cfg.warmup_steps, 1)
    return {"constant": 1.0, "linear": 1.0 - progress, "cosine": 0.5 * (1 + math.cos(math.pi * progress))}[cfg.schedule]


def _save_checkpoint(path: Path, step: int, params: dict[str, nn.Parameter], opt, sched, history: list) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    save_file({k: p.detach().contiguous().cpu() for k, p in params.items()}, tmp / "params.safetensors")
    torch.save({"optimizer": opt.state_dict(), "scheduler": sched.state_dict()}, tmp / "state.pt")
    (tmp / "progress.json").write_text(json.dumps({"step": step, "history": history}))
    if path.exists():
        import shutil

        shutil.rmtree(path)
    tmp.rename(path)


def _load_checkpoint(path: Path, params: dict[str, nn.Parameter], opt, sched) -> tuple[int, list]:
    tensors = load_file(path / "params.safetensors")
    with torch.no_grad():
        for k, p in params.items():
            p.copy_(tensors[k])
    state = torch.load(path / "state.pt", weights_only=True)
    opt.load_state_dict(state["optimizer"])
    sched.load_state_dict(state["scheduler"])
    progress = json.loads((path / "progress.json").read_text())
    return progress["step"], progress["history"]


def finetune(model: nn.Module, tokenizer, recipe: Recipe, resume: bool = False,
             stop_after: int | None = None, extra_loss: Callable[[nn.Module], torch.Tensor] | None = None) -> tuple[nn.Module, dict]:
    """Train ``model`` per ``recipe.finetune``; returns (the trained model, losses and perplexities).

    ``stop_after`` ends the loop early (as an interruption would) after saving a checkpoint.
    ``extra_loss`` adds a regulariser (e.g. soft_share's Frobenius penalty on its deltas).
    """
    cfg = recipe.finetune
    torch.manual_seed(cfg.seed)
    device = model_device(model)
    model, params, finalize = prepare(model, cfg)
    named = {n: p for n, p in model.named_parameters() if p.requires_grad}
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_at(s, cfg))
    ckpt = recipe.out / CKPT
    step, history = 0, []
    if resume and ckpt.is_dir():
        step, history = _load_checkpoint(ckpt, named, opt, sched)
        ui.log(f"resumed from {ckpt} at step {step}")
    train_ids = data.tokenize(tokenizer, cfg.dataset, max_tokens=max(cfg.steps * cfg.grad_accum * cfg.batch_size * cfg.seq_len, 200_000))
    eval_ids = data.tokenize(tokenizer, recipe.eval.perplexity[0], max_tokens=cfg.eval_windows * cfg.seq_len + 1)
    autocast = (torch.autocast(device.type, dtype=getattr(torch, {"bf16": "bfloat16", "fp16": "float16"}[cfg.mixed_precision]))
                if cfg.mixed_precision != "no" and device.type == "cuda" else contextlib.nullcontext())
    scaler = torch.amp.GradScaler(enabled=cfg.mixed_precision == "fp16" and device.type == "cuda")
    trainable = sum(p.numel() for p in params)
    start = time.perf_counter()
    model.train()
    for step in ui.track(range(step, cfg.steps), "finetune steps", total=cfg.steps - step):
        total = 0.0
        for micro in range(cfg.grad_accum):
            (x,) = data.sample_batches(train_ids, cfg.batch_size, cfg.seq_len, cfg.batch_size, seed=cfg.seed * 1_000_003 + step * cfg.grad_accum + micro)
            x = x.to(device)
            with autocast:
                loss = model(input_ids=x, labels=x, use_cache=False).loss
                if extra_loss is not None:
                    loss = loss + extra_loss(model)
            scaler.scale(loss / cfg.grad_accum).backward()
            total += loss.item() / cfg.grad_accum
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        sched.step()
        entry = {"step": step + 1, "loss": total, "lr": sched.get_last_lr()[0]}
        if cfg.eval_every and (step + 1) % cfg.eval_every == 0:
            model.eval()
            entry["ppl"] = perplexity(model, eval_ids, cfg.seq_len, max_windows=cfg.eval_windows, label="finetune eval")["ppl"]
            model.train()
        history.append(entry)
        if (cfg.save_every and (step + 1) % cfg.save_every == 0) or (stop_after is not None and step + 1 >= stop_after):
            _save_checkpoint(ckpt, step + 1, named, opt, sched, history)
        if stop_after is not None and step + 1 >= stop_after:
            return model, {"interrupted_at": step + 1, "history": history}
    model.eval()
    final_ppl = perplexity(model, eval_ids, cfg.seq_len, max_windows=cfg.eval_windows, label="finetune eval")["ppl"]
    if cfg.mode == "lora":
        model = model.merge_and_unload()
    result = finalize()
    return model, {"mode": cfg.mode, "steps": cfg.steps, "trainable_params": trainable, "final_loss": history[-1]["loss"] if history else None,
            "final_ppl": final_ppl, "seconds": round(time.perf_counter() - start, 2), "history": history, **result}
