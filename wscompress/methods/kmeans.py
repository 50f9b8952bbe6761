"""Weight clustering (palettization, as in Deep Compression): every weight, or every d-long
sub-vector of a row, is replaced by the nearest of K = 2^bits centroids; a layer stores
bit-packed indices plus the codebook (optionally Huffman-coded on disk).

Scalar clustering is 1-D k-means. It runs on sorted values with prefix sums, so one Lloyd
iteration costs O(K log m) (binary-search the cluster boundaries, read the cluster sums off
the prefix sums) instead of O(m K). Per-tensor clustering first folds the weights into a
histogram in O(n) (bins of float16 resolution, each keeping the exact mean of its weights) and
runs its k-means++ restarts side by side on it, so a whole matrix clusters in milliseconds;
per-channel and grouped clustering run all codebooks of a matrix as one batch. Vector
clustering (``cluster_dim`` > 1) is batched Lloyd with the distance matrix computed in
bounded chunks, refit on the exact points at the end.

A group with fewer distinct values than K gets fewer distinct centroids: every distinct value
becomes a centroid (zero error) and the unused codebook entries repeat used ones.
"""

from __future__ import annotations

import math
import re
import time
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field, model_validator
from torch import nn

from .. import ui
from ..arch import LINEAR_TYPES, Conv1D, discover, distinct, match_modules, replace_everywhere, weight_of
from ..errors import UsageError
from ..modules import CompressedLinear, register_module
from ..packing import (
    BLOCK,
    HuffmanStream,
    entropy,
    huffman_decode,
    huffman_encode,
    pack,
    packed_nbytes,
    unpack,
)
from ..recipe import StageConfig
from . import register

Init = Literal["kmeans++", "linear", "density"]
CHUNK_ELEMENTS = 1 << 22
SHIFT = 13  # float32 histogram: drop 13 low mantissa bits -> 2^19 bins as fine as float16's  # distance-matrix entries computed at once by vector clustering


class KMeansConfig(StageConfig):
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
    seed: int = 0

    @model_validator(mode="after")
    def _group_size(self) -> KMeansConfig:
        if (self.granularity == "grouped") != (self.group_size is not None):
            raise ValueError("group_size is required with granularity: grouped and only allowed with it")
        return self


# ----------------------------------------------------------------------------- clustering

def _sample(p: torch.Tensor, gen: torch.Generator, count: int = 1) -> torch.Tensor:
    """``count`` indices per row of p (B, m), drawn with probability proportional to p
    (inverse CDF; a row of zeros picks its last point)."""
    cdf = p.cumsum(1)
    u = torch.rand(p.shape[0], count, generator=gen, device=p.device, dtype=cdf.dtype) * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True).clamp_max(p.shape[1] - 1)


def _kmeans_pp(points: torch.Tensor, weights: torch.Tensor, k: int, gen: torch.Generator, trials: int = 1) -> torch.Tensor:
    """k-means++ seeding, batched: points (B, m, d), weights (B, m) -> centroids (B, k, d).

    With ``trials`` > 1 each step draws that many candidates and keeps the one that lowers
    the potential most (greedy k-means++, as scikit-learn does). A group whose points are all
    centroids already draws duplicates (never NaN).
    """
    b = torch.arange(points.shape[0], device=points.device)
    centroids = [points[b, _sample(weights, gen)[:, 0]]]
    d2 = ((points - centroids[0][:, None]) ** 2).sum(-1)
    for _ in range(1, k):
        cand = points[b[:, None], _sample(d2 * weights, gen, trials)]  # (B, trials, d)
        new = torch.minimum(d2[:, None], ((points[:, None] - cand[:, :, None]) ** 2).sum(-1))  # (B, trials, m)
        best = (new * weights[:, None]).sum(-1).argmin(1)
        centroids.append(cand[b, best])
        d2 = new[b, best]
    return torch.stack(centroids, 1)


