"""Soft sharing: the FFNs of a window of consecutive layers share one base weight per
projection, and each layer keeps only a low-rank delta: W_l ~ W_c + A_l B_l.

FFN neurons are in arbitrary order in each layer, so averaging raw weights would average
unrelated neurons. First the neurons of every layer in the window are aligned to the
window's first layer: the correlation of their calibration activations (the inputs of the
down projection) is matched by the Hungarian algorithm, and each layer's gate/up rows and
down columns are permuted accordingly (which leaves its function unchanged). Each delta
A_l B_l is a truncated SVD of W_l - W_c whitened by the layer's input Gram matrix (as SVD-LLM
does for whole weights), so it keeps what matters on the calibration activations
(``whitening: false`` takes the plain SVD). With ``base: fit`` W_c and the deltas are solved
together for what every layer computes on its own calibration inputs (``shared_plus_deltas``,
started from the one weight that serves every layer best, as cross_layer fits its shared
weights); ``mean`` takes the aligned weights' mean. With ``refit``
the layers are then taken in order and the window's down projections are solved again on what
the soft-shared layers before each now feed it: each member's least-squares weight for its
original layer's down output (``pipeline.refit.LeastSquares``, as cross_layer refits its shared
weights) is the target, and the shared base and the members' deltas are solved together for
those targets (``shared_plus_deltas``: alternating the base's exact solve and each delta's
truncation whitened by its inputs, the latter by subspace iteration warm-started from the
alternation before: no d_out·d_in² product per alternation). The window's
position is searched by the calibration loss of the soft-shared model (its base fitted but not
solved with the deltas, which would cost ~20x as much per candidate; with ``refit``, its down
projections refit on ``search_fit_samples`` other sequences first), estimated on
``search_samples`` sequences at ``search_positions`` fixed random positions each (the LM head
runs on those only: on a 262k vocabulary it would cost more than the rest of the search).
``finetune`` (mode ``method``) trains only the deltas, with the Frobenius penalty
``finetune.penalty`` * sum ||A_l B_l||^2.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from ..errors import UsageError
from ..io.data import first_samples
from ..io.offload import model_device, offload_of
from ..maths.linalg import low_rank, ridged, truncation_by_iteration
from ..model.arch import Arch, Conv1D, discover, get_module, require_unshared, set_module
from ..model.forms.wscompress_lowrank import LowRankDeltaLinear
from ..pipeline.layerwise import layerwise, start_at
from ..pipeline.refit import LeastSquares, WeightFit, fit_pass
from ..pipeline.stats import Stats
from ..recipe.schema import LayerRefit, StageConfig
from . import register
from ._sharing import (
    FIT_RIDGE,
    OUTPUT_ROLES,
    Weights,
    aligned_weights,
    alignment,
    check_groups,
    ffn_names,
    fitted_weight,
    sample_inputs,
)


class SoftShareConfig(StageConfig, LayerRefit):
    method: Literal["soft_share"] = "soft_share"
    window: int = Field(4, ge=2, description="consecutive layers sharing one FFN base")
    rank: int = Field(16, ge=1, description="rank of each layer's delta A_l B_l")
    starts: list[int] | None = Field(None, description="first layers of the windows; default: searched by calibration loss")
    num_windows: int = Field(1, ge=1, description="windows placed by the search (greedily, without overlap)")
    search_stride: int = Field(1, ge=1, description="search every k-th start position")
    search_samples: int = Field(4, ge=1, description="calibration sequences the search scores windows on")
    search_fit_samples: int = Field(8, ge=0, description="with refit: the next calibration sequences each "
                                                          "candidate's down projections are refit on before it is "
                                                          "scored (0: scored unrefit)")
    search_positions: int = Field(64, ge=1, description="next-token predictions scored per sequence (a fixed "
                                                       "random subset: the LM head runs on these only)")
    samples_per_batch: int = Field(256, ge=8, description="token rows per calibration batch used to correlate neurons")
    base: Literal["fit", "mean"] = Field("fit", description="each projection's shared weight: fit (default; "
                                         "solved together with the deltas for what every layer of the window "
                                         "computes on its own calibration inputs; on the protocol's layers 13-16 "
                                         "it won on wiki.test and brown.txt) or mean (of the aligned weights)")
    whitening: bool = Field(True, description="true (default): deltas by whitened SVD on each layer's input Gram "
                                              "(activation-aware); false: plain SVD of W_l - W_c. On the protocol the "
                                              "whitened deltas won on wiki.test and on brown.txt")

    def ffn_names(self, model: nn.Module, arch: Arch) -> list[str]:
        """Every layer's FFN projections, refused where the windows do not fit the model, it has no
        FFN layers or an earlier stage shares them."""
        n = arch.num_layers
        if self.window > n:
            raise UsageError(f"soft_share: window {self.window} exceeds the model's {n} layers", f"use a window of at most {n}")
        if self.starts is None and self.window * self.num_windows > n:
            raise UsageError(f"soft_share: no room for {self.num_windows} windows of {self.window} layers in {n} layers",
                             "use fewer or smaller windows")
        names = [name for i in range(n) for name in ffn_names(arch, i, "soft_share").values()]
        require_unshared(model, names, "soft_share")
        if self.starts is not None:
            check_groups([list(range(s, s + self.window)) for s in self.starts], n, what="starts")
        return names

    def check(self, model: nn.Module) -> None:
        self.ffn_names(model, discover(model))


@torch.no_grad()
def soft_modules(weights: list[dict[str, Weights]], rank: int, grams: list[dict[str, torch.Tensor]] | None = None,
                 base: Literal["fit", "mean"] = "mean", whitening: bool = True,
                 joint: bool = True) -> list[dict[str, LowRankDeltaLinear]]:
    """One LowRankDeltaLinear per layer and role. ``mean``: the role's shared base W_c is the
    mean of the window's aligned weights and each delta the rank-``rank`` truncated SVD of
    W_l - W_c, whitened by the layer's input Gram matrix for that role (``grams`` given and
    ``whitening``). ``fit`` (needs ``grams``): the base is fitted to every layer's inputs as
    cross_layer's ``init: fit`` fits it and, with ``whitening`` and ``joint``, then solved
    together with the deltas for what each layer computes on its inputs (``shared_plus_deltas``,
    metric G_l + λ·I; ~20x the cost of the rest, so the window search goes without)."""
    out: list[dict[str, LowRankDeltaLinear]] = [{} for _ in weights]
    for role in weights[0]:
        ws = [w[role][0] for w in weights]
        dtype, device = ws[0].dtype, ws[0].device
        center = torch.stack([w.double() for w in ws]).mean(0)
        r = min(rank, *center.shape)
        if base == "fit":
            center = fitted_weight(ws, [g[role] for g in grams], center)
        if base == "fit" and whitening and joint:
            metrics = [ridged(g[role].double().to(device), FIT_RIDGE)[0] for g in grams]
            center, factors = shared_plus_deltas([w.double() for w in ws], metrics, r, center)
        else:
            factors = [low_rank(w.double() - center, r, g[role] if grams and whitening else None)[:2]
                       for w, g in zip(ws, grams or [None] * len(ws))]
        shared = nn.Linear(center.shape[1], center.shape[0], bias=False, device=device, dtype=dtype)
        shared.weight.copy_(center)
        for layer, (left, right) in enumerate(factors):  # balanced factors
            bias = weights[layer][role][1]
            module = LowRankDeltaLinear(center.shape[1], center.shape[0], r, bias is not None).to(device=device, dtype=dtype)
            module.base = shared
            module.a.copy_(left)
            module.b.copy_(right)
            if bias is not None:
                module.bias.copy_(bias)
            out[layer][role] = module
    return out


class Planner:
    """Builds soft-shared FFN modules for any window, caching neuron alignments."""

    def __init__(self, arch: Arch, acts: dict[int, torch.Tensor], rank: int, stats: Stats | None = None,
                 base: Literal["fit", "mean"] = "mean", whitening: bool = True):
        self.arch, self.acts, self.rank, self.stats, self.base, self.whitening = arch, acts, rank, stats, base, whitening
        self._perms: dict[tuple[int, int], torch.Tensor] = {}

    def perm(self, ref: int, i: int) -> torch.Tensor:
        if i == ref:
            return torch.arange(self.acts[i].shape[1])
        if (ref, i) not in self._perms:
            self._perms[(ref, i)] = alignment(self.acts[ref], self.acts[i])
        return self._perms[(ref, i)]

    def build(self, start: int, window: int, joint: bool = True) -> dict[str, nn.Module]:
        """Module name -> new module for every FFN projection of layers start..start+window-1
        (``joint``: see ``soft_modules``)."""
        layers = range(start, start + window)
        weights = [aligned_weights(self.arch, i, self.perm(start, i)) for i in layers]
        grams = None
        if self.stats is not None:  # the down projection's inputs are the permuted neurons
            grams = [{role: self.stats.of(name) if role in OUTPUT_ROLES else self.stats.of(name)[p][:, p]
                      for role, name in ffn_names(self.arch, i, "soft_share").items()}
                     for i in layers for p in [self.perm(start, i)]]
        out = {}
        for i, modules in zip(layers, soft_modules(weights, self.rank, grams, self.base, self.whitening, joint)):
            names = ffn_names(self.arch, i, "soft_share")
            for role, m in modules.items():
                m.conv1d = isinstance(get_module(self.arch.model, names[role]), Conv1D)
                out[names[role]] = m
        return out


@torch.no_grad()
def sampled_nll(model: nn.Module, batches: list[torch.Tensor], positions: torch.Tensor) -> float:
    """Mean next-token NLL at ``positions`` of every sequence: the LM head (the costliest layer
    of a large-vocabulary model, e.g. Gemma's 262k) runs on those positions only."""
    device = model_device(model)
    total, count = 0.0, 0
    for b in batches:
        b = b.to(device)
        with offload_of(model).running():
            logits = model(input_ids=b, logits_to_keep=positions.to(device), use_cache=False).logits.float()
        total += F.cross_entropy(logits.flatten(0, 1), b[:, positions.to(device) + 1].flatten(), reduction="sum").item()
        count += logits.shape[0] * logits.shape[1]
    return total / count


@torch.no_grad()
def shared_plus_deltas(targets: list[torch.Tensor], metrics: list[torch.Tensor], rank: int, base: torch.Tensor,
                       iters: int = 20, tol: float = 1e-4) -> tuple[torch.Tensor, list]:
    """min over C and rank-``rank`` Δ_j of Σ_j tr((C + Δ_j − M_j)·H_j·(C + Δ_j − M_j)ᵀ): the one
    base and the per-layer deltas that best serve each layer's least-squares weight M_j in its
    metric H_j. Alternates the two minimisers from ``base``: each Δ_j the H_j-whitened
    truncation of M_j − C, then C = Σ(M_j − Δ_j)·H_j·(Σ H_j)⁻¹. Stops when C moves by less
    than ``tol`` (relative). Float64; returns C and the deltas' (A_j, B_j).

    The truncations run by subspace iteration (``truncation_by_iteration``) in a 2·rank-wide
    subspace per layer, carried from one alternation to the next, where M_j − C barely moves:
    16 steps from a random start, then 2 an alternation. On SmolLM2's FFNs 20 alternations
    came within 3e-5 of the exact eigensolver's loss in a third to a half of its time; on a
    7B-shaped down projection a later alternation's truncation took 0.9 s against 17.7 s
    (``scripts/experiments/bench_soft_share_search.py``, section 4)."""
    total = torch.linalg.cholesky(sum(metrics))
    # C = (Σ M_j·H_j − Σ A_j·B_j·H_j)·(Σ H_j)⁻¹: the first term once, the second through the
    # rank-row B_j·H_j, so an alternation solves for rank rows a member, not d_out
    fixed = torch.cholesky_solve(sum(m @ h for m, h in zip(targets, metrics)).T, total).T
    c = base.double()
    gen = torch.Generator().manual_seed(0)
    bases = [torch.randn(m.shape[0], min(2 * rank, m.shape[0]), generator=gen, dtype=torch.float64).to(m.device)
             for m in targets]
    for it in range(iters):
        steps = 16 if it == 0 else 2
        done = [truncation_by_iteration(m - c, rank, h, q, steps) for m, h, q in zip(targets, metrics, bases)]
        factors, bases = [(a, b) for a, b, _ in done], [q for *_, q in done]
        new = fixed - sum(a @ torch.cholesky_solve((b @ h).T, total).T for (a, b), h in zip(factors, metrics))
        moved = (new - c).norm() / c.norm().clamp_min(1e-30)
        c = new
        if moved < tol:
            break
    return c, factors


def refit_down_projections(model: nn.Module, arch: Arch, built: dict[str, nn.Module], batches: list[torch.Tensor],
                           cfg: SoftShareConfig, dtype: torch.dtype, iters: int = 20, first: int = 0,
                           hidden: list[torch.Tensor] | None = None) -> None:
    """Swap the ``built`` soft-shared modules in (name -> module; the model holds the
    originals) layer by layer (``pipeline.refit.fit_pass``, from layer ``first``, fed
    ``hidden``) and re-solve each window's down projections: every member's least-squares
    weight for its original down projection's target, on the inputs it now reads, and the
    shared base and the deltas so far solved together for them (``shared_plus_deltas``,
    ``iters`` alternations), so the last member's solve uses them all."""
    by_layer: dict[int, dict[str, nn.Module]] = {}
    for name, module in built.items():
        by_layer.setdefault(arch.layer_of(name), {})[name] = module
    downs = {ffn_names(arch, i, "soft_share")["down"] for i in by_layer}
    windows: dict[int, list[tuple[LowRankDeltaLinear, torch.Tensor, torch.Tensor]]] = {}  # base -> (module, M, H)

    def stage(modules: dict[str, nn.Module], weights: dict[str, torch.Tensor], same: bool, _dtype) -> WeightFit | None:
        (name, module), *more = modules.items()
        if more or name not in downs:
            return None
        window = windows.setdefault(id(module.base), [])

        def write(fit: LeastSquares) -> None:
            window.append((module, fit.solve(), fit.metric()))
            base, factors = shared_plus_deltas([m for _, m, _ in window], [h for _, _, h in window], module.rank,
                                               module.base.weight, iters)
            module.base.weight.copy_(base)
            for (member, _, _), (left, right) in zip(window, factors):
                member.a.copy_(left)
                member.b.copy_(right)
        return WeightFit(weights[name], same, LeastSquares(module.dense_weight(), cfg.ridge), write)

    fit_pass(model, arch, batches, lambda i: by_layer.get(i, {}), stage, cfg.refit_target, dtype,
             layers=range(first, max(by_layer) + 1), hidden=hidden, label="soft_share: refitting the down projections")


def place(model: nn.Module, modules: dict[str, nn.Module]) -> dict[str, nn.Module]:
    """Swap the named modules in; returns the ones they replaced."""
    old = {n: get_module(model, n) for n in modules}
    for n, m in modules.items():
        set_module(model, n, m)
    return old


def search_batches(cfg: SoftShareConfig, batches: list[torch.Tensor]) -> tuple[list, list, torch.Tensor]:
    """What the search scores on (the first ``search_samples`` sequences, at ``search_positions``
    fixed random positions) and the batches each candidate is refit on first: the next
    ``search_fit_samples`` sequences with ``refit`` (none without, or when the calibration set
    has no sequences beyond the scored ones)."""
    rows, size = torch.cat(batches), batches[0].shape[0]
    scored = list(rows[: cfg.search_samples].split(size))
    fit = [b for b in rows[cfg.search_samples: cfg.search_samples + cfg.search_fit_samples].split(size) if len(b)]
    gen = torch.Generator().manual_seed(0)
    positions = torch.randperm(rows.shape[1] - 1, generator=gen)[: cfg.search_positions].sort().values
    return scored, fit if cfg.refit else [], positions


def search(model: nn.Module, planner: Planner, candidates: list[int], cfg: SoftShareConfig, scored: list[torch.Tensor],
           positions: torch.Tensor, fit: list[torch.Tensor], dtype: torch.dtype) -> tuple[int, dict[int, float]]:
    """The start whose window, soft-shared, gives the lowest sampled NLL on the ``scored``
    batches (model restored). Each candidate is built without the joint solve and, given
    ``fit`` batches (other calibration sequences than the scored ones; none: scored unrefit),
    its down projections are refit on them with one alternation: the refit is what decides the result (on the
    protocol's held-out text it cuts layers 15-18's loss above dense by 80 %, layers 2-5's by
    28 %), so a search before it picks the wrong window. One pass of the original model brings
    every batch to each candidate's first layer in turn (memory: one layer's hidden states);
    a candidate runs from there."""
    arch, window = planner.arch, cfg.window
    scores = {}
    for i, _layer, inputs in layerwise(model, scored + fit, arch, "soft_share: searching the window"):
        if i > max(candidates):
            break
        if i not in candidates:
            continue
        built = planner.build(i, window, joint=False)
        old = {n: get_module(model, n) for n in built}
        if fit:
            refit_down_projections(model, arch, built, fit, cfg, dtype, iters=1, first=i, hidden=inputs.hidden[len(scored):])
        else:
            place(model, built)
        with start_at(arch, i, inputs.hidden[: len(scored)]):
            scores[i] = sampled_nll(model, scored, positions)
        place(model, old)
    return min(scores, key=scores.get), scores


@register(SoftShareConfig, whole_model=True)
def apply(model, cfg: SoftShareConfig, ctx) -> dict:
    arch = discover(model)
    n = arch.num_layers
    names = cfg.ffn_names(model, arch)
    batches = ctx.calibration()
    stats = ctx.stats(model, names) if cfg.whitening or cfg.base == "fit" else None
    acts = sample_inputs(model, arch, batches, "down", cfg.samples_per_batch, dtype=ctx.dtype(model))
    planner = Planner(arch, acts, cfg.rank, stats, cfg.base, cfg.whitening)
    scores: dict[int, float] = {}
    originals: dict[str, nn.Module] = {}
    if cfg.starts is not None:
        starts = cfg.starts
        for s in starts:
            originals.update(place(model, planner.build(s, cfg.window)))
    else:
        starts = []
        scored, fit, positions = search_batches(cfg, batches)
        for _ in range(cfg.num_windows):
            free = [s for s in range(0, n - cfg.window + 1, cfg.search_stride)
                    if all(s + cfg.window <= t or t + cfg.window <= s for t in starts)]
            if not free:  # the greedy placement left only gaps shorter than a window
                raise UsageError(f"soft_share: the searched windows {starts} leave no room for another of {cfg.window} layers",
                                 "give the windows' first layers explicitly with starts, or use fewer windows")
            best, scores = search(model, planner, free, cfg, scored, positions, fit, ctx.dtype(model))
            starts.append(best)
            originals.update(place(model, planner.build(best, cfg.window)))
    if cfg.refit:  # the originals back, for the refit to swap the windows in layer by layer
        refit_down_projections(model, arch, place(model, originals), first_samples(batches, cfg.refit_samples), cfg,
                               ctx.dtype(model))
    return {"windows": [list(range(s, s + cfg.window)) for s in starts], "rank": cfg.rank, "base": cfg.base,
            "whitening": cfg.whitening, "refit": cfg.refit,
            "search_nll": {str(k): round(v, 4) for k, v in scores.items()}}
