"""Benchmark: soft_share's window search, fast (sampled) scoring against the exact search.

1. SmolLM2-135M: the stage's search (``search_samples`` sequences, LM head on
   ``search_positions`` positions each) next to the exact search (full calibration NLL of every
   candidate window): the window each picks, their top 5 and the time.
   Both score windows as built before any refit (``refit: false``, ``base: mean``, plain deltas).
2. A Gemma-3-270M-shaped model (18 layers, hidden 640, 262 144-token vocabulary, random
   weights built from a config: nothing is downloaded): the whole soft_share stage with the
   default calibration (32 x 512 tokens), timed.
3. The search with the defaults (``refit: true``) on the protocol's calibration set
   (configs/protocol.yaml, 64 x 512): its scores with each candidate refit before it is
   scored (``search_fit_samples``, the default) and without (``search_fit_samples: 0``, the
   search before), and what each pick is worth: the window built and refit as the stage does,
   its NLL on 12 windows of wiki.train.txt that no calibration window overlaps, above the
   dense model's.
4. The joint solve of one window's base and deltas (``shared_plus_deltas``, on layers 15-18 as
   the stage builds them on the protocol's calibration set): its loss and time with the
   deltas truncated by subspace iteration (the stage's) against the exact eigensolver
   (``low_rank``) at every alternation, after 1 and 20 alternations; and one truncation of a
   7B-shaped down projection (4096 x 11008, random weight and metric): exact, and iterated
   from a random start (16 steps, an alternation's first) and from its own result (2 steps,
   every later alternation).

Usage: python scripts/experiments/bench_soft_share_search.py [--window 4] [--rank 8] [--skip exact gemma refit solve]
"""

from __future__ import annotations

import argparse
import copy
import time
from pathlib import Path

import torch

import wscompress
from wscompress import load
from wscompress.io import data
from wscompress.io.checkpoints import builtin_dir

REPO = Path(__file__).resolve().parents[2]
WIKI_TRAIN = "builtin:wiki.train"


def exact_search(model, tok, window: int, rank: int, calibration: dict) -> dict[int, float]:
    """Every start's full calibration NLL (the search as it was before sampled scoring)."""
    from wscompress.methods._sharing import sample_inputs
    from wscompress.methods.soft_share import Planner, place
    from wscompress.model.arch import discover

    arch = discover(model)
    batches = data.calibration_batches(tok, calibration["dataset"], calibration["num_samples"], calibration["seq_len"],
                                       4, 0)
    planner = Planner(arch, sample_inputs(model, arch, batches, "down", 256), rank)
    scores = {}
    for start in range(arch.num_layers - window + 1):
        old = place(model, planner.build(start, window))
        with torch.no_grad():
            scores[start] = sum(model(input_ids=b, labels=b).loss.item() for b in batches) / len(batches)
        place(model, old)
    return scores


def gemma_270m_shaped():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    config = AutoConfig.for_model("gemma3_text", vocab_size=262_144, hidden_size=640, intermediate_size=2048,
                                  num_hidden_layers=18, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                                  sliding_window=512, bos_token_id=2, eos_token_id=1, pad_token_id=0)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    # byte-level stand-in tokenizer whose ids spread over the whole vocabulary
    vocab = {chr(i): i * 997 % 262_000 + 3 for i in range(256)}
    tok = Tokenizer(models.WordLevel(vocab=vocab | {"<unk>": 262_100}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return model, PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<unk>", pad_token="<unk>")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--window", type=int, default=4)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--samples", type=int, default=8, help="calibration sequences for the SmolLM2 comparison")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--skip", nargs="*", default=[], choices=["exact", "gemma", "refit", "solve"])
    args = parser.parse_args()
    stage = {"method": "soft_share", "window": args.window, "rank": args.rank, "refit": False, "base": "mean",
             "whitening": False}  # what exact_search builds
    calibration = {"dataset": WIKI_TRAIN, "num_samples": args.samples, "seq_len": args.seq_len, "batch_size": 4}

    model, tok = load(str(builtin_dir("smollm2-135m-instruct")))
    start = time.perf_counter()
    (row,) = wscompress.compress(copy.deepcopy(model), [stage], tok, calibration)
    fast_s = time.perf_counter() - start
    fast = {int(k): v for k, v in row["search_nll"].items()}
    print(f"| SmolLM2 | search | window | top 5 | seconds |\n|---|---|---|---|---|")
    print(f"| {args.samples} x {args.seq_len} | sampled (stage) | {row['windows'][0]} | {sorted(fast, key=fast.get)[:5]} "
          f"| {fast_s:.0f} (whole stage) |")
    if "exact" not in args.skip:
        start = time.perf_counter()
        exact = exact_search(model, tok, args.window, args.rank, calibration)
        best = min(exact, key=exact.get)
        print(f"| {args.samples} x {args.seq_len} | exact | {list(range(best, best + args.window))} "
              f"| {sorted(exact, key=exact.get)[:5]} | {time.perf_counter() - start:.0f} |")
    if "gemma" not in args.skip:
        gemma, gtok = gemma_270m_shaped()
        start = time.perf_counter()
        (row,) = wscompress.compress(gemma, [{"method": "soft_share", "window": args.window, "rank": args.rank}],
                                     gtok, {"dataset": WIKI_TRAIN})  # default: 32 x 512
        print(f"\nGemma-3-270M-shaped (random weights, vocab 262 144), default calibration 32 x 512: whole soft_share "
              f"stage {time.perf_counter() - start:.0f} s, window {row['windows'][0]}")

    if "refit" not in args.skip:
        refit_search(model, tok)
    if "solve" not in args.skip:
        joint_solve(model, tok)


