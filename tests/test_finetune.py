"""Recovery fine-tuning: exact resume, LoRA merged into the compressed structure, method mode."""

from __future__ import annotations

import pytest
import torch

from wscompress import compress
from wscompress.errors import UsageError
from wscompress.io import data
from wscompress.model.forms.wscompress_lowrank import LowRankLinear
from wscompress.recipe.load import load_recipe
from wscompress.recovery.finetune import finetune, lora_target_names

from conftest import WIKI_TEST, WIKI_TRAIN, tiny_model


def recipe(tmp_path, **finetune_opts):
    # a slice of the wiki text keeps tokenization (most of a tiny run's time) short
    text = tmp_path.parent / "train.txt"
    if not text.is_file():
        text.write_text(data.load_text(WIKI_TRAIN)[:60_000])
    ft = {"dataset": str(text), "seq_len": 32, "batch_size": 2, "steps": 6, "lr": 3e-3, "eval_windows": 2, **finetune_opts}
    return load_recipe(data={"finetune": ft, "eval": {"perplexity": [WIKI_TEST]}, "output": {"dir": str(tmp_path)}})


def svd_model():
    model = tiny_model("llama")
    compress(model, [{"method": "svd", "ratio": 0.5, "whitening": False, "targets": ["q_proj", "up_proj"]}])
    return model


def test_interrupted_and_resumed_run_ends_like_an_uninterrupted_one(tmp_path, tokenizer):
    opts = {"mode": "full", "grad_accum": 2, "warmup_steps": 2, "schedule": "cosine"}
    full_model, full = finetune(tiny_model("llama"), tokenizer, recipe(tmp_path / "a", **opts))

    r = recipe(tmp_path / "b", **opts)
    _, partial = finetune(tiny_model("llama"), tokenizer, r, stop_after=3)
    assert partial["interrupted_at"] == 3 and (tmp_path / "b" / "finetune-checkpoint").is_dir()
    resumed_model, resumed = finetune(tiny_model("llama"), tokenizer, r, resume=True)

    assert [h["step"] for h in resumed["history"]] == list(range(1, 7))
    assert resumed["final_loss"] == pytest.approx(full["final_loss"], rel=1e-6)
    assert resumed["final_ppl"] == pytest.approx(full["final_ppl"], rel=1e-6)
    assert full["history"][-1]["loss"] < full["history"][0]["loss"]
    for (name, a), b in zip(full_model.state_dict().items(), resumed_model.state_dict().values()):
        torch.testing.assert_close(a, b, msg=name)


def test_a_time_budget_ends_training_and_its_schedule(tmp_path, tokenizer):
    opts = {"mode": "full", "steps": 100_000, "max_minutes": 0.02, "eval_every": 1_000}
    _, report = finetune(tiny_model("llama"), tokenizer, recipe(tmp_path, **opts))
    seconds = [h["seconds"] for h in report["history"]]  # however fast the machine: what holds at any speed
    assert 1 <= report["steps"] < 100_000 and seconds == sorted(seconds)
    assert seconds[-1] >= 1.2 and (len(seconds) == 1 or seconds[-2] <= 1.2)  # stops at the first step past the budget
    assert report["history"][-1]["lr"] < 0.01 * 3e-3  # the cosine decayed over the time
    assert len(seconds) == 1 or report["history"][-1]["lr"] < report["history"][0]["lr"]
    assert "ppl" in report["history"][-1]  # the last step is evaluated even between eval_every steps


def test_resume_refuses_a_checkpoint_of_another_run(tmp_path, tokenizer):
    finetune(tiny_model("llama"), tokenizer, recipe(tmp_path, mode="full"), stop_after=1)
    with pytest.raises(UsageError, match="finetune.lr"):
        finetune(tiny_model("llama"), tokenizer, recipe(tmp_path, mode="full", lr=1e-2), resume=True)


def test_lora_is_merged_into_the_compressed_structure(tmp_path, tokenizer):
    model = svd_model()
    x = torch.randint(0, 512, (1, 16))
    before = model(x).logits
    trained, out = finetune(model, tokenizer, recipe(tmp_path, mode="lora", lora={"targets": ["q_proj"]}, lr=1e-2))
    assert out["lora_merged"] and out["lora_modules"] == 8  # basis + coeff of 4 layers
    q = trained.model.layers[0].self_attn.q_proj
    assert isinstance(q, LowRankLinear) and type(q.coeff) is torch.nn.Linear and type(q.basis) is torch.nn.Linear
    assert not any("lora" in name for name, _ in trained.named_parameters())
    assert not torch.allclose(trained(x).logits, before)


