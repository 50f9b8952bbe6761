"""Weight clustering (palettization, as in Deep Compression): every weight, or every d-long
sub-vector of a row, is replaced by the nearest of K = 2^bits centroids; a layer stores
bit-packed indices plus the codebook (optionally Huffman-coded on disk).

By default the clustering is told what matters (``sensitivity: activation``): each weight's
squared error counts with the energy of its input (the diagonal of the layer's input Gram
matrix from calibration), the indices are chosen with error feedback so that the layer's
output error, not the weights', is minimised (``error_feedback``; see ``clustering.assign``),
a small fraction of the most sensitive weights is kept aside in fp16 (``outliers``: the
dense-and-sparse split of SqueezeLLM) and codebooks are stored in fp16. With ``refit`` (the
default) the decoder layers are palettized in one layer-by-layer pass on the inputs the
compressed model itself produces, each module for the weight that best reproduces the original
layer there (``_Palettize``), instead of on the original model's statistics; ``objective:
fisher`` weighs that pass's Gram matrices, a block of output channels at a time, by the end
loss's squared gradients (GuidedQuant). With
``sensitivity: none``, ``error_feedback: false`` and ``refit: false`` it needs no calibration
data at all (the fast path). The k-means algorithms themselves are in ``wscompress/clustering.py``.

With a ``budget`` (bits a weight, or bytes, over the targets) each matrix gets its own layout
from a ``menu`` (default ``MENU``: the shipped 2-, 3- and 4-bit layouts and the index widths
between them): every matrix is palettized with every layout on the calibration statistics,
each result's exact bytes and its estimated cost to the model (½ · output sensitivity ·
tr(ΔW·G·ΔWᵀ), the loss its output error adds to first order, as the low-rank allocation weighs
spectra) measured, the least-cost choice within the budget solved exactly
(``maths.knapsack``), then the chosen layouts applied as a uniform stage would be.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Mapping
from typing import Literal

import numpy as np
import torch
from pydantic import Field, model_validator
from torch import nn

from ..errors import UsageError
from ..io.data import first_samples
from ..io.files import cache_dir
from ..maths import knapsack
from ..maths.clustering import GramFactors, assign, cluster
from ..maths.linalg import add_gram, solve_coefficients, symmetrize
from ..model.arch import Conv1D, dims_of, discover, target_layers, tied_to_embeddings, weight_of
from ..model.forms.wscompress_palettized import CodebookDtype, PalettizedLinear, entropy, packed_nbytes
from ..pipeline.calibration import output_fisher
from ..pipeline.layerwise import onloaded, replace_each
from ..pipeline.refit import Sums, fit_pass
from ..pipeline.stats import SharedGrams
from ..recipe.schema import Budget, Init, LayerRefit, TargetedStage
from . import register

# a budget measures each layout on every 4th block of a matrix's rows (``measured_rows``)
MEASURE_EVERY = 4
# what a layout is made of (the rest of the options mean the same for every layout)
LAYOUT_KEYS = ("bits", "cluster_dim", "granularity", "group_size", "row_scale", "outliers")
# the budget's default menu: 2-d vectors a codebook per 64 channels with 5-8-bit indices (2.5-4
# bits a weight; the 3- and 4-bit recipes' layouts at 6 and 8) and the 2-bit recipe's 4-d
# vectors, row scales on all; kept-aside weights as in the recipe nearest in bits; and the
# speed-first 4-bit recipe's scalar codebook per channel (the fastest kernels)
MENU = [{"bits": 8, "cluster_dim": 4, "granularity": "per_tensor", "row_scale": True, "outliers": 0.005},
        *({"bits": bits, "cluster_dim": 2, "granularity": "grouped", "group_size": 64, "row_scale": True,
           "outliers": aside} for bits, aside in ((5, 0.0035), (6, 0.0035), (7, 0.0007), (8, 0.0007))),
        {"bits": 4, "cluster_dim": 1, "granularity": "per_channel", "row_scale": True, "outliers": 0.0007}]


class KMeansConfig(TargetedStage, LayerRefit):
    """Palettize linear layers (default: every linear of the decoder layers)."""

    method: Literal["kmeans"] = "kmeans"
    bits: int = Field(4, ge=1, le=8, description="index bits: K = 2^bits centroids per codebook")
    granularity: Literal["per_tensor", "per_channel", "grouped"] = "per_channel"
    group_size: int | None = Field(None, gt=0, description="output channels sharing a codebook (granularity: grouped)")
    cluster_dim: int = Field(1, ge=1, description="length of the sub-vectors clustered together (1: scalar)")
    init: Init = "kmeans++"
    n_init: int | None = Field(None, ge=1, description="k-means restarts, the lowest error wins (default: 3 for "
                               "scalar per_tensor, where they run on the histogram; 1 otherwise)")
    iterations: int = Field(300, gt=0, description="maximum Lloyd iterations (stops earlier when converged)")
    entropy_coding: bool = Field(False, description="store indices Huffman-coded on disk")
    sensitivity: Literal["activation", "none"] = Field("activation", description="weigh each weight's error by its "
                                                       "input's energy (calibration Gram diagonal), or not")
    error_feedback: bool = Field(True, description="choose indices column by column, pushing each column's error "
                                                   "onto the next ones through the inverse Gram matrix (GPTQ)")
    damp: float = Field(0.01, gt=0, description="error feedback: Gram dampening, relative to its mean diagonal")
    objective: Literal["layer", "fisher"] = Field("layer", description="what the sensitivity and error feedback "
                                                  "minimise: each layer's output error, or that error weighted by the "
                                                  "end loss's squared gradients on each block of output channels "
                                                  "(GuidedQuant; one more backward pass over the refit sequences)")
    fisher_blocks: int = Field(4, gt=0, description="objective fisher: at most this many blocks of output channels a "
                               "matrix (whole codebook groups), each with its own loss-weighted Gram matrix")
    outliers: float = Field(0.0025, ge=0, lt=0.5, description="fraction of the most sensitive weights kept aside "
                                                              "in a sparse fp16 tensor instead of the codebook")
    row_scale: bool = Field(False, description="divide each output channel by its RMS before clustering and keep "
                            "that scale (in codebook_dtype): one codebook of normalised values serves rows of "
                            "different magnitudes (GPTVQ); 16 bits per output channel")
    codebook_dtype: CodebookDtype = Field("float16", description="dtype the codebooks, scales and outliers are stored in")
    seed: int = 0
    budget: Budget | None = Field(None, description="a size the targets must fit: each matrix gets the layout of "
                                  "`menu` that costs the model least within it (the layout options above are ignored)")
    menu: list[dict] | None = Field(None, description=f"layouts a budget chooses from, each a mapping of "
                                    f"{', '.join(LAYOUT_KEYS)} (default: the MENU of methods/kmeans.py)")
    sensitivity_samples: int = Field(16, gt=0, description="budget: calibration sequences for the output "
                                     "sensitivities that weigh each matrix's error")

    @property
    def needs_statistics(self) -> bool:
        return self.sensitivity != "none" or self.error_feedback or self.refit or self.budget is not None

    @property
    def allocates(self) -> bool:
        """A budget weighs each matrix by its output sensitivity: `calibrate` saves them too."""
        return self.budget is not None

    def check(self, model: nn.Module) -> None:
        """Every target pattern names a linear, the options tile each one (under a budget: some
        layout of the menu does), and a budget lies between the menu's smallest choices and the
        dense weights."""
        layers = target_layers(model, self)
        layouts = self.layouts() if self.budget is not None else [self]
        fitting = {}  # name -> the layouts that tile it
        for name, module in layers.items():
            problems = [misfit(model, name, module, cfg) for cfg in layouts]
            if all(problems):
                raise problems[0]
            fitting[name] = [cfg for cfg, problem in zip(layouts, problems) if problem is None]
        if self.budget is not None:
            weights = sum(weight_of(m).numel() for m in layers.values())
            budget = self.budget.bytes_for(weights) - beside(model, list(layers))
            least = sum(min(layout_bytes(*reversed(dims_of(m)), cfg) for cfg in fitting[n]) for n, m in layers.items())
            dense = sum(weight_of(m).numel() * weight_of(m).element_size() for m in layers.values())
            self.budget.check("kmeans", budget, weights, least, "menu's smallest layouts", dense)

    @model_validator(mode="after")
    def _group_size(self) -> KMeansConfig:
        if (self.granularity == "grouped") != (self.group_size is not None):
            raise ValueError("group_size is required with granularity: grouped and only allowed with it")
        if self.menu is not None and self.budget is None:
            raise ValueError("menu is the choice of a budget: give budget too")
        if self.objective == "fisher" and not (self.refit and self.error_feedback and self.sensitivity != "none"):
            raise ValueError("objective: fisher weighs the refit pass's Gram matrices: it needs refit, error_feedback "
                             "and sensitivity: activation (the defaults)")
        if self.budget is not None:
            if self.entropy_coding:
                raise ValueError("a budget counts bytes before they are coded: use entropy_coding: false with it")
            for layout in self.menu or []:
                if not isinstance(layout, dict) or not layout or set(layout) - set(LAYOUT_KEYS):
                    raise ValueError(f"menu entry {layout!r}: a mapping of {', '.join(LAYOUT_KEYS)}")
            self.layouts()  # each entry checked as a layout
        return self

    def layouts(self) -> list[KMeansConfig]:
        """The menu's layouts, each as this stage with that layout (and no budget)."""
        base = self.model_dump(exclude={"budget", "menu"}) | {"group_size": None}
        return [KMeansConfig.model_validate(base | layout) for layout in (self.menu or MENU)]