def _init(points: torch.Tensor, weights: torch.Tensor, k: int, init: Init, gen: torch.Generator,
          trials: int = 1) -> torch.Tensor:
    """Initial centroids (B, k, d). linear: evenly spaced between the per-coordinate min and
    max; density: per-coordinate weighted quantiles (equal mass per centroid)."""
    if init == "kmeans++":
        return _kmeans_pp(points, weights, k, gen, trials)
    if init == "linear":
        lo, hi = points.amin(1), points.amax(1)
        t = torch.linspace(0, 1, k, device=points.device, dtype=points.dtype)
        return lo[:, None] + t[None, :, None] * (hi - lo)[:, None]
    sorted_pts, order = points.sort(1)
    cdf = torch.gather(weights[..., None].expand_as(points), 1, order).cumsum(1)
    q = (torch.arange(k, device=points.device, dtype=cdf.dtype)[None, :, None] + 0.5) / k * cdf[:, -1:]
    pos = torch.searchsorted(cdf.transpose(1, 2).contiguous(), q.transpose(1, 2).contiguous())
    return torch.gather(sorted_pts, 1, pos.clamp_max(points.shape[1] - 1).transpose(1, 2))


def _lloyd_1d(x: torch.Tensor, w: torch.Tensor, c: torch.Tensor, iterations: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Weighted Lloyd on sorted values x (B, m) from centroids c (B, k).

    Returns (sorted centroids, weighted SSE per group). Each iteration finds the cluster
    boundaries by binary search and the cluster sums from prefix sums (float64), so it
    costs O(k log m), not O(k m). Stops when no centroid moves by 1e-7 of the value range.
    """
    zero = torch.zeros(x.shape[0], 1, dtype=torch.float64, device=x.device)
    xd, wd = x.double().contiguous(), w.double()
    cw, cs, cq = (torch.cat([zero, t.cumsum(1)], 1) for t in (wd, wd * xd, wd * xd * xd))
    edge = torch.full_like(zero, x.shape[1], dtype=torch.long)

    def segments(c: torch.Tensor, *tables: torch.Tensor) -> list[torch.Tensor]:  # per-cluster sums
        mids = ((c[:, 1:] + c[:, :-1]) / 2).contiguous()
        bounds = torch.cat([torch.zeros_like(edge), torch.searchsorted(xd, mids), edge], 1)
        lo, hi = bounds[:, :-1], bounds[:, 1:]
        return [t.gather(1, hi) - t.gather(1, lo) for t in tables]

    c = c.double().sort(1).values
    tol = 1e-7 * (xd[:, -1] - xd[:, 0]).max()
    for _ in range(iterations):
        sw, ss = segments(c, cw, cs)
        new = torch.where(sw > 0, ss / sw.clamp_min(1e-300), c).sort(1).values  # empty cluster: keep
        moved = (new - c).abs().max()
        c = new
        if moved <= tol:
            break
    sw, ss, sq = segments(c, cw, cs, cq)
    sse = (sq - 2 * c * ss + c * c * sw).sum(1)
    return c.to(x.dtype), sse


def _nearest(points: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """Index of the nearest centroid for points (B, m, d), centroids (B, k, d), in chunks."""
    b = points.shape[0]
    step = max(1, CHUNK_ELEMENTS // (b * centroids.shape[1]))
    c2 = (centroids ** 2).sum(-1)[:, None]
    out = []
    for p in points.split(step, 1):
        out.append(torch.baddbmm(c2, p, centroids.transpose(1, 2), alpha=-2).argmin(-1))
    return torch.cat(out, 1)


def _lloyd_nd(points: torch.Tensor, c: torch.Tensor, iterations: int) -> torch.Tensor:
    """Lloyd for vectors, batched over groups, chunked over points. Each iteration costs
    O(m K d), so it stops once fewer than 1 in 10 000 points change cluster."""
    prev = None
    for _ in range(iterations):
        assign = _nearest(points, c)
        if prev is not None and (assign != prev).sum() * 10_000 < assign.numel():
            break
        c = centroid_means(points, assign, c)
        prev = assign
    return c


def centroid_means(points: torch.Tensor, assign: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """Centroids = means of their assigned points (an empty cluster keeps its centroid)."""
    sums = torch.zeros_like(c, dtype=torch.float64).scatter_add_(1, assign[..., None].expand_as(points), points.double())
    counts = torch.zeros(c.shape[:2], dtype=torch.float64, device=c.device).scatter_add_(
        1, assign, torch.ones_like(assign, dtype=torch.float64))
    return torch.where(counts[..., None] > 0, sums / counts.clamp_min(1)[..., None], c.double()).to(c.dtype)


def _histogram(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Fold values (n,) into bins: (bin means, counts), sorted by value, in O(n) (no sort).

    The bin is the value's bit pattern made monotone (negatives' magnitude bits flipped):
    exact for 16-bit floats (65 536 bins), the top 19 bits for float32 (bins of relative width
    2^-10). Each bin keeps the exact mean of its values, so Lloyd on the bins only differs
    from Lloyd on every weight where a cluster boundary cuts through a bin.
    """
    if values.element_size() == 2:
        bits = values.view(torch.int16).to(torch.int32)
        key = torch.where(bits < 0, bits ^ 0x7FFF, bits) + (1 << 15)
        size = 1 << 16
    else:
        bits = values.float().view(torch.int32)
        key = (torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits) >> SHIFT) + (1 << (31 - SHIFT))
        size = 1 << (32 - SHIFT)
    counts = torch.bincount(key, minlength=size)
    sums = torch.bincount(key, weights=values.double(), minlength=size)
    used = counts > 0
    return (sums[used] / counts[used]).float(), counts[used].float()


