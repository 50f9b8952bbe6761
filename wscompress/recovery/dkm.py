"""Differentiable k-means (DKM, Cho et al., ICLR 2022), the ``dkm`` mode of ``finetune``.

Each target linear trains its dense weight W through a soft clustering: with attention
A = softmax(-||w - c||^2 / tau) of every weight (or d-long sub-vector) w over the centroids c,
the centroids are iterated (c = A^T W / sum A) until they move less than ``tolerance`` (times
the centroid spacing) or ``iterations`` times, and the layer computes with the soft weights A c,
so gradients reach W through the attention and the centroid updates. As in the paper, each
forward pass starts from the centroids the previous one converged to (a buffer, not a trained
parameter). At the end ``finalize`` snaps every weight to its nearest converged centroid, takes
one hard Lloyd step (centroids = means of their weights, then nearest again) and swaps in
``PalettizedLinear`` layers: the same format the ``kmeans`` stage writes.

The attention map has one row per weight and K columns: more than the model itself. It is
computed in chunks of at most ``chunk_size`` entries, each under ``torch.utils.checkpoint``,
so only one chunk's attention exists at a time (it is recomputed in the backward pass); the
memory above plain fine-tuning is about one soft weight matrix per layer, not n x K. (On CPU,
glibc keeps freed multi-MB chunks on its heap unless MALLOC_MMAP_THRESHOLD_ is set, e.g. to
65536; then the resident memory follows what is actually live.)

``temperature`` is relative to the codebook: tau = temperature x the mean squared distance
between neighbouring centroids at the start, so the same value suits any weight scale (at
0.1 a weight sitting on a centroid gives its neighbour e^-10 of the attention).
In eval mode the layers already compute with the hard-snapped weights, so evaluations during
and after training measure the model that ``finalize`` produces.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from pydantic import ValidationError
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..errors import UsageError
from ..io import ui
from ..maths.clustering import centroid_means, cluster, nearest
from ..methods.kmeans import KMeansConfig, check_layer, group_size_of, layer_report, summarize
from ..model.arch import target_layers
from ..model.arch import Conv1D, is_dense_linear, replace_everywhere, weight_of
from ..model.forms.wscompress_palettized import PalettizedLinear, dequantize
from ..recipe.schema import DKMConfig, error_lines, known_keys


def kmeans_stage(opts: DKMConfig) -> KMeansConfig:
    """The ``kmeans`` stage the DKM options amount to (its initial clustering, checks and final
    format); options that make no valid stage are a usage error."""
    try:
        return KMeansConfig(**opts.model_dump(include={"bits", "granularity", "group_size", "cluster_dim", "init",
                                                       "entropy_coding", "codebook_dtype", "targets", "ignore", "seed"}),
                            sensitivity="none", error_feedback=False, refit=False, outliers=0)
    except ValidationError as err:
        raise UsageError(error_lines(err, "finetune", "dkm"), f"keys of finetune.dkm: {known_keys(DKMConfig)}") from None


def _attention(points: torch.Tensor, centroids: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
    """softmax(-||p - c||^2 / tau) over centroids: (G, m, d), (G, K, d), (G, 1, 1) -> (G, m, K)."""
    d2 = (points ** 2).sum(-1, keepdim=True) - 2 * points @ centroids.transpose(1, 2) + (centroids ** 2).sum(-1)[:, None]
    return torch.softmax(-d2 / tau, -1)


def _sums(points: torch.Tensor, centroids: torch.Tensor, tau: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    a = _attention(points, centroids, tau)
    return a.transpose(1, 2) @ points, a.sum(1)


def _soft(points: torch.Tensor, centroids: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
    return _attention(points, centroids, tau) @ centroids


class DKMLinear(nn.Module):
    """A linear trained through differentiable k-means (see the module docstring)."""

    def __init__(self, weight: nn.Parameter, bias: torch.Tensor | None, codebook: torch.Tensor, group_size: int,
                 opts: DKMConfig, conv1d: bool = False):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight, self.bias, self.conv1d = weight, bias, conv1d
        self.register_buffer("centroids", codebook.detach().clone())  # the last converged centroids: the warm start
        self.group_size, self.opts = group_size, opts
        d2 = torch.cdist(codebook.float(), codebook.float()) ** 2
        d2 = torch.where(d2 > 0, d2, torch.inf).amin(-1)  # each centroid to its nearest distinct one
        finite = torch.isfinite(d2)
        spacing = torch.where(finite, d2, 0).sum(-1) / finite.sum(-1).clamp_min(1)
        spacing = torch.where(spacing > 0, spacing, 1.0)[:, None, None]
        self.register_buffer("tau", opts.temperature * spacing)
        self.register_buffer("step_tol", opts.tolerance * spacing.sqrt())

    def points(self) -> torch.Tensor:
        g = self.out_features // self.group_size
        return self.weight.reshape(g, -1, self.opts.cluster_dim)

    def _chunks(self, points: torch.Tensor) -> tuple[torch.Tensor, ...]:
        g, _, _ = points.shape
        return points.split(max(1, self.opts.chunk_size // (g * self.centroids.shape[1])), 1)

    def converged_centroids(self) -> torch.Tensor:
        """Soft k-means from the last converged centroids until they settle (differentiable in
        the weights); the result becomes the next warm start."""
        points, c = self.points(), self.centroids.to(self.weight.dtype, copy=True)
        tau = self.tau.to(points.dtype)
        for _ in range(self.opts.iterations):
            num, den = 0, 0
            for chunk in self._chunks(points):
                n, s = checkpoint(_sums, chunk, c, tau, use_reentrant=False)
                num, den = num + n, den + s
            new = torch.where(den[..., None] > 1e-12, num / den.clamp_min(1e-12)[..., None], c)
            moved = ((new - c).detach().abs() > self.step_tol.to(c.dtype)).any()
            c = new
            if not moved:
                break
        with torch.no_grad():
            self.centroids.copy_(c.detach())
        return c

    def soft_weight(self) -> torch.Tensor:
        c, tau = self.converged_centroids(), self.tau.to(self.weight.dtype)
        parts = [checkpoint(_soft, chunk, c, tau, use_reentrant=False) for chunk in self._chunks(self.points())]
        return torch.cat(parts, 1).reshape(self.out_features, self.in_features)

    @torch.no_grad()
    def snap(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(codebook, indices (out, in / d)): the converged centroids, one hard Lloyd step (every
        weight to its nearest centroid, each centroid to the mean of its weights), nearest again."""
        points = self.points()
        c = self.converged_centroids()
        c = centroid_means(points, nearest(points, c), c)
        return c, nearest(points, c).reshape(self.out_features, -1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            w = self.soft_weight()
        else:
            w = dequantize(*self.snap(), self.group_size)
        return F.linear(x, w.to(x.dtype), self.bias)


def prepare_dkm(model: nn.Module, opts: DKMConfig) -> tuple[list[nn.Parameter], list[torch.Tensor], Callable[[], dict]]:
    """Wrap the target linears for DKM training: (trainable weights, the centroid buffers a
    resumable checkpoint must hold, finalize).

    ``finalize()`` hard-snaps the layers into ``PalettizedLinear`` and returns the report.
    """
    kcfg = kmeans_stage(opts)
    layers = target_layers(model, kcfg)
    for name, module in layers.items():
        check_layer(name, *weight_of(module).shape, kcfg)
    wrapped: dict[str, DKMLinear] = {}
    for name, module in ui.track(list(layers.items()), "dkm init"):
        w = weight_of(module)
        out = w.shape[0]
        gs, d = group_size_of(kcfg, out), opts.cluster_dim
        codebook, _ = cluster(w.detach().reshape(out // gs, -1, d), opts.bits, opts.init, seed=opts.seed)
        weight = module.weight if isinstance(module, nn.Linear) and is_dense_linear(module) else nn.Parameter(w.detach().clone())
        layer = DKMLinear(weight, getattr(module, "bias", None), codebook.to(w.dtype), gs, opts, isinstance(module, Conv1D))
        replace_everywhere(model, module, layer)
        wrapped[name] = layer
    params = [layer.weight for layer in wrapped.values()]
    state = [layer.centroids for layer in wrapped.values()]

    def finalize() -> dict:
        rows = []
        for name, layer in wrapped.items():
            codebook, idx = layer.snap()
            pal = PalettizedLinear.from_clusters(codebook.detach(), idx, layer.bias, opts.entropy_coding, layer.conv1d,
                                                 opts.codebook_dtype)
            rows.append(layer_report(name, layer.weight, pal))
            replace_everywhere(model, layer, pal)
        return {"dkm": {**summarize(rows, opts.bits), "per_layer": rows}}

    return params, state, finalize