def refit_search(model, tok) -> None:
    """Section 3: the default search with and without each candidate's refit, and the held-out
    NLL of each pick once built and refit as the stage does."""
    import random

    import torch.nn.functional as F

    from wscompress.methods._sharing import ffn_names, sample_inputs
    from wscompress.methods.soft_share import (
        Planner,
        SoftShareConfig,
        by_layer,
        place,
        refit_down_projections,
        search,
        search_batches,
    )
    from wscompress.model.arch import discover
    from wscompress.pipeline.context import Context
    from wscompress.pipeline.layerwise import layerwise
    from wscompress.recipe.load import load_recipe

    recipe = load_recipe(REPO / "configs" / "protocol.yaml")
    ctx, cfg, arch = Context(recipe.calibration, tok), SoftShareConfig(), discover(model)
    batches, dtype = ctx.calibration(), ctx.dtype(model)
    names = [n for i in range(arch.num_layers) for n in ffn_names(arch, i, "soft_share").values()]
    planner = Planner(arch, sample_inputs(model, arch, batches, "down", cfg.samples_per_batch, dtype=dtype), cfg.rank,
                      ctx.stats(model, names), cfg.base, cfg.whitening)
    scored, fit, positions = search_batches(cfg, batches)  # what the stage scores and refits on
    candidates = list(range(arch.num_layers - cfg.window + 1))
    picks = {}
    for label, refit in ((f"refit on {cfg.search_fit_samples} sequences (default)", fit), ("unrefit (before)", [])):
        start = time.perf_counter()
        best, scores = search(model, planner, candidates, cfg.window, scored, positions, refit, dtype)
        picks[label] = (best, sorted(scores, key=scores.get)[:5], time.perf_counter() - start)

    # held-out text: the calibration set's GPTQ sampler draws 64 windows; take 12 others that overlap none
    c = recipe.calibration
    ids = data.tokenize(tok, c.dataset)
    random.seed(c.seed)
    drawn = [random.randint(0, len(ids) - c.seq_len - 1) for _ in range(c.num_samples)]
    free = [w for w in range(0, len(ids) - c.seq_len, c.seq_len)
            if all(w + c.seq_len <= d or d + c.seq_len <= w for d in drawn)]
    held = torch.stack([ids[w: w + c.seq_len] for w in free[:: len(free) // 12][:12]]).split(4)

    @torch.no_grad()
    def nll() -> float:
        return sum(F.cross_entropy(model(input_ids=b).logits[:, :-1].flatten(0, 1), b[:, 1:].flatten()).item()
                   for b in held) / len(held)

    dense = nll()
    worth = {}
    for best, _, _ in picks.values():
        if best not in worth:
            old = place(model, planner.build(best, cfg.window))
            unrefit = nll() - dense
            members = by_layer(arch, old, range(best, best + cfg.window))
            refit_down_projections(model, arch, members, layerwise(model, batches, arch, "refit", dtype), dtype)
            worth[best] = (unrefit, nll() - dense)
            place(model, old)
    print("\n| search (protocol calibration, defaults) | window | top 5 | search s | held-out NLL above dense: "
          "built, unrefit | built + refit (the stage's result) |\n|---|---|---|---|---|---|")
    for label, (best, top, seconds) in picks.items():
        print(f"| {label} | {best}-{best + cfg.window - 1} | {top} | {seconds:.0f} | {worth[best][0]:.4f} "
              f"| {worth[best][1]:.4f} |")


def joint_solve(model, tok, start: int = 15) -> None:
    """Section 4: ``shared_plus_deltas`` with its subspace-iterated truncations against the
    exact ones, on the problems the stage's build of layers ``start``.. poses."""
    from wscompress.maths.linalg import low_rank, truncation_by_iteration
    from wscompress.methods import soft_share
    from wscompress.methods._sharing import ffn_names, sample_inputs
    from wscompress.model.arch import discover
    from wscompress.pipeline.context import Context
    from wscompress.recipe.load import load_recipe

    recipe = load_recipe(REPO / "configs" / "protocol.yaml")
    ctx, cfg, arch = Context(recipe.calibration, tok), soft_share.SoftShareConfig(), discover(model)
    names = [n for i in range(arch.num_layers) for n in ffn_names(arch, i, "soft_share").values()]
    acts = sample_inputs(model, arch, ctx.calibration(), "down", cfg.samples_per_batch, dtype=ctx.dtype(model))
    planner = soft_share.Planner(arch, acts, cfg.rank, ctx.stats(model, names), cfg.base, cfg.whitening)
    problems, solve = [], soft_share.shared_plus_deltas
    soft_share.shared_plus_deltas = lambda *a, **k: problems.append(a) or solve(*a, iters=1)  # the build's problems
    try:
        planner.build(start, cfg.window)
    finally:
        soft_share.shared_plus_deltas = solve

    def exact(targets, metrics, rank, c, iters):  # the same alternation, each delta by low_rank
        total, fixed = torch.linalg.cholesky(sum(metrics)), sum(m @ h for m, h in zip(targets, metrics))
        for _ in range(iters):
            factors = [low_rank(m - c, rank, h)[:2] for m, h in zip(targets, metrics)]
            c = torch.cholesky_solve((fixed - sum(a @ (b @ h) for (a, b), h in zip(factors, metrics))).T, total).T
        return c, factors

    def loss(targets, metrics, c, factors) -> float:
        return sum(torch.trace((c + a @ b - m) @ h @ (c + a @ b - m).T).item()
                   for m, h, (a, b) in zip(targets, metrics, factors))

    print(f"\n| layers {start}-{start + cfg.window - 1}, weight | alternations | exact s | iterated s | "
          "iterated loss / exact - 1 |\n|---|---|---|---|---|")
    for targets, metrics, rank, base in problems:
        targets = [t.double() for t in targets]
        for iters in (1, 20):
            t = time.perf_counter()
            exact_loss = loss(targets, metrics, *exact(targets, metrics, rank, base.double(), iters))
            exact_s, t = time.perf_counter() - t, time.perf_counter()
            iterated = loss(targets, metrics, *solve(targets, metrics, rank, base, iters, tol=0))
            print(f"| {tuple(targets[0].shape)} | {iters} | {exact_s:.2f} | {time.perf_counter() - t:.2f} "
                  f"| {iterated / exact_loss - 1:+.1e} |")

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(4096, 11008, generator=gen, dtype=torch.float64)
    v = torch.randn(11008, 256, generator=gen, dtype=torch.float64)
    metric = v @ v.T + torch.diag(torch.rand(11008, generator=gen, dtype=torch.float64))  # SPD, a few strong directions
    t = time.perf_counter()
    low_rank(w, cfg.rank, metric)
    times = [f"exact {time.perf_counter() - t:.1f} s"]
    start = torch.randn(4096, 2 * cfg.rank, generator=gen, dtype=torch.float64)
    for label, steps in (("16 steps (first alternation)", 16), ("2 steps (later ones)", 2)):
        t = time.perf_counter()
        *_, start = truncation_by_iteration(w, cfg.rank, metric, start, steps)
        times.append(f"{label} {time.perf_counter() - t:.2f} s")
    print(f"\n7B-shaped down projection (4096 x 11008), rank {cfg.rank}, one truncation: " + ", ".join(times))


if __name__ == "__main__":
    main()