def _best(candidates: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Per group, the centroids of the restart with the lowest error."""
    cs = torch.stack([c for c, _ in candidates])
    pick = torch.stack([e for _, e in candidates]).argmin(0)
    return cs[pick, torch.arange(cs.shape[1], device=cs.device)]


def cluster(groups: torch.Tensor, bits: int, init: Init = "kmeans++", iterations: int = 300,
            n_init: int | None = None, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """k-means of each group of d-long points: groups (B, m, d) -> (codebooks (B, K, d),
    indices (B, m)), on the groups' device; the best of ``n_init`` restarts (default 3 for
    one scalar group, where restarts are cheap, else 1).

    Scalars: per tensor on the histogram (whose bins keep exact means), per channel or group
    on the sorted values of all groups at once.
    """
    b, m, d = groups.shape
    k = 2 ** bits
    n_init = n_init or (3 if b == d == 1 else 1)
    gen = torch.Generator(device=groups.device).manual_seed(seed)
    if d == 1:
        if b == 1:  # restarts run side by side as a batch on the histogram
            x, w = (t[None].expand(n_init, -1) for t in _histogram(groups.reshape(-1)))
            greedy = 2 + int(math.log(k))  # cheap on the histogram
            runs, sse = _lloyd_1d(x, w, _init(x[..., None], w, k, init, gen, greedy)[..., 0], iterations)
            c = runs[sse.argmin()][None]
        else:
            x = groups[..., 0].float().sort(1).values
            w = torch.ones_like(x)
            c = _best([_lloyd_1d(x, w, _init(x[..., None], w, k, init, gen)[..., 0], iterations) for _ in range(n_init)])
        c = c.to(groups.dtype)[..., None]
        return c, nearest(groups, c)
    groups = groups.float()
    ones = torch.ones(b, m, dtype=groups.dtype, device=groups.device)
    runs = []
    for _ in range(n_init):
        c = _lloyd_nd(groups, _init(groups, ones, k, init, gen), iterations)
        c = centroid_means(groups, _nearest(groups, c), c)
        assign = _nearest(groups, c)
        runs.append((c, ((groups - torch.gather(c, 1, assign[..., None].expand(-1, -1, d))) ** 2).sum((1, 2))))
    c = _best(runs)
    return c, nearest(groups, c)


def nearest(points: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """Index of the nearest centroid, (B, m, d), (B, K, d) -> (B, m); scalars by binary
    search between the sorted centroids (O(log K) per point)."""
    if points.shape[-1] > 1:
        return _nearest(points, centroids)
    c, order = centroids[..., 0].sort(1)
    mids = ((c[:, 1:] + c[:, :-1]) / 2).contiguous()
    return order.gather(1, torch.searchsorted(mids, points[..., 0].contiguous()))


# ----------------------------------------------------------------------------- the layer

def dequantize(codebook: torch.Tensor, indices: torch.Tensor, group_size: int) -> torch.Tensor:
    """Weight (out, cols * d) from codebooks (groups, K, d) and indices (out, cols): row r
    reads codebook r // group_size (differentiable in the codebook)."""
    _, k, d = codebook.shape
    offset = (torch.arange(indices.shape[0], device=indices.device) // group_size * k)[:, None]
    return codebook.reshape(-1, d)[indices + offset].reshape(indices.shape[0], -1)


@register_module
class PalettizedLinear(CompressedLinear):
    """A linear layer stored as packed cluster indices + codebook(s).

    Memory holds ``indices`` (``bits`` bits per index, bit-packed uint8) and ``codebook``
    (groups, K, cluster_dim): output channels ``g*group_size ... (g+1)*group_size - 1`` use
    codebook g, and index (r, j) picks the centroid for weights W[r, j*d : (j+1)*d]. The dense
    weight is materialised on each forward. With ``stream_bytes`` set, the file stores the
    indices Huffman-coded instead (``huffman_*`` buffers) and loading decodes them.
    """

    def __init__(self, in_features: int, out_features: int, bits: int, group_size: int | None = None,
                 cluster_dim: int = 1, bias: bool = False, stream_bytes: int | None = None, conv1d: bool = False):
        super().__init__()
        self.in_features, self.out_features, self.bits, self.conv1d = in_features, out_features, bits, conv1d
        self.group_size = group_size or out_features
        self.cluster_dim, self.stream_bytes = cluster_dim, stream_bytes
        k, n = 2 ** bits, self.num_indices
        self.codebook = nn.Parameter(torch.empty(out_features // self.group_size, k, cluster_dim))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.register_buffer("indices", torch.empty(packed_nbytes(n, bits), dtype=torch.uint8),
                             persistent=stream_bytes is None)
        if stream_bytes is not None:
            self.register_buffer("huffman_stream", torch.empty(stream_bytes, dtype=torch.uint8))
            self.register_buffer("huffman_lengths", torch.empty(k, dtype=torch.uint8))
            self.register_buffer("huffman_blocks", torch.empty(math.ceil(n / BLOCK), dtype=torch.int32))

    @property
    def num_indices(self) -> int:
        return self.out_features * self.in_features // self.cluster_dim

    @classmethod
    def from_clusters(cls, codebook: torch.Tensor, indices: torch.Tensor, bias: torch.Tensor | None,
                      entropy_coding: bool = False, conv1d: bool = False) -> PalettizedLinear:
        """Build from codebook (groups, K, d) and indices (out, in / d)."""
        groups, k, d = codebook.shape
        out, cols = indices.shape
        stream = huffman_encode(indices.cpu().numpy(), k) if entropy_coding else None
        layer = cls(cols * d, out, int(math.log2(k)), out // groups, d, bias is not None,
                    None if stream is None else len(stream.data), conv1d)
        layer.codebook = nn.Parameter(codebook.detach().clone())
        layer.indices = pack(indices, layer.bits)
        if bias is not None:
            layer.bias = nn.Parameter(bias.detach().clone())
        if stream is not None:
            layer.huffman_stream = torch.from_numpy(stream.data).to(codebook.device)
            layer.huffman_lengths = torch.from_numpy(stream.lengths).to(codebook.device)
            layer.huffman_blocks = torch.from_numpy(stream.block_bits).to(codebook.device)
        return layer

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        if self.stream_bytes is not None and prefix + "huffman_stream" in state_dict:
            self.indices = pack(torch.from_numpy(huffman_decode(self.huffman())), self.bits).to(self.codebook.device)

    def huffman(self) -> HuffmanStream:
        return HuffmanStream(self.huffman_stream.cpu().numpy(), self.huffman_lengths.cpu().numpy(),
                             self.huffman_blocks.cpu().numpy(), self.num_indices)

    def index_matrix(self) -> torch.Tensor:
        """Cluster indices as an (out, in / cluster_dim) int64 tensor."""
        return unpack(self.indices, self.bits, self.num_indices).view(self.out_features, -1)

    def dense_weight(self) -> torch.Tensor:
        return dequantize(self.codebook, self.index_matrix(), self.group_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dense_weight().to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))

    def trainable_parameters(self) -> list[nn.Parameter]:
        """Fine-tuning a palettized layer trains its centroids (Deep Compression)."""
        return [self.codebook]

    def storage_bits(self) -> int:
        """Bits this layer's indices and codebook take on disk (what ``save`` writes)."""
        index_bytes = (self.huffman_stream.numel() + self.huffman_lengths.numel() + 4 * self.huffman_blocks.numel()
                       if self.stream_bytes is not None else self.indices.numel())
        return 8 * (index_bytes + self.codebook.numel() * self.codebook.element_size())

    def spec(self) -> dict:
        return {"in_features": self.in_features, "out_features": self.out_features, "bits": self.bits,
                "group_size": self.group_size, "cluster_dim": self.cluster_dim, "bias": self.bias is not None,
                "stream_bytes": self.stream_bytes, "conv1d": self.conv1d}


# ----------------------------------------------------------------------------- the stage

def default_targets(model: nn.Module) -> list[str]:
    """Every linear inside the decoder layers (embeddings and lm_head only when targeted)."""
    return [rf"^{re.escape(discover(model).layers_path)}\."]


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0 and d <= 64)


