"""Distillation from the original model (finetune.distill)."""

from __future__ import annotations

import pytest
import torch

from wscompress import compress
from wscompress.errors import UsageError
from wscompress.io import data
from wscompress.recipe.schema import DistillConfig
from wscompress.recovery.distill import distill_loss
from wscompress.recovery.finetune import finetune

from conftest import WIKI_TEST, tiny_model
from test_finetune import recipe, svd_model

IDS = torch.randint(0, 512, (4, 32), generator=torch.Generator().manual_seed(5))


def agreement(student, teacher, ids: torch.Tensor) -> float:
    """1 - the mean total-variation distance of the two next-token distributions (1: identical).
    (Top-1 agreement says little here: a random tiny model predicts a few tokens everywhere.)"""
    with torch.no_grad():
        p, q = student(input_ids=ids).logits.softmax(-1), teacher(input_ids=ids).logits.softmax(-1)
        return 1 - 0.5 * (p - q).abs().sum(-1).mean().item()


def held_out(tokenizer) -> torch.Tensor:
    return tokenizer(data.load_text(WIKI_TEST)[:20_000], return_tensors="pt").input_ids[0][:256].view(8, 32)


def test_loss_is_zero_when_the_student_is_the_teacher():
    teacher = tiny_model("llama")
    loss = distill_loss(teacher, DistillConfig(kl=1.0, temperature=2.0, hidden=1.0))(tiny_model("llama"), IDS, 0)
    assert abs(loss.item()) < 1e-6
    assert distill_loss(teacher, DistillConfig(kl=1.0))(svd_model(), IDS, 0).item() > 1e-4  # a compressed student differs


def test_distillation_lowers_the_kd_loss_and_raises_agreement(tmp_path, tokenizer):
    """On held-out text, a heavily compressed student's KL to the teacher falls and it gives the
    teacher's top tokens more probability."""
    teacher, student = tiny_model("llama"), tiny_model("llama")
    compress(student, [{"method": "svd", "ratio": 0.7, "whitening": False}])
    ids, kl = held_out(tokenizer), distill_loss(teacher, DistillConfig(kl=1.0))
    before = (kl(student, ids, 0).item(), agreement(student, teacher, ids))
    kd = {"kl": 1.0, "temperature": 2.0, "hidden": 0.5}
    student, out = finetune(student, tokenizer, recipe(tmp_path, mode="method", steps=16, distill=kd), teacher=teacher)
    assert out["distill"]["hidden"] == 0.5
    with torch.no_grad():
        assert kl(student, ids, 0).item() < 0.7 * before[0]
    assert agreement(student, teacher, ids) > before[1]


def test_resumed_distillation_equals_an_uninterrupted_run(tmp_path, tokenizer):
    opts = {"mode": "method", "distill": {"kl": 1.0, "lm": 0.5}}
    teacher = tiny_model("llama")
    _, full = finetune(svd_model(), tokenizer, recipe(tmp_path / "a", **opts), teacher=teacher)
    r = recipe(tmp_path / "b", **opts)
    finetune(svd_model(), tokenizer, r, stop_after=3, teacher=teacher)
    _, resumed = finetune(svd_model(), tokenizer, r, resume=True, teacher=teacher)
    assert resumed["final_loss"] == pytest.approx(full["final_loss"], rel=1e-6)
    with pytest.raises(UsageError, match="finetune.distill"):  # another distillation setting: another run
        finetune(svd_model(), tokenizer, recipe(tmp_path / "b", mode="method", distill={"kl": 2.0}), resume=True,
                 teacher=teacher)


def test_a_teacher_with_another_vocabulary_is_refused(tmp_path, tokenizer):
    with pytest.raises(UsageError, match="vocabulary"):
        finetune(svd_model(), tokenizer, recipe(tmp_path, distill={"kl": 1.0}), teacher=tiny_model("llama", vocab_size=640))


def test_distill_options_are_checked():
    from wscompress.recipe.load import load_recipe

    for bad in ({"kl": 0, "lm": 0, "hidden": 0}, {"temperature": 0}, {"teacher": "x"}):
        with pytest.raises(UsageError):
            load_recipe(data={"finetune": {"distill": bad}})


