"""Knowledge distillation for recovery fine-tuning: the original model teaches the compressed one.

The loss per batch is ``kl`` x T² x KL(teacher ‖ student) of the next-token distributions at
temperature T (Hinton et al. 2015), plus ``lm`` x the language-model loss on the text, plus
``hidden`` x the mean over decoder layers of ‖h_student − h_teacher‖² / ‖h_teacher‖² (the
layers' outputs; both models have the same depth unless a stage dropped layers, which is refused).
The teacher runs without gradients, on the student's device or on the CPU.

``layerwise`` is local distillation, run before the global loss and memory-bounded like
calibration: decoder layer by decoder layer, the student's layer is trained to reproduce the
teacher's layer on the inputs the (already recovered) student layers before it produce, then
its outputs feed the next layer. Only one layer's activations and gradients exist at a time. A
layer whose error on its inputs training did not lower keeps its parameters.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file
from torch import nn
from torch.utils._pytree import tree_map

from ..errors import UsageError
from ..io import distributed, ui
from ..io.checkpoints import load_model
from ..io.files import save_tensors
from ..io.offload import model_device
from ..model.arch import discover
from ..pipeline.layerwise import LayerInputs, run_layer
from ..pipeline.layerwise import layerwise as layer_by_layer
from ..recipe.schema import DistillConfig, ModelConfig

Loss = Callable[[nn.Module, torch.Tensor, int], torch.Tensor]  # (student, token ids, batch number) -> loss


def check_pair(teacher: nn.Module, teacher_tok, student: nn.Module, student_tok) -> None:
    """Refuse a teacher whose vocabulary or tokenizer differs from the student's."""
    tv, sv = teacher.get_output_embeddings().weight.shape[0], student.get_output_embeddings().weight.shape[0]
    if tv != sv or teacher_tok.get_vocab() != student_tok.get_vocab():
        raise UsageError(f"finetune.distill: the teacher's vocabulary ({tv} logits) does not match the student's ({sv}) "
                         "token for token", "distil from the checkpoint the student was compressed from (the recipe's model)")


def distill_loss(teacher: nn.Module | None, cfg: DistillConfig, cache: TeacherCache | None = None) -> Loss:
    """loss(student, token ids, batch number) of the module docstring. With ``cache`` the KL
    runs on the teacher's top-k log-probabilities, read from the cache (the teacher runs, and
    fills it, only for batches it does not hold yet)."""
    hidden = cfg.hidden > 0
    temp = cfg.temperature

    def loss(student: nn.Module, x: torch.Tensor, batch: int) -> torch.Tensor:
        cached = cache.get(batch) if cache is not None else None
        t = None
        if cached is None and (cfg.kl or hidden):
            with torch.no_grad():
                t = teacher(input_ids=x.to(model_device(teacher)), use_cache=False, output_hidden_states=hidden)
            if cache is not None:
                cached = cache.put(batch, F.log_softmax(t.logits[:, :-1].float() / temp, -1))
        s = student(input_ids=x, labels=x if cfg.lm else None, use_cache=False, output_hidden_states=hidden)
        total = s.loss * cfg.lm if cfg.lm else 0.0
        if cfg.kl:
            student_logp = F.log_softmax(s.logits[:, :-1].float() / temp, -1)
            if cached is not None:  # KL on the teacher's top k: Σ p_t (log p_t − log p_s) over those tokens
                values, index = (v.to(student_logp.device) for v in cached)
                kl = (values.exp() * (values - student_logp.gather(-1, index))).sum(-1).mean()
            else:
                teacher_logp = F.log_softmax(t.logits[:, :-1].to(s.logits.device).float() / temp, -1)
                kl = F.kl_div(student_logp.flatten(0, 1), teacher_logp.flatten(0, 1), log_target=True, reduction="batchmean")
            total = total + cfg.kl * temp ** 2 * kl
        if hidden:
            if len(s.hidden_states) != len(t.hidden_states):
                raise UsageError("finetune.distill.hidden: the student has another number of layers than the teacher",
                                 "set hidden: 0 (a stage removed layers; the logits can still be distilled)")
            terms = [(hs - ht.to(hs.device)).pow(2).mean() / ht.pow(2).mean().to(hs.device).clamp_min(1e-12)
                     for hs, ht in zip(s.hidden_states[1:], t.hidden_states[1:])]
            total = total + cfg.hidden * torch.stack(terms).mean()
        return total
    return loss