# ----------------------------------------------------------------------------- the stage

def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0 and d <= 64)


def group_size_of(cfg: KMeansConfig, out_features: int) -> int:
    return {"per_tensor": out_features, "per_channel": 1}.get(cfg.granularity, cfg.group_size)


def fisher_blocks(cfg: KMeansConfig, out_features: int) -> int:
    """Blocks of output channels ``objective: fisher`` weighs apart: the most, up to
    ``cfg.fisher_blocks``, that split the rows into equal runs of whole codebook groups (one
    codebook a matrix: of whole rows)."""
    units = out_features // group_size_of(cfg, out_features) if cfg.granularity == "grouped" else out_features
    return max(b for b in range(1, min(cfg.fisher_blocks, units) + 1) if units % b == 0)


def check_layer(name: str, out_features: int, in_features: int, cfg) -> None:
    """Refuse shapes the options cannot tile (before anything is modified)."""
    if in_features % cfg.cluster_dim:
        raise UsageError(f"{name}: cluster_dim={cfg.cluster_dim} does not divide its row length {in_features}",
                         f"use a cluster_dim dividing {in_features} (e.g. {_divisors(in_features)}) or ignore this layer")
    gs = group_size_of(cfg, out_features)
    if out_features % gs:
        raise UsageError(f"{name}: group_size={gs} does not divide its {out_features} output channels",
                         f"use a group_size dividing {out_features} (e.g. {_divisors(out_features)}) or ignore this layer")


