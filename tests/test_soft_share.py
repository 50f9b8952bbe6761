"""soft_share: neuron alignment, shared FFN base per window plus low-rank deltas, finetuning."""

import copy

import pytest
import torch
from torch import nn

from wscompress import compress
from wscompress.errors import UsageError
from wscompress.io import data
from wscompress.maths.linalg import low_rank
from wscompress.methods import METHODS
from wscompress.methods._sharing import aligned_weights, alignment, ffn_names
from wscompress.methods.soft_share import shared_plus_deltas
from wscompress.model.arch import dims_of, discover, set_module
from wscompress.model.forms.wscompress_lowrank import LowRankDeltaLinear
from wscompress.pipeline import calibration
from wscompress.recipe.load import load_recipe
from wscompress.recovery.finetune import finetune

from conftest import WIKI_TRAIN, assert_roundtrip, hidden_state_error, tiny_model
from test_cross_layer import AttentionOnly


class Calibration:
    """A method context with a few short calibration batches (tokenizing the whole
    calibration file for every test would dominate the run time)."""

    def __init__(self, tokenizer):
        ids = tokenizer(data.load_text(WIKI_TRAIN)[:20_000], return_tensors="pt").input_ids[0]
        self.batches = data.sample_batches(ids, 4, 32, 2, seed=0)

    def calibration(self):
        return self.batches

    def stats(self, model, names, sensitivity_samples=0):
        return calibration.collect_grams(model, self.batches, names, sensitivity_samples=sensitivity_samples)

    def dtype(self, model):
        return None  # the model's own


def soft_share(model, tokenizer, **options) -> dict:
    (cfg,) = load_recipe(data={"compress": [{"method": "soft_share", **options}]}).compress
    return METHODS["soft_share"].apply(model, cfg, Calibration(tokenizer))


def logits(model):
    x = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return model(x).logits


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_permuting_ffn_neurons_leaves_the_function_unchanged(kind):
    model = tiny_model(kind)
    before = logits(model)
    arch = discover(model)
    perm = torch.randperm(dims_of(model.get_submodule(ffn_names(arch, 1, "test")["down"]))[0], generator=torch.Generator().manual_seed(0))
    for role, (w, b) in aligned_weights(arch, 1, perm).items():
        lin = nn.Linear(w.shape[1], w.shape[0], bias=b is not None)
        with torch.no_grad():
            lin.weight.copy_(w)
            if b is not None:
                lin.bias.copy_(b)
        set_module(model, ffn_names(arch, 1, "test")[role], lin)
    torch.testing.assert_close(logits(model), before)