def group_size_of(cfg: KMeansConfig, out_features: int) -> int:
    return {"per_tensor": out_features, "per_channel": 1}.get(cfg.granularity, cfg.group_size)


def check_layer(name: str, out_features: int, in_features: int, cfg) -> None:
    """Refuse shapes the options cannot tile (before anything is modified)."""
    if in_features % cfg.cluster_dim:
        raise UsageError(f"{name}: cluster_dim={cfg.cluster_dim} does not divide its row length {in_features}",
                         f"use a cluster_dim dividing {in_features} (e.g. {_divisors(in_features)}) or ignore this layer")
    gs = group_size_of(cfg, out_features)
    if out_features % gs:
        raise UsageError(f"{name}: group_size={gs} does not divide its {out_features} output channels",
                         f"use a group_size dividing {out_features} (e.g. {_divisors(out_features)}) or ignore this layer")


def target_layers(model: nn.Module, cfg: StageConfig) -> dict[str, nn.Module]:
    """Matched dense linears, refusing an lm_head tied to the input embeddings."""
    layers = match_modules(model, cfg.targets or default_targets(model), cfg.ignore, kind=LINEAR_TYPES)
    layers = {n: layers[n] for n in distinct(model, list(layers))}  # a module shared by layers: once
    emb = model.get_input_embeddings()
    for name, module in layers.items():
        if emb is not None and module.weight is emb.weight:
            raise UsageError(f"{name} shares its weight with the input embeddings (tied)",
                             f"add {name!r} to ignore: palettizing one side of a tied pair would store the matrix twice")
    return layers


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