def test_lora_skips_shared_modules():
    model = tiny_model("llama")
    layers = model.model.layers
    layers[1].mlp.up_proj = layers[0].mlp.up_proj  # one module object under two names
    names = lora_target_names(model, ["up_proj"])
    assert "model.layers.0.mlp.up_proj" not in names and "model.layers.2.mlp.up_proj" in names
    layers[3].mlp.up_proj = layers[2].mlp.up_proj
    with pytest.raises(UsageError, match="shared"):
        lora_target_names(model, ["layers\\.[0-3]\\.mlp\\.up_proj"])


def test_method_mode_trains_only_the_compressed_layers(tmp_path, tokenizer):
    model = svd_model()
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if ".q_proj." not in n and ".up_proj." not in n}
    lowrank = {n: p.detach().clone() for n, p in model.named_parameters() if ".q_proj." in n}
    # mixed precision is a CUDA feature: on CPU the run goes on in float32
    trained, out = finetune(model, tokenizer, recipe(tmp_path, mode="method", steps=2, mixed_precision="bf16", schedule="linear"))
    params = dict(trained.named_parameters())
    assert out["trainable_params"] == sum(p.numel() for m in trained.modules() if isinstance(m, LowRankLinear) for p in m.parameters())
    assert all(torch.equal(params[n], p) for n, p in frozen.items())
    assert any(not torch.equal(params[n], p) for n, p in lowrank.items())


def test_norms_train_with_the_compressed_layers_and_nothing_else_moves(tmp_path, tokenizer):
    model = svd_model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trained, out = finetune(model, tokenizer, recipe(tmp_path, mode="method", steps=2, norms=True))
    moved = {n for n, p in trained.named_parameters() if not torch.equal(before[n], p)}
    norms = {n for n in before if n.endswith("norm.weight")}
    assert norms and norms <= moved and all(".q_proj." in n or ".up_proj." in n for n in moved - norms)
    assert out["trainable_params"] == sum(p.numel() for m in trained.modules() if isinstance(m, LowRankLinear)
                                          for p in m.parameters()) + sum(before[n].numel() for n in norms)
    with pytest.raises(UsageError, match="norms applies to mode: method"):
        recipe(tmp_path, mode="lora", norms=True)


def test_method_mode_needs_compressed_layers(tmp_path, tokenizer):
    with pytest.raises(UsageError, match="no compressed layers"):
        finetune(tiny_model("llama"), tokenizer, recipe(tmp_path, mode="method"))


@pytest.mark.parametrize("stage,trained_part", [
    ({"method": "cross_layer", "what": "ffn", "group_size": 2, "init": "mean", "refit": False}, ".mlp."),
    ({"method": "merge_drop", "n": 2, "start": 1}, "model.layers.1."),
    ({"method": "gqa", "groups": 1, "init": "mean"}, ("k_proj", "v_proj")),
    ({"method": "gqa", "groups": 1}, ("q_proj", "k_proj", "v_proj", "o_proj")),  # pca folds into q and o
    ({"method": "factorize_embeddings", "rank": 16}, "embed_tokens"),
])
def test_method_mode_trains_what_a_structural_stage_made(stage, trained_part, tmp_path, tokenizer):
    """Shared, merged, pooled and factorised modules are the method's own parameters: recorded
    in the saved model, they are what `mode: method` trains, and nothing else moves."""
    from wscompress.io import storage
    from wscompress.recovery.finetune import method_parameters

    model = tiny_model("llama")
    compress(model, [stage], tokenizer, {"dataset": "pydoc", "num_samples": 4, "seq_len": 32, "batch_size": 2})
    storage.save(model, tokenizer, tmp_path / "m")
    model, _ = storage.load(tmp_path / "m")
    chosen = {id(p) for p in method_parameters(model)}
    names = {n for n, p in model.named_parameters() if id(p) in chosen}
    assert names and all(any(part in n for part in ([trained_part] if isinstance(trained_part, str) else trained_part))
                         for n in names)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trained, _ = finetune(model, tokenizer, recipe(tmp_path, mode="method", steps=2))
    after = dict(trained.named_parameters())
    assert {n for n in before if not torch.equal(before[n], after[n])} == names