def test_alignment_recovers_a_known_permutation():
    acts = torch.randn(500, 32)
    perm = torch.randperm(32, generator=torch.Generator().manual_seed(3))
    shuffled = acts[:, perm] * 2 + 0.01 * torch.randn(500, 32)
    assert torch.equal(perm[alignment(acts, shuffled)], torch.arange(32))


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_sampled_activations_align_a_permuted_copy_of_a_layer(tokenizer, dtype):
    """Layer 1 is layer 0 with its FFN neurons shuffled, and layer 0 barely changes the stream:
    the sampled activations of both layers must be of the same tokens for the alignment to
    find the shuffle, also from a bfloat16 pass (the calibration dtype), which leaves the
    model's float32 weights as they were."""
    from wscompress.methods._sharing import sample_inputs

    model = tiny_model("llama")
    arch = discover(model)
    names = [ffn_names(arch, i, "test") for i in (0, 1)]
    perm = torch.randperm(128, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        arch.layers[1].load_state_dict(arch.layers[0].state_dict())
        for role, name in names[1].items():
            w = model.get_submodule(name).weight
            w.copy_(w[:, perm] if role == "down" else w[perm])
        arch.layers[0].mlp.down_proj.weight.mul_(1e-4)  # layer 1 reads (almost) what layer 0 read
        arch.layers[0].self_attn.o_proj.weight.mul_(1e-4)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    seen = set()
    hook = arch.layers[1].mlp.down_proj.register_forward_hook(lambda _m, args, _out: seen.add(args[0].dtype))
    acts = sample_inputs(model, arch, Calibration(tokenizer).batches, "down", rows_per_batch=48, dtype=dtype)
    hook.remove()
    assert seen == {dtype or torch.float32}
    assert {a.dtype for a in acts.values()} == {torch.float32}
    assert torch.equal(perm[alignment(acts[0], acts[1])], torch.arange(128))
    after = model.state_dict()
    assert all(after[k].dtype == v.dtype and torch.equal(after[k], v) for k, v in before.items())


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_full_rank_deltas_reproduce_the_model(kind, tokenizer):
    model = tiny_model(kind)
    before = logits(model)
    row = soft_share(model, tokenizer, window=2, rank=256, starts=[0, 2])
    assert row["windows"] == [[0, 1], [2, 3]]
    torch.testing.assert_close(logits(model), before, atol=1e-4, rtol=1e-4)


def test_low_rank_window_shares_the_base_and_saves_once(tokenizer, tmp_path):
    model = tiny_model("llama")
    (row,) = compress(model, [{"method": "soft_share", "window": 2, "rank": 4}], tokenizer,
                      {"dataset": WIKI_TRAIN, "num_samples": 4, "seq_len": 32, "batch_size": 2})
    (window,) = row["windows"]
    assert set(row["search_nll"]) == {"0", "1", "2"}
    assert row["search_nll"][str(window[0])] == min(row["search_nll"].values())
    a, b = (model.model.layers[i].mlp.down_proj for i in window)
    assert isinstance(a, LowRankDeltaLinear) and a.base is b.base and a.a is not b.a
    assert a.trainable_parameters() == [a.a, a.b]
    torch.testing.assert_close(a.penalty(), (a.a @ a.b).pow(2).sum())
    assert row["params_after"] == row["params_before"] - 3 * 64 * 128 + 2 * 3 * 4 * (64 + 128)
    assert_roundtrip(model, tokenizer, tmp_path / "m")


def small_recipe(tmp_path, **finetune_options):
    """A finetune recipe on a short slice of the wiki text (fast to tokenize)."""
    text = tmp_path / "wiki.txt"
    text.write_text(data.load_text(WIKI_TRAIN)[:30_000])
    return load_recipe(data={"finetune": {"seq_len": 32, "batch_size": 2, "eval_windows": 1, "dataset": str(text),
                                          **finetune_options},
                             "eval": {"perplexity": [str(text)]}, "output": {"dir": str(tmp_path)}})


@pytest.mark.parametrize("penalty", [0.0, 10.0])
def test_finetune_trains_only_the_deltas_with_the_penalty(penalty, tokenizer, tmp_path):
    model = tiny_model("llama")
    soft_share(model, tokenizer, window=2, rank=4, starts=[0])
    layer = model.model.layers[0].mlp.up_proj
    base, delta = layer.base.weight.detach().clone(), (layer.a @ layer.b).detach().clone()
    recipe = small_recipe(tmp_path, mode="method", steps=4, lr=1e-2, penalty=penalty)
    model, report = finetune(model, tokenizer, recipe)
    assert report["trainable_params"] == 2 * 3 * 4 * (64 + 128)
    assert torch.equal(layer.base.weight, base)
    shrunk = (layer.a @ layer.b).norm() < delta.norm() * 0.9
    assert shrunk == (penalty > 0)


def test_penalty_without_penalised_layers_is_a_usage_error(tokenizer, tmp_path):
    recipe = small_recipe(tmp_path, mode="full", steps=1, penalty=1.0)
    with pytest.raises(UsageError, match="no layer of the model has a penalty"):
        finetune(tiny_model("llama"), tokenizer, recipe)


@pytest.mark.parametrize("model, options, message", [
    (lambda: tiny_model("llama"), {"window": 5}, "exceeds the model's 4 layers"),
    (lambda: tiny_model("llama"), {"window": 2, "starts": [0, 1]}, "must not overlap"),
    (lambda: tiny_model("llama"), {"window": 2, "num_windows": 3}, "no room"),
    (AttentionOnly, {"window": 2}, "has no FFN"),
])
def test_bad_windows_are_usage_errors(model, options, message, tokenizer):
    with pytest.raises(UsageError, match=message):
        soft_share(model(), tokenizer, **options)


@pytest.mark.slow
def test_sampled_search_picks_the_exact_searchs_window_on_smollm2(smollm2):
    """The search scores windows on a few sequences, LM head on a few positions, from cached
    inputs; on the real model it picks the window that full calibration NLL picks."""
    import copy

    from wscompress.methods._sharing import sample_inputs
    from wscompress.methods.merge_drop import drop_layers
    from wscompress.methods.soft_share import Planner, place

    model, tok = smollm2
    model = copy.deepcopy(model)
    drop_layers(model, list(range(10)))  # keep the first 10 layers: 3 candidate windows, real weights
    calibration = {"dataset": WIKI_TRAIN, "num_samples": 8, "seq_len": 256, "batch_size": 4}
    stage = {"method": "soft_share", "window": 4, "rank": 8, "search_stride": 3,
             "base": "mean", "whitening": False, "refit": False}  # what the Planner below builds
    (row,) = compress(copy.deepcopy(model), [stage], tok, calibration)
    assert len(row["search_nll"]) == 3
    arch = discover(model)
    batches = data.calibration_batches(tok, WIKI_TRAIN, 8, 256, 4, seed=0)
    planner = Planner(arch, sample_inputs(model, arch, batches, "down", 256), 8)
    exact = {}
    for start in range(0, arch.num_layers - 3, 3):
        old = place(model, planner.build(start, 4))
        with torch.no_grad():
            exact[start] = sum(model(input_ids=b, labels=b).loss.item() for b in batches) / len(batches)
        place(model, old)
    best = min(exact, key=exact.get)
    assert row["windows"] == [list(range(best, best + 4))], (row["search_nll"], exact)


def test_whitened_deltas_lower_the_output_error_on_calibration_inputs():
    """With each layer's input Gram matrix, the rank-r delta minimises the output error
    ‖(W_l - W_c - A_l B_l) Xᵀ‖ instead of the weight error: lower for every layer and role."""
    from wscompress.methods.soft_share import soft_modules

    gen = torch.Generator().manual_seed(3)
    weights = [{"up": (torch.randn(48, 32, generator=gen), None), "down": (torch.randn(32, 48, generator=gen), None)}
               for _ in range(3)]
    def gram(d):  # inputs of low effective rank, as real activations are
        x = torch.randn(256, 8, generator=gen) @ torch.randn(8, d, generator=gen) + 0.05 * torch.randn(256, d, generator=gen)
        return x.T.double() @ x.double()
    grams = [{"up": gram(32), "down": gram(48)} for _ in weights]
    plain, whitened = soft_modules(weights, 4), soft_modules(weights, 4, grams)
    for layer, w in enumerate(weights):
        for role, (wr, _) in w.items():
            assert output_error(wr, whitened[layer][role].dense_weight(), grams[layer][role]) < \
                0.9 * output_error(wr, plain[layer][role].dense_weight(), grams[layer][role])
    # base: fit, solved with the deltas for every layer's own inputs: nearer than the mean, for
    # the base alone and for base + delta
    fitted = soft_modules(weights, 4, grams, "fit")
    for role in weights[0]:
        def base_error(modules):
            return sum(output_error(w[role][0], modules[0][role].base.weight, g[role]) for w, g in zip(weights, grams))

        def error(modules):
            return sum(output_error(w[role][0], m[role].dense_weight(), g[role]) for w, m, g in zip(weights, modules, grams))
        assert fitted[0][role].base is fitted[2][role].base
        assert base_error(fitted) < 0.9 * base_error(whitened)
        assert error(fitted) < 0.9 * error(whitened)


def output_error(w: torch.Tensor, approx: torch.Tensor, gram: torch.Tensor) -> torch.Tensor:
    """‖(W − Ŵ)·Xᵀ‖² from the inputs' Gram matrix XᵀX."""
    d = w.double() - approx.double()
    return torch.trace(d @ gram @ d.T)


@pytest.mark.parametrize("kind,base", [("llama", "fit"), ("llama", "mean"), ("gpt2", "fit"), ("gpt2", "mean")])
def test_refit_deltas_bring_the_calibration_outputs_closer(kind, base, tokenizer):
    """refit re-solves the down projections (shared base and deltas) on the soft-shared stream:
    the model's outputs on the calibration sequences move closer to the original's; gate/up
    stay as they were."""
    original = tiny_model(kind)
    plain, refit = tiny_model(kind), tiny_model(kind)
    for model, option in ((plain, False), (refit, True)):
        assert soft_share(model, tokenizer, starts=[1], window=3, rank=2, base=base, refit=option)["refit"] is option
    batches = Calibration(tokenizer).batches
    assert hidden_state_error(refit, original, batches) < hidden_state_error(plain, original, batches)
    arch = discover(plain)
    for i in (1, 2, 3):
        for role, name in ffn_names(arch, i, "soft_share").items():
            a, b = plain.get_submodule(name), refit.get_submodule(name)
            assert (not torch.allclose(a.base.weight, b.base.weight)) == (role == "down"), (i, role)
            assert (not torch.allclose(a.dense_weight(), b.dense_weight())) == (role == "down"), (i, role)
        assert refit.get_submodule(ffn_names(arch, i, "soft_share")["down"]).base is \
            refit.get_submodule(ffn_names(arch, 1, "soft_share")["down"]).base  # still one shared base


def test_shared_plus_deltas_never_loses_to_the_deltas_alone():
    """The joint solve of one base and rank-r deltas lowers Σ_j tr(E_j·H_j·E_jᵀ) below the
    deltas refit around the given base (its first step), and with the full rank every layer
    gets its own target exactly."""
    gen = torch.Generator().manual_seed(0)
    targets = [torch.randn(6, 10, generator=gen, dtype=torch.float64) for _ in range(3)]
    metrics = []
    for _ in targets:
        x = torch.randn(40, 10, generator=gen, dtype=torch.float64) * torch.linspace(0.1, 3, 10, dtype=torch.float64)
        metrics.append(x.T @ x)
    base = torch.stack(targets).mean(0) + 0.5 * torch.randn(6, 10, generator=gen, dtype=torch.float64)

    def loss(c, factors):
        return sum(torch.trace((c + a @ b - m) @ h @ (c + a @ b - m).T) for m, h, (a, b) in zip(targets, metrics, factors))

    alone = loss(base, [low_rank(m - base, 2, h)[:2] for m, h in zip(targets, metrics)])
    c, factors = shared_plus_deltas(targets, metrics, 2, base)
    assert loss(c, factors) < 0.9 * alone
    c, factors = shared_plus_deltas(targets, metrics, 6, base)
    assert loss(c, factors) < 1e-12 * alone


def test_search_scores_each_window_after_its_refit(tokenizer):
    """With refit the search refits every candidate's down projections (one alternation) on
    the calibration sequences after the scored ones, from their cached inputs, before scoring:
    each score equals the sampled NLL of that window built and refit from scratch, which is
    not the unrefit window's."""
    from wscompress.methods._sharing import sample_inputs
    from wscompress.methods.soft_share import Planner, SoftShareConfig, place, refit_down_projections, sampled_nll

    model, ctx = tiny_model("llama", layers=5), Calibration(tokenizer)
    row = soft_share(model, tokenizer, window=2, rank=2, search_samples=2, search_fit_samples=2, refit=False)
    unrefit = row["search_nll"]
    model = tiny_model("llama", layers=5)
    row = soft_share(copy.deepcopy(model), tokenizer, window=2, rank=2, search_samples=2, search_fit_samples=2)
    assert set(row["search_nll"]) == {"0", "1", "2", "3"}
    (scored, fit), arch = ctx.batches, discover(model)  # batches of 2 sequences
    names = [n for i in range(5) for n in ffn_names(arch, i, "soft_share").values()]
    planner = Planner(arch, sample_inputs(model, arch, ctx.batches, "down", 256), 2, ctx.stats(model, names), "fit")
    positions = torch.randperm(31, generator=torch.Generator().manual_seed(0))[:64].sort().values
    moved = []
    for start in range(4):
        built = planner.build(start, 2, joint=False)
        old = {n: model.get_submodule(n) for n in built}
        refit_down_projections(model, arch, built, [fit], SoftShareConfig(window=2, rank=2), None, iters=1)
        score = sampled_nll(model, [scored], positions)
        place(model, old)
        assert row["search_nll"][str(start)] == pytest.approx(score, abs=2e-4)
        moved.append(abs(score - unrefit[str(start)]))
    assert max(moved) > 5e-4  # the scores are rounded to 1e-4; a random tiny model is near-uniform
