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

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_map

from . import ui
from .arch import discover
from .calibrate import LayerInputs, run_layer
from .calibrate import layerwise as layer_by_layer
from .errors import UsageError
from .model import load_model, model_device
from .recipe import DistillConfig, ModelConfig

Loss = Callable[[nn.Module, torch.Tensor], torch.Tensor]


def check_pair(teacher: nn.Module, teacher_tok, student: nn.Module, student_tok) -> None:
    """Refuse a teacher whose vocabulary or tokenizer differs from the student's."""
    tv, sv = teacher.get_output_embeddings().weight.shape[0], student.get_output_embeddings().weight.shape[0]
    if tv != sv or teacher_tok.get_vocab() != student_tok.get_vocab():
        raise UsageError(f"finetune.distill: the teacher's vocabulary ({tv} logits) does not match the student's ({sv}) "
                         "token for token", "distil from the checkpoint the student was compressed from (the recipe's model)")


def distill_loss(teacher: nn.Module, cfg: DistillConfig) -> Loss:
    """loss(student, token ids) of the module docstring."""
    hidden = cfg.hidden > 0
    device = model_device(teacher)

    def loss(student: nn.Module, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            t = teacher(input_ids=x.to(device), use_cache=False, output_hidden_states=hidden)
        s = student(input_ids=x, labels=x if cfg.lm else None, use_cache=False, output_hidden_states=hidden)
        total = s.loss * cfg.lm if cfg.lm else 0.0
        if cfg.kl:
            temp = cfg.temperature
            student_logp = F.log_softmax(s.logits[:, :-1].float() / temp, -1)
            teacher_logp = F.log_softmax(t.logits[:, :-1].to(s.logits.device).float() / temp, -1)
            total = total + cfg.kl * temp ** 2 * F.kl_div(student_logp.flatten(0, 1), teacher_logp.flatten(0, 1),
                                                          log_target=True, reduction="batchmean")
        if hidden:
            if len(s.hidden_states) != len(t.hidden_states):
                raise UsageError("finetune.distill.hidden: the student has another number of layers than the teacher",
                                 "set hidden: 0 (a stage removed layers; the logits can still be distilled)")
            terms = [(hs - ht.to(hs.device)).pow(2).mean() / ht.pow(2).mean().to(hs.device).clamp_min(1e-12)
                     for hs, ht in zip(s.hidden_states[1:], t.hidden_states[1:])]
            total = total + cfg.hidden * torch.stack(terms).mean()
        return total
    return loss


def load_teacher(cfg: ModelConfig, distill: DistillConfig, student: nn.Module, student_tok) -> nn.Module:
    """The original model, frozen, on the device ``distill.teacher_device`` asks for."""
    device = "cpu" if distill.teacher_device == "cpu" else str(model_device(student))
    teacher, tok = load_model(cfg.model_copy(update={"device": device}))
    check_pair(teacher, tok, student, student_tok)
    teacher.eval().requires_grad_(False)
    return teacher


def layerwise(student: nn.Module, teacher: nn.Module, batches: list[torch.Tensor], params: list[nn.Parameter],
              steps: int, lr: float) -> list[dict]:
    """Local distillation (module docstring) of the trainable ``params`` inside each decoder
    layer; returns per layer the relative output error before and after, on its inputs."""
    teacher_layers = discover(teacher).layers
    chosen = {id(p) for p in params}
    rows = []
    for i, layer, inputs in layer_by_layer(student, batches, label="layer-wise distillation"):
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
        saved = [p.detach().clone() for p in mine]
        if mine and steps:
            opt = torch.optim.Adam(mine, lr=lr)
            with torch.enable_grad():
                for step in range(steps):
                    b = step % len(inputs.hidden)
                    args, kwargs = inputs.calls[b]
                    out = layer(inputs.hidden[b], *args, **kwargs)
                    out = out[0] if isinstance(out, tuple) else out
                    loss = (out - targets[b]).pow(2).mean() / targets[b].pow(2).mean().clamp_min(1e-12)
                    loss.backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
        after = error()
        if after > before:  # training did not help this layer on its own inputs: keep what it had
            with torch.no_grad():
                for p, old in zip(mine, saved):
                    p.copy_(old)
            after = before
        rows.append({"layer": i, "trained": sum(p.numel() for p in mine), "rel_error_before": before,
                     "rel_error_after": after})
        ui.log(f"layer {i}: relative output error {before:.4g} -> {rows[-1]['rel_error_after']:.4g}")
    return rows


def _moved(inputs: LayerInputs, device: torch.device) -> LayerInputs:
    """The layer inputs on ``device`` (the teacher may run on the CPU)."""
    to = lambda v: v.to(device) if isinstance(v, torch.Tensor) else v  # noqa: E731
    return LayerInputs(tree_map(to, inputs.hidden), tree_map(to, inputs.calls))