def palettize(module: nn.Module, cfg: KMeansConfig) -> PalettizedLinear:
    """Cluster one linear's weight into a PalettizedLinear (on the weight's device)."""
    w = weight_of(module).detach()
    out, inp = w.shape
    gs, d = group_size_of(cfg, out), cfg.cluster_dim
    codebook, assign = cluster(w.reshape(out // gs, gs * inp // d, d), cfg.bits, cfg.init, cfg.iterations, cfg.n_init, cfg.seed)
    return PalettizedLinear.from_clusters(codebook.to(w.dtype), assign.reshape(out, inp // d),
                                          getattr(module, "bias", None), cfg.entropy_coding, isinstance(module, Conv1D))


def summarize(rows: list[dict], bits: int) -> dict:
    """Totals over layers: weighted bits per weight, error, ratios, entropy."""
    n = np.array([math.prod(r["shape"]) for r in rows], dtype=np.float64)
    mean = lambda key: float((np.array([r[key] for r in rows]) * n).sum() / n.sum())
    out = {"layers": len(rows), "weights": int(n.sum()), "bits": bits, "bits_per_weight": mean("bits_per_weight"),
           "ratio_formula": float(32 * n.sum() / (n / np.array([r["ratio_formula"] for r in rows]) * 32).sum()),
           "ratio_storage": 32 / mean("bits_per_weight"), "mse": mean("mse"),
           "max_rel_error": max(r["rel_error"] for r in rows)}
    if rows and "entropy_bits" in rows[0]:  # per index, averaged over all indices
        out["entropy_bits"], out["huffman_bits"] = mean("entropy_bits"), mean("huffman_bits")
    return out


@register(KMeansConfig)
def apply(model: nn.Module, cfg: KMeansConfig, ctx) -> dict:
    """Palettize every target linear; returns totals and one row per layer."""
    layers = target_layers(model, cfg)
    for name, module in layers.items():
        check_layer(name, *weight_of(module).shape, cfg)
    start = time.perf_counter()
    rows = []
    for name, module in ui.track(list(layers.items()), f"kmeans {cfg.bits}-bit"):
        layer = palettize(module, cfg)
        rows.append(layer_report(name, weight_of(module), layer))
        replace_everywhere(model, module, layer)
    return {**summarize(rows, cfg.bits), "cluster_seconds": round(time.perf_counter() - start, 2), "per_layer": rows}
