"""Knowledge distillation for recovery fine-tuning: the original model teaches the compressed one.

The loss per batch is ``kl`` x T² x KL(teacher ‖ student) of the next-token distributions at
temperature T (Hinton et al. 2015), plus ``lm`` x the language-model loss on the text, plus
``hidden`` x the mean over decoder layers of ‖h_student − h_teacher‖² / ‖h_teacher‖² (the
layers' outputs; both models have the same depth unless a stage dropped layers, which is refused).
The teacher runs without gradients, on the student's device or on the CPU.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

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