class TeacherCache:
    """The teacher's top-k next-token log-probabilities of each training batch, one file a batch
    in ``folder``, named by everything that determines them (the teacher checkpoint's files, the
    training text and sampling, the temperature, k), so a later run or epoch on the same batches
    reads them instead of running the teacher."""

    def __init__(self, folder: Path, key: dict, k: int):
        digest = hashlib.sha1(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]
        self.folder, self.k = Path(folder) / digest, k

    def _path(self, batch: int) -> Path:
        rank, size = distributed.world()
        return self.folder / f"batch-{batch:07d}-{rank}of{size}.safetensors"

    def complete(self, batches: Iterable[int]) -> bool:
        """Whether every batch's entry is there and readable (else the teacher must be loaded)."""
        return all(self._readable(self._path(b)) for b in batches)

    @staticmethod
    def _readable(path: Path) -> bool:
        try:
            with safe_open(str(path), "pt") as f:
                return {"values", "index"} <= set(f.keys())
        except (OSError, SafetensorError):
            return False

    def get(self, batch: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        path = self._path(batch)
        if not path.is_file():
            return None
        try:
            t = load_file(path)
            return t["values"], t["index"].long()
        except (OSError, SafetensorError, KeyError) as err:  # an entry that cannot be read: the teacher runs again
            ui.log(f"[yellow]teacher cache {path} unreadable ({type(err).__name__}); running the teacher[/]")
            return None

    def put(self, batch: int, logp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        values, index = logp.topk(min(self.k, logp.shape[-1]), dim=-1)
        self.folder.mkdir(parents=True, exist_ok=True)
        tmp = self._path(batch).with_suffix(".tmp")
        save_tensors({"values": values, "index": index.int()}, tmp)  # float32: a small KL
        tmp.replace(self._path(batch))  # is a difference of nearby log-probabilities, which fp16 rounding swamps
        return values, index


def teacher_key(cfg: ModelConfig, finetune: dict) -> dict:
    """What the cached teacher outputs depend on: the checkpoint (its weight files' names, sizes
    and times) and the training batches and loss settings."""
    from ..io.checkpoints import checkpoint_files, resolve_path

    path, _ = resolve_path(cfg)
    files = [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in checkpoint_files(path, cfg.revision)]
    return {"model": cfg.model_dump(), "files": files, **finetune}


def load_teacher(cfg: ModelConfig, distill: DistillConfig, student: nn.Module, student_tok) -> nn.Module:
    """The original model, frozen, on the device ``distill.teacher_device`` asks for."""
    device = "cpu" if distill.teacher_device == "cpu" else str(model_device(student))
    teacher, tok = load_model(cfg.model_copy(update={"device": device}))
    check_pair(teacher, tok, student, student_tok)
    teacher.eval().requires_grad_(False)
    return teacher


def layerwise(student: nn.Module, teacher: nn.Module, batches: list[torch.Tensor], params: list[nn.Parameter],
              steps: int, lr: float, seconds: float | None = None) -> list[dict]:
    """Local distillation (module docstring) of the trainable ``params`` inside each decoder
    layer; returns per layer the relative output error before and after, on its inputs.

    With ``seconds`` the phase keeps to that time: layer i trains until its share of it
    (i + 1) / n has passed (time a layer leaves unused goes to the next), and once the whole
    is spent the remaining layers are left untrained (the global phase still trains them)."""
    teacher_layers = discover(teacher).layers
    if len(teacher_layers) != len(discover(student).layers):
        raise UsageError("finetune.distill.layerwise_steps: the student has another number of layers than the teacher, "
                         "so its layers have no counterpart to reproduce", "set layerwise_steps: 0 (a stage removed "
                         "layers; the logits can still be distilled)")
    chosen = {id(p) for p in params}
    rows, start, n = [], time.perf_counter(), len(teacher_layers)
    for i, layer, inputs in layer_by_layer(student, batches, label="layer-wise distillation"):
        if seconds is not None and time.perf_counter() - start >= seconds:
            ui.log(f"layer-wise distillation: its {seconds:.0f} s are spent; layers {i}-{n - 1} are left to the global phase")
            break
        until = None if seconds is None else start + seconds * (i + 1) / n
        mine = [p for p in layer.parameters() if id(p) in chosen]
        device = model_device(teacher)
        with torch.no_grad():
            targets = [t.to(inputs.hidden[0].device) for t in run_layer(teacher_layers[i], _moved(inputs, device))]

        def error() -> float:
            with torch.no_grad():
                outs = run_layer(layer, inputs)
            return (sum((o - t).pow(2).sum().item() for o, t in zip(outs, targets))
                    / sum(t.pow(2).sum().item() for t in targets))

        before = error()
        saved, done = [p.detach().clone() for p in mine], 0
        if mine and steps:
            opt = torch.optim.Adam(mine, lr=lr)
            with torch.enable_grad():
                for step in range(steps):
                    if until is not None and step and time.perf_counter() >= until:
                        break
                    b = step % len(inputs.hidden)
                    args, kwargs = inputs.calls[b]
                    out = layer(inputs.hidden[b], *args, **kwargs)
                    out = out[0] if isinstance(out, tuple) else out
                    loss = (out - targets[b]).pow(2).mean() / targets[b].pow(2).mean().clamp_min(1e-12)
                    loss.backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    done = step + 1
        after = error()
        if after > before:  # training did not help this layer on its own inputs: keep what it had
            with torch.no_grad():
                for p, old in zip(mine, saved):
                    p.copy_(old)
            after = before
        rows.append({"layer": i, "trained": sum(p.numel() for p in mine), "steps": done,
                     "rel_error_before": before, "rel_error_after": after})
        ui.log(f"layer {i}: relative output error {before:.4g} -> {rows[-1]['rel_error_after']:.4g}")
    return rows


def _moved(inputs: LayerInputs, device: torch.device) -> LayerInputs:
    """The layer inputs on ``device`` (the teacher may run on the CPU)."""
    to = lambda v: v.to(device) if isinstance(v, torch.Tensor) else v  # noqa: E731
    return LayerInputs(tree_map(to, inputs.hidden), tree_map(to, inputs.calls))