def misfit(model: nn.Module, name: str, module: nn.Module, cfg: KMeansConfig) -> UsageError | None:
    """Why ``cfg``'s layout cannot palettize this target, or None."""
    try:
        check_layer(name, *reversed(dims_of(module)), cfg)
    except UsageError as err:
        return err
    if tied_to_embeddings(model, module) is not None and cfg.bits != 8 and dims_of(module)[0] // cfg.cluster_dim % 8:
        return UsageError(f"{name} is tied to the input embeddings, whose lookups decode whole rows: a row's "
                          f"{dims_of(module)[0] // cfg.cluster_dim} indices of {cfg.bits} bits do not fill whole bytes",
                          "use bits: 8, a cluster_dim leaving a multiple of 8 indices a row, or ignore it")
    return None


def layout_bytes(out_features: int, in_features: int, cfg: KMeansConfig) -> int:
    """Bytes a palettized (out, in) weight takes with ``cfg``'s layout, as saved
    (``PalettizedLinear.storage_bits``; without entropy coding)."""
    d, aside = cfg.cluster_dim, round(cfg.outliers * out_features * in_features)
    values = out_features // group_size_of(cfg, out_features) * 2 ** cfg.bits * d + aside + cfg.row_scale * out_features
    return packed_nbytes(out_features * in_features // d, cfg.bits) + values * getattr(torch, cfg.codebook_dtype).itemsize \
        + 4 * aside


def layer_report(name: str, weight: torch.Tensor, layer: PalettizedLinear) -> dict:
    """Reconstruction error, bits per weight and compression ratios of one palettized layer."""
    w = weight.detach().float()
    err = (layer.dense_weight().detach().float() - w)
    n, k = w.numel(), 2 ** layer.bits
    codebook_entries = layer.codebook.numel()
    idx = layer.index_matrix()
    codebook_of_row = (torch.arange(idx.shape[0], device=idx.device) // layer.group_size)[:, None]
    row = {"layer": name, "shape": list(w.shape), "mse": err.pow(2).mean().item(),
           "rel_error": (err.norm() / w.norm().clamp_min(1e-30)).item(),
           "clusters_used": (torch.bincount((idx + codebook_of_row * k).reshape(-1), minlength=layer.codebook.shape[0] * k) > 0)
                            .sum().item() / layer.codebook.shape[0],  # mean per codebook
           "bits_per_weight": layer.storage_bits() / n,
           # Deep Compression's formula with 32-bit weights and centroids, for any granularity
           "ratio_formula": 32 * n / (32 * codebook_entries + layer.num_indices * layer.bits)}
    if layer.stream_bytes is not None:
        counts = torch.bincount(idx.reshape(-1), minlength=k).cpu().numpy()
        row["entropy_bits"] = entropy(counts)
        row["huffman_bits"] = layer.huffman().bits / layer.num_indices
    return row


def palettize(module: nn.Module, cfg: KMeansConfig, gram: torch.Tensor | GramFactors | list[GramFactors] | None = None,
              weight: torch.Tensor | None = None) -> PalettizedLinear:
    """Cluster one linear's weight (or ``weight`` in its place, (out, in)) into a PalettizedLinear
    (on the weight's device); ``gram`` (its inputs' XᵀX, or it wrapped in ``GramFactors`` where
    several calls share its factorisation; a list: one for each of as many equal blocks of rows,
    ``objective: fisher``) enables the sensitivity weighting and error feedback the config asks
    for."""
    w = weight_of(module).detach() if weight is None else weight
    out, inp = w.shape
    gs, d = group_size_of(cfg, out), cfg.cluster_dim
    blocks = [] if gram is None else [GramFactors(g) if isinstance(g, torch.Tensor) else g
                                      for g in (gram if isinstance(gram, list) else [gram])]
    run = out // max(len(blocks), 1)  # rows a block
    # each weight's input energy, as its row's block sees it: (rows or 1, in)
    energy = torch.ones(1, inp, device=w.device)
    if blocks and cfg.sensitivity != "none":
        diagonals = [b.gram.diagonal().float().clamp_min(0).to(w.device)[None] for b in blocks]
        energy = diagonals[0] if len(blocks) == 1 else torch.cat([e.expand(run, -1) for e in diagonals])
    store = lambda t: t.to(getattr(torch, cfg.codebook_dtype)).to(w.dtype)  # noqa: E731  (rounded as saved)
    scale = None
    if cfg.row_scale:  # rounded as stored, so that clustering and feedback see the values the layer computes with
        rms = store(w.float().pow(2).mean(1).sqrt())
        scale = torch.where(rms > 0, rms, torch.ones_like(rms))  # an all-zero row: any codebook value times 0 is exact
    aside = torch.zeros(out, inp, dtype=torch.bool, device=w.device)
    count = round(cfg.outliers * w.numel())
    if count:  # the weights whose error would cost most: large and on energetic inputs
        aside.view(-1)[(w.float().abs() * energy.sqrt()).flatten().topk(count).indices] = True
    weights = (energy * ~aside).view(out, inp // d, d).mean(-1)  # an aside weight pulls no centroid
    norm = w
    if scale is not None:  # a row's error costs its scale squared once multiplied back
        norm, weights = w / scale[:, None], weights * scale.float().pow(2)[:, None]
    codebook, idx = cluster(norm.reshape(out // gs, gs * inp // d, d), cfg.bits, cfg.init, cfg.iterations, cfg.n_init,
                            cfg.seed, weights.reshape(out // gs, -1))
    codebook = store(codebook)  # feedback sees the stored values
    if cfg.error_feedback and blocks:  # rows are independent in GPTQ: scaling one scales its problem, and each
        parts = []                      # block of rows can have its own Gram matrix
        for k, factors in enumerate(blocks):
            a, b = k * run, (k + 1) * run
            book, size = (codebook, b - a) if codebook.shape[0] == 1 else (codebook[a // gs:b // gs], gs)
            parts.append(assign(norm[a:b], book, size, factors, aside[a:b] if count else None, cfg.damp))
        idx, values = torch.cat([i for i, _ in parts]), torch.cat([v for _, v in parts])
        values = values if scale is None else values * scale[:, None].expand(-1, inp)[aside]
    else:
        idx, values = idx.reshape(out, inp // d), w[aside]
    outliers = (aside.flatten().nonzero()[:, 0], values) if count else None
    return PalettizedLinear.from_clusters(codebook, idx, getattr(module, "bias", None), cfg.entropy_coding,
                                          isinstance(module, Conv1D), cfg.codebook_dtype, outliers, scale)


def summarize(rows: list[dict], bits: int | None) -> dict:
    """Totals over layers: weighted bits per weight, error, ratios, entropy (``bits``: the
    index bits of every layer, None where a budget chose them per layer)."""
    n = np.array([math.prod(r["shape"]) for r in rows], dtype=np.float64)
    mean = lambda key: float((np.array([r[key] for r in rows]) * n).sum() / n.sum())
    out = {"layers": len(rows), "weights": int(n.sum()), "bits": bits, "bits_per_weight": mean("bits_per_weight"),
           "ratio_formula": float(32 * n.sum() / (n / np.array([r["ratio_formula"] for r in rows]) * 32).sum()),
           "ratio_storage": 32 / mean("bits_per_weight"), "mse": mean("mse"),
           "max_rel_error": max(r["rel_error"] for r in rows)}
    if rows and "entropy_bits" in rows[0]:  # per index, averaged over all indices
        out["entropy_bits"], out["huffman_bits"] = mean("entropy_bits"), mean("huffman_bits")
    return out


class _Palettize:
    """A stage of ``pipeline.refit.fit_pass`` (``refit``): the modules reading one input, palettized
    once the pass has summed G = X'ᵀX' of what the compressed model feeds them (and, where the
    target reads another input X, H = XᵀX'). Each is clustered, with G as its statistics, for
    the weight that best reproduces its target on those inputs, W̃ = argmin ‖X'·W̃ᵀ − X·Wᵀ‖²
    + λ‖W̃ − W‖² = (W·H + λ·W)(G + λ·I)⁻¹: o then makes up for q/k/v's error, down for the
    attention's and gate/up's; W itself where the target reads X' too (the layer's first
    modules). With ``fisher`` (name -> (tokens, blocks), ``calibration.output_fisher``) each
    module's blocks of rows are clustered on G weighted token by token by the end loss's
    squared gradients on that block's outputs instead."""

    def __init__(self, modules: dict[str, nn.Module], weights: dict[str, torch.Tensor], same: bool, _dtype: torch.dtype,
                 cfg: KMeansConfig, layouts: Mapping[str, KMeansConfig], rows: list[dict],
                 fisher: Mapping[str, torch.Tensor]):
        self.modules, self.weights, self.cfg, self.layouts, self.rows = modules, weights, cfg, layouts, rows
        self.sums = Sums(same)
        self.fisher = {n: fisher[n] for n in modules if n in fisher}
        self.weighted: dict[str, list[torch.Tensor | None]] = {n: [None] * f.shape[1] for n, f in self.fisher.items()}
        self.seen = 0  # tokens summed so far: the batches come in calibration order

    def add(self, x: torch.Tensor, x_ref: torch.Tensor | None) -> None:
        self.sums.add(x, x_ref)
        for name, f in self.fisher.items():
            part = f[self.seen:self.seen + len(x)].to(x.device, x.dtype).sqrt()
            for k, acc in enumerate(self.weighted[name]):
                self.weighted[name][k] = add_gram(acc, x * part[:, k:k + 1])
        self.seen += len(x)

    def finish(self) -> tuple[dict[str, nn.Module], dict[str, torch.Tensor]]:
        gram, cross = self.sums.gram(), self.sums.cross
        grams, new = GramFactors(gram), {}  # q/k/v (gate/up) read one input: factorised once
        for name, module in self.modules.items():
            w = self.weights[name]
            best = w if cross is None else \
                solve_coefficients(gram, w.double() @ cross.to(w.device), self.cfg.ridge, w).to(w.dtype)
            stats = [GramFactors(symmetrize(g)) for g in self.weighted[name]] if name in self.fisher else grams
            new[name] = palettize(module, self.layouts[name], stats, best)
            self.rows.append(layer_report(name, w, new[name]))
        return new, {}


def beside(model: nn.Module, names: list[str]) -> int:
    """Bytes the layers holding the targets store for them beside their weights (a rotation's
    signs: the holder's ``UNCOUNTED`` tensors), which a budget counts with the targets' own:
    everything a weight costs is within the budget's bits."""
    total = 0
    for name in names:
        holder = model.get_submodule(name.rpartition(".")[0])
        total += sum(getattr(holder, t).numel() * getattr(holder, t).element_size() for t in getattr(holder, "UNCOUNTED", ()))
    return total


def every_use(model: nn.Module, layers: dict[str, nn.Module]) -> list[str]:
    """Every name under which the decoder layers reach a target (calibration covers them): a
    module used by several layers is clustered on all its uses."""
    chosen, inside = {id(m) for m in layers.values()}, discover(model).layers_path + "."
    return [n for n, m in model.named_modules(remove_duplicate=False) if n.startswith(inside) and id(m) in chosen]


def choose_layouts(model: nn.Module, cfg: KMeansConfig, layers: dict[str, nn.Module],
                   by_layer: dict[int | None, list[str]], ctx) -> tuple[dict[str, KMeansConfig], dict]:
    """Under ``cfg.budget``: the least total estimated cost within the budget
    (``knapsack.choose``) over ``measure``'s table, which is kept (``cache_dir()/budget``, keyed
    by what keys the calibration statistics, the stage's clustering options and the menu), so a
    sweep over budgets measures once. Returns name -> its layout, and the report of the choice."""
    menu, names = cfg.layouts(), [n for group in by_layer.values() for n in group]
    options = cfg.model_dump(exclude={"budget", "menu", "refit", "refit_target", "refit_samples", "ridge", "objective",
                                      "fisher_blocks"})  # the refit pass's own: the measurement does not read them
    key = json.dumps({"statistics": ctx.stats_meta(model), "stage": options, "names": names, "every": MEASURE_EVERY,
                      "menu": [layout.model_dump() for layout in menu]}, sort_keys=True, default=str)
    kept = cache_dir() / "budget" / f"{hashlib.sha256(key.encode()).hexdigest()[:20]}.npz"
    start = time.perf_counter()
    if kept.is_file():
        with np.load(kept, allow_pickle=False) as table:
            costs, sizes = table["costs"], table["sizes"]
    else:
        costs, sizes = measure(model, cfg, menu, layers, by_layer, ctx)
        kept.parent.mkdir(parents=True, exist_ok=True)
        partial = kept.with_suffix(".tmp.npz")
        np.savez(partial, costs=costs, sizes=sizes)
        partial.replace(kept)
    measured = time.perf_counter() - start
    weights = sum(weight_of(layers[n]).numel() for n in names)
    around = beside(model, names)
    budget = cfg.budget.bytes_for(weights) - around
    picks = knapsack.choose(costs, sizes, budget)
    used = int(sum(sizes[k, j] for k, j in enumerate(picks)))
    report = {"bytes": budget + around, "used_bytes": used + around, "beside_bytes": around,
              "bits_per_weight": 8 * (used + around) / weights,
              "estimated_cost": float(sum(costs[k, j] for k, j in enumerate(picks))),
              "menu": [{k: v for k, v in layout.model_dump().items() if k in LAYOUT_KEYS} for layout in menu],
              "choices": {n: picks[k] for k, n in enumerate(names)}, "measurements": str(kept),
              "measure_seconds": round(measured, 2), "solve_seconds": round(time.perf_counter() - start - measured, 2)}
    return {n: menu[picks[k]] for k, n in enumerate(names)}, report


def measured_rows(out_features: int, layouts: list[KMeansConfig]) -> torch.Tensor | None:
    """The rows a budget's measurement palettizes: every ``MEASURE_EVERY``-th block of rows, a
    block being whole codebook groups of every layout (the least common multiple of their group
    sizes), where a matrix has at least 2 x ``MEASURE_EVERY`` blocks; None (all of them) on
    smaller matrices, where a block or two would stand for too few rows (on SmolLM2 the sampled
    cost stays within 15 % of the whole matrix's on 9-24 blocks and a rank correlation of 0.99,
    docs/budget.md). The error is a sum over rows, so the sample's, scaled up, estimates it."""
    unit = math.lcm(*(group_size_of(cfg, out_features) for cfg in layouts if cfg.granularity != "per_tensor"))
    blocks = out_features // unit
    if blocks < 2 * MEASURE_EVERY:
        return None
    return (torch.arange(0, blocks, MEASURE_EVERY)[:, None] * unit + torch.arange(unit)).reshape(-1)


def measure(model: nn.Module, cfg: KMeansConfig, menu: list[KMeansConfig], layers: dict[str, nn.Module],
            by_layer: dict[int | None, list[str]], ctx) -> tuple[np.ndarray, np.ndarray]:
    """(costs, bytes), (matrices, layouts): every target palettized with every layout of the
    menu that tiles it (the others cost infinity) on the calibration statistics, one layer group
    at a time; a result's cost is ½ · output sensitivity · tr(ΔW·G·ΔWᵀ) (module docstring),
    measured on ``measured_rows`` and scaled to the matrix; its bytes are ``layout_bytes``."""
    every = every_use(model, layers)
    stats = ctx.stats(model, every, cfg.sensitivity_samples) if every else None
    grams: SharedGrams | dict = SharedGrams(model, every, stats) if every else {}
    names = [n for group in by_layer.values() for n in group]
    costs, sizes = np.full((len(names), len(menu)), np.inf), np.zeros((len(names), len(menu)), dtype=np.int64)
    shared: dict[tuple[str, ...], GramFactors] = {}  # one per input (q/k/v read one), factorised once for all layouts
    for row, name in enumerate(onloaded(model, names, f"kmeans budget: {len(menu)} layouts a matrix")):
        w = weight_of(layers[name]).detach()
        key = tuple(grams.parts[name]) if name in grams else None
        if key is not None and key not in shared:
            shared = {key: GramFactors(grams[name].to(w.device).double())}  # the last input's only: q/k/v come together
        factors = shared.get(key)
        sensitivity = stats.sensitivity.get(name, 1.0) if stats is not None else 1.0
        fitting = [j for j, layout in enumerate(menu) if not misfit(model, name, layers[name], layout)]
        rows = measured_rows(w.shape[0], [menu[j] for j in fitting])
        sample = w if rows is None else w[rows.to(w.device)]
        for j in fitting:  # a layout that does not tile this matrix costs infinity: never chosen
            # a bias-less stand-in for the module: the sample's rows are not the module's
            palettized = palettize(nn.Module(), menu[j], factors, sample)
            delta = (palettized.dense_weight().detach() - sample).double()
            error = (delta @ factors.gram * delta).sum() if factors is not None else delta.pow(2).sum()
            costs[row, j] = 0.5 * sensitivity * error.item() * w.shape[0] / sample.shape[0]
            sizes[row, j] = layout_bytes(*w.shape, menu[j])
    return costs, sizes


@register(KMeansConfig)
def apply(model: nn.Module, cfg: KMeansConfig, ctx) -> dict:
    """Palettize every target linear, one decoder layer at a time (under a budget, each with the
    layout ``choose_layouts`` gave it); returns totals and one row per layer."""
    arch = discover(model)
    layers = target_layers(model, cfg)
    by_layer: dict[int | None, list[str]] = {}
    for name in layers:  # a module shared by several layers: under the first (see target_layers)
        by_layer.setdefault(arch.layer_of(name), []).append(name)
    layouts, budget = (choose_layouts(model, cfg, layers, by_layer, ctx) if cfg.budget is not None
                       else ({n: cfg for n in layers}, None))
    grams: Mapping[str, torch.Tensor] = {}
    start = time.perf_counter()
    rows: list[dict] = []
    label = f"kmeans {'budget' if budget else f'{cfg.bits}-bit'}"
    if cfg.refit and set(by_layer) - {None}:  # the decoder layers' modules, in one pass over the calibration data
        batches = first_samples(ctx.calibration(), cfg.refit_samples)
        inside = [n for i, names in by_layer.items() if i is not None for n in names]
        fisher = output_fisher(model, {n: fisher_blocks(layouts[n], weight_of(layers[n]).shape[0]) for n in inside},
                               batches, ctx.dtype(model)) if cfg.objective == "fisher" else {}
        fit_pass(model, arch, batches, lambda i: {n: layers[n] for n in by_layer.get(i, [])},
                 lambda *args: _Palettize(*args, cfg=cfg, layouts=layouts, rows=rows, fisher=fisher), cfg.refit_target,
                 ctx.dtype(model), label=f"{label}: decoder layers clustered and refit")
        by_layer = {None: by_layer[None]} if None in by_layer else {}
    elif cfg.needs_statistics and (every := every_use(model, layers)):
        grams = SharedGrams(model, every, ctx.stats(model, every))

    def make(name: str, module: nn.Module) -> PalettizedLinear:
        layer = palettize(module, layouts[name], grams.get(name))
        rows.append(layer_report(name, weight_of(module), layer))
        return layer

    replace_each(model, {n: layers[n] for names in by_layer.values() for n in names}, make, f"{label}: matrices")
    without = [n for i, names in by_layer.items() for n in names if cfg.needs_statistics and n not in grams]
    return {**summarize(rows, cfg.bits if budget is None else None), "cluster_seconds": round(time.perf_counter() - start, 2),
            "sensitivity": cfg.sensitivity, "error_feedback": cfg.error_feedback, "outliers": cfg.outliers,
            "refit": cfg.refit, "without_statistics": without, **({"budget": budget} if budget else {}), "per_layer": rows}