def test_layerwise_distillation_lowers_every_layers_error(tmp_path, tokenizer):
    """Each compressed layer, trained on the inputs the recovered layers before it produce,
    reproduces the teacher's layer better than before; the global phase then runs as usual."""
    teacher, student = tiny_model("llama"), tiny_model("llama")
    compress(student, [{"method": "svd", "ratio": 0.7, "whitening": False}])
    kd = {"kl": 1.0, "layerwise_steps": 20, "layerwise_lr": 3e-3, "layerwise_samples": 8}
    _, out = finetune(student, tokenizer, recipe(tmp_path, mode="method", steps=2, distill=kd), teacher=teacher)
    rows = out["layerwise"]
    assert [r["layer"] for r in rows] == [0, 1, 2, 3] and all(r["trained"] > 0 for r in rows)
    assert all(r["rel_error_after"] < 0.9 * r["rel_error_before"] for r in rows), rows
    assert len(out["history"]) == 2


def test_layerwise_distillation_keeps_to_its_share_of_the_time_budget(tmp_path, tokenizer):
    """With max_minutes the layer-wise phase stops at its share, however many steps it was
    given, and leaves the rest of the budget to the global phase."""
    teacher, student = tiny_model("llama"), tiny_model("llama")
    compress(student, [{"method": "svd", "ratio": 0.7, "whitening": False}])
    kd = {"kl": 1.0, "layerwise_steps": 10**6, "layerwise_lr": 3e-3, "layerwise_samples": 4, "layerwise_share": 0.5}
    r = recipe(tmp_path, mode="method", steps=10**6, max_minutes=0.02, eval_every=0, distill=kd)  # 1.2 s
    _, out = finetune(student, tokenizer, r, teacher=teacher)
    rows = out["layerwise"]
    assert rows and rows[0]["steps"] > 0 and all(row["steps"] < 10**6 for row in rows), rows
    assert 1 <= len(out["history"]) < 10**6  # the global phase trained, and the budget ended it


def test_layerwise_distillation_refuses_a_shallower_student(tmp_path, tokenizer):
    student = tiny_model("llama")
    compress(student, [{"method": "merge_drop", "n": 2, "search": False, "refit": False}])  # data-free: one layer fewer
    kd = {"kl": 1.0, "layerwise_steps": 2}
    with pytest.raises(UsageError, match="layerwise_steps: the student has another number of layers"):
        finetune(student, tokenizer, recipe(tmp_path, mode="method", steps=1, distill=kd), teacher=tiny_model("llama"))


def test_cached_top_k_teacher(tmp_path, tokenizer, tiny_dir, monkeypatch):
    """The KL on the teacher's cached top-k equals the full KL when k covers the vocabulary; a
    second run on the same batches reads the cache, never loads the teacher, and ends alike."""
    from wscompress.recipe.load import load_recipe
    from wscompress.recovery import distill

    teacher, student = tiny_model("llama"), svd_model()
    cache = distill.TeacherCache(tmp_path / "cache", {"test": 1}, k=512)
    full = distill_loss(teacher, DistillConfig(kl=1.0, temperature=2.0))(student, IDS, 0)
    cached = distill_loss(teacher, DistillConfig(kl=1.0, temperature=2.0, cache_topk=512), cache)
    assert cached(student, IDS, 0).item() == pytest.approx(full.item(), rel=1e-4)  # fills the cache
    assert cached(student, IDS, 0).item() == pytest.approx(full.item(), rel=1e-4)  # reads it
    teacher_dir = tiny_dir("llama")
    runs = {}
    for run in ("first", "second"):
        r = recipe(tmp_path / "out", mode="method", steps=4, distill={"kl": 1.0, "cache_topk": 32})
        r = load_recipe(data={**r.model_dump(exclude={"compress", "source"}), "model": {"path": str(teacher_dir)}})
        _, runs[run] = finetune(svd_model(), tokenizer, r)
        monkeypatch.setattr(distill, "load_teacher", lambda *a: pytest.fail("the teacher was loaded"))
    batches = sorted((tmp_path / "out" / "teacher-cache").glob("*/batch-*"))
    assert len(batches) == 4
    assert runs["second"]["final_loss"] == pytest.approx(runs["first"]["final_loss"], rel=1e-6)
    batches[1].write_bytes(b"garbage")  # an entry that cannot be read: the teacher runs for it and writes it anew
    monkeypatch.undo()
    _, healed = finetune(svd_model(), tokenizer, r)
    assert healed["final_loss"] == pytest.approx(runs["first"]["final_loss"], rel=1e-6)
    assert distill.TeacherCache._readable(batches[1])
    with pytest.raises(UsageError, match="hidden"):
        load_recipe(data={"finetune": {"distill": {"cache_topk": 8, "hidden": 1.0}}})
