"""k-means for weight clustering, weighted by sensitivity, and assignment with error feedback.

Scalar clustering is 1-D k-means. It runs on sorted values with prefix sums, so one Lloyd
iteration costs O(K log m) (binary-search the cluster boundaries, read the cluster sums off
the prefix sums) instead of O(m K). One codebook for a whole tensor first folds the weights
into a histogram in O(n) (bins of float16 resolution, each keeping the exact mean of its
weights) and runs its k-means++ restarts side by side on it, so a whole matrix clusters in
milliseconds; per-channel and grouped codebooks run as one batch. Vector clustering (d > 1)
is batched Lloyd with the distance matrix computed in bounded chunks, refit on the exact
points at the end. Every point may carry a weight (its sensitivity), and k-means then
minimises the weighted squared error.

``assign`` chooses the indices with error feedback: column by column (GPTQ, Frantar et al.
2023; with codebooks as in GPTVQ, van Baalen et al. 2024) each weight goes to its nearest
centroid and the error is pushed, through the inverse of the layer's input Gram matrix, onto
the columns not assigned yet, so the layer's *output* error is what gets minimised.

A group with fewer distinct values than K gets fewer distinct centroids: every distinct value
becomes a centroid (zero error) and the unused codebook entries repeat used ones.
"""

from __future__ import annotations

import math

import torch

from .. import kernels
from ..recipe.schema import Init

CHUNK_ELEMENTS = 1 << 22  # distance-matrix entries computed at once by vector clustering
SHIFT = 13  # float32 histogram: drop 13 low mantissa bits -> 2^19 bins as fine as float16's


def _sample(p: torch.Tensor, gen: torch.Generator, count: int = 1, u: torch.Tensor | None = None) -> torch.Tensor:
    """``count`` indices per row of p (B, m), drawn with probability proportional to p
    (inverse CDF at the uniforms ``u`` (B, count), drawn from ``gen`` when not given; a row of
    zeros picks its last point)."""
    cdf = p.cumsum(1)
    u = torch.rand(p.shape[0], count, generator=gen, device=p.device, dtype=cdf.dtype) if u is None else u.to(cdf.dtype)
    return torch.searchsorted(cdf, u * cdf[:, -1:], right=True).clamp_max(p.shape[1] - 1)


def _kmeans_pp(points: torch.Tensor, weights: torch.Tensor, k: int, gen: torch.Generator, trials: int = 1) -> torch.Tensor:
    """k-means++ seeding, batched: points (B, m, d), weights (B, m) -> centroids (B, k, d).

    With ``trials`` > 1 each step draws that many candidates and keeps the one that lowers
    the potential most (greedy k-means++, as scikit-learn does). A group whose points are all
    centroids already draws duplicates (never NaN).
    """
    # one draw a step, all taken at once: the compiled loop and the torch path pick the same points
    u = torch.rand(points.shape[0], k, generator=gen, device=points.device) if trials == 1 else None
    fast = kernels.kmeans() if points.device.type == "cpu" and trials == 1 else None
    if fast is not None and points.dtype == weights.dtype == torch.float32:
        return fast.kmeans_pp(points, weights, u)
    b = torch.arange(points.shape[0], device=points.device)
    centroids = [points[b, _sample(weights, gen, u=None if u is None else u[:, :1])[:, 0]]]
    d2 = ((points - centroids[0][:, None]) ** 2).sum(-1)
    for s in range(1, k):
        cand = points[b[:, None], _sample(d2 * weights, gen, trials, None if u is None else u[:, s:s + 1])]  # (B, trials, d)
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


def _nearest(points: torch.Tensor, centroids: torch.Tensor, distances: bool = False):
    """Index of the nearest centroid for points (B, m, d), centroids (B, k, d), in chunks; with
    ``distances`` also the squared distance to it. On the CPU the compiled search
    (``kernels/kmeans.cpp``) never writes the distance matrix, where its memory traffic set
    the time."""
    fast = kernels.kmeans() if points.device.type == "cpu" else None
    if fast is not None and points.dtype == centroids.dtype == torch.float32 and points.shape[-1] <= 8:
        idx, dist = fast.nearest(points, centroids)
        return (dist, idx) if distances else idx
    b = points.shape[0]
    step = max(1, CHUNK_ELEMENTS // (b * centroids.shape[1]))
    c2 = (centroids ** 2).sum(-1)[:, None]
    out, dist = [], []
    for p in points.split(step, 1):
        near = torch.baddbmm(c2, p, centroids.transpose(1, 2), alpha=-2).min(-1)
        out.append(near.indices)
        if distances:
            dist.append(near.values + (p ** 2).sum(-1))
    return (torch.cat(dist, 1), torch.cat(out, 1)) if distances else torch.cat(out, 1)


def _lloyd_nd(points: torch.Tensor, weights: torch.Tensor, c: torch.Tensor, iterations: int,
              tol: float = 1e-4) -> torch.Tensor:
    """Weighted Lloyd for vectors, batched over groups, chunked over points. Each iteration
    costs O(m K d), so it stops once one lowers the weighted error by less than ``tol`` of it:
    the assignment with error feedback that follows moves the indices anyway (on SmolLM2's
    layers 20 iterations gave the layers' output error of 300, in a tenth of the time)."""
    before = None
    for _ in range(iterations):
        dist, assign = _nearest(points, c, distances=True)
        error = float((dist.clamp_min(0) * weights).sum())
        if before is not None and before - error <= tol * error:
            break
        c = centroid_means(points, assign, c, weights)
        before = error
    return c


def centroid_means(points: torch.Tensor, assign: torch.Tensor, c: torch.Tensor,
                   weights: torch.Tensor | None = None) -> torch.Tensor:
    """Centroids = (weighted) means of their assigned points (an empty cluster keeps its centroid)."""
    w = torch.ones_like(assign, dtype=torch.float64) if weights is None else weights.double()
    sums = torch.zeros_like(c, dtype=torch.float64).scatter_add_(1, assign[..., None].expand_as(points), points.double() * w[..., None])
    mass = torch.zeros(c.shape[:2], dtype=torch.float64, device=c.device).scatter_add_(1, assign, w)
    return torch.where(mass[..., None] > 0, sums / mass.clamp_min(1e-300)[..., None], c.double()).to(c.dtype)


def _histogram(values: torch.Tensor, weights: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Fold values (n,) into bins: (bin means, bin weights), sorted by value, in O(n) (no sort).

    The bin is the value's bit pattern made monotone (negatives' magnitude bits flipped):
    exact for 16-bit floats (65 536 bins), the top 19 bits for float32 (bins of relative width
    2^-10). Each bin keeps the exact (weighted) mean of its values, so Lloyd on the bins only
    differs from Lloyd on every weight where a cluster boundary cuts through a bin.
    """
    if values.element_size() == 2:
        bits = values.view(torch.int16).to(torch.int32)
        key = torch.where(bits < 0, bits ^ 0x7FFF, bits) + (1 << 15)
        size = 1 << 16
    else:
        bits = values.float().view(torch.int32)
        key = (torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits) >> SHIFT) + (1 << (31 - SHIFT))
        size = 1 << (32 - SHIFT)
    w = torch.ones_like(values, dtype=torch.float64) if weights is None else weights.double()
    mass = torch.bincount(key, weights=w, minlength=size)
    sums = torch.bincount(key, weights=values.double() * w, minlength=size)
    used = mass > 0
    return (sums[used] / mass[used]).float(), mass[used].float()


def _best(candidates: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Per group, the centroids of the restart with the lowest error."""
    cs = torch.stack([c for c, _ in candidates])
    pick = torch.stack([e for _, e in candidates]).argmin(0)
    return cs[pick, torch.arange(cs.shape[1], device=cs.device)]


def cluster(groups: torch.Tensor, bits: int, init: Init = "kmeans++", iterations: int = 300,
            n_init: int | None = None, seed: int = 0, weights: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """k-means of each group of d-long points: groups (B, m, d) -> (codebooks (B, K, d),
    indices (B, m)), on the groups' device; the best of ``n_init`` restarts (default 3 for
    one scalar group, where restarts are cheap, else 1). ``weights`` (B, m) weigh each
    point's squared error (a point of weight 0 does not pull any centroid).

    Scalars: per tensor on the histogram (whose bins keep exact means), per channel or group
    on the sorted values of all groups at once.
    """
    b, m, d = groups.shape
    k = 2 ** bits
    n_init = n_init or (3 if b == d == 1 else 1)
    gen = torch.Generator(device=groups.device).manual_seed(seed)
    ones = torch.ones(b, m, dtype=torch.float32, device=groups.device)
    weights = ones if weights is None else weights.float()
    if d == 1:
        if b == 1:  # restarts run side by side as a batch on the histogram
            x, w = (t[None].expand(n_init, -1) for t in _histogram(groups.reshape(-1), weights.reshape(-1)))
            greedy = 2 + int(math.log(k))  # cheap on the histogram
            runs, sse = _lloyd_1d(x, w, _init(x[..., None], w, k, init, gen, greedy)[..., 0], iterations)
            c = runs[sse.argmin()][None]
        else:
            x, order = groups[..., 0].float().sort(1)
            w = weights.gather(1, order)
            c = _best([_lloyd_1d(x, w, _init(x[..., None], w, k, init, gen)[..., 0], iterations) for _ in range(n_init)])
        c = c.to(groups.dtype)[..., None]
        return c, nearest(groups, c)
    groups = groups.float()
    runs = []
    for _ in range(n_init):
        c = _lloyd_nd(groups, weights, _init(groups, weights, k, init, gen), iterations)
        c = centroid_means(groups, _nearest(groups, c), c, weights)
        assign = _nearest(groups, c)
        err = ((groups - torch.gather(c, 1, assign[..., None].expand(-1, -1, d))) ** 2).sum(2)
        runs.append((c, (err * weights).sum(1)))
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


class GramFactors:
    """A layer input's Gram matrix and what ``assign`` derives from it, computed on first use and
    kept: per chunk length d and dampening, the order of decreasing input energy and the Cholesky
    factor of the damped inverse in that order (a float64 factorisation as long as the matrix is
    wide). The modules that read one input share it, and so do the layouts a budget measures on
    one matrix."""

    def __init__(self, gram: torch.Tensor):
        self.gram = gram
        self._factors: dict[tuple[int, float, torch.device, bool], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def factor(self, d: int, damp: float, device: torch.device,
               act_order: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(dead inputs, column order, upper factor U with UᵀU = H⁻¹ in that order, float32) for
        chunks of d columns, H = Gram + ``damp`` x its mean diagonal; the order is the chunks'
        decreasing energy, or the columns' own (``act_order=False``: a code whose stream runs
        along the row)."""
        key = (d, damp, torch.device(device), act_order)
        if key not in self._factors:
            h = self.gram.to(device).double().clone()
            dead = h.diagonal() == 0  # inputs that are always zero: their weights never matter
            h[dead, dead] = 1
            order = h.diagonal().view(-1, d).sum(1).argsort(descending=True) if act_order else \
                torch.arange(len(h) // d, device=device)
            perm = (order[:, None] * d + torch.arange(d, device=device)).reshape(-1)
            h = h[perm][:, perm]
            h += damp * h.diagonal().mean() * torch.eye(len(h), dtype=h.dtype, device=device)
            u = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True).float()
            self._factors[key] = dead, perm, u
        return self._factors[key]


@torch.no_grad()
def assign(weight: torch.Tensor, codebook: torch.Tensor, group_size: int, grams: GramFactors,
           exact: torch.Tensor | None = None, damp: float = 0.01, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices (out, in / d) of ``weight`` (out, in) in ``codebook`` (groups, K, d) chosen with
    error feedback, and the final values of the weights marked ``exact`` (kept aside, e.g.
    outliers: they take no codebook value and so add no error, but absorb feedback like the
    others).

    Chunks of d columns go in order of decreasing input energy (the Gram matrix diagonal;
    GPTQ's act order). Each chunk's rows go to their nearest centroids; the error of every
    column, divided by the Cholesky factor of H⁻¹ (H = Gram + ``damp`` x its mean diagonal), is
    subtracted from the columns after it (lazily, ``block`` columns at a time).
    """
    out, inp = weight.shape
    d = codebook.shape[-1]
    w = weight.detach().float().clone()
    dead, perm, u = grams.factor(d, damp, w.device)
    w[:, dead] = 0
    w = w[:, perm]
    keep = None if exact is None else exact[:, perm]
    rows = codebook.to(w).repeat_interleave(group_size, 0) if codebook.shape[0] > 1 else codebook.to(w).expand(out, -1, -1)
    if d == 1:  # nearest centroid by binary search between the sorted centroids of each row
        sorted_c, c_order = rows[..., 0].sort(1)
        mids = ((sorted_c[:, 1:] + sorted_c[:, :-1]) / 2).contiguous()
        pick = lambda p: c_order.gather(1, torch.searchsorted(mids, p.contiguous()))[:, 0]  # noqa: E731
    else:
        book = codebook.to(w)  # rows of a group in one batch: (groups, rows a group, d) against (groups, K, d)
        pick = lambda p: _nearest(p.reshape(book.shape[0], -1, d), book).reshape(-1)  # noqa: E731
    idx = torch.empty(out, inp // d, dtype=torch.long, device=w.device)
    block = max(d, block // d * d)
    for i1 in range(0, inp, block):
        i2 = min(i1 + block, inp)
        w1, err = w[:, i1:i2].clone(), torch.zeros(out, i2 - i1, device=w.device)
        for j in range(0, i2 - i1, d):
            k = pick(w1[:, j:j + d])
            q = rows[torch.arange(out, device=w.device), k]
            if keep is not None:
                q = torch.where(keep[:, i1 + j:i1 + j + d], w1[:, j:j + d], q)
            idx[:, (i1 + j) // d] = k
            for c in range(j, j + d):
                e = (w1[:, c] - q[:, c - j]) / u[i1 + c, i1 + c]
                w1[:, c:] -= e[:, None] * u[i1 + c, i1 + c:i2]
                err[:, c] = e
                w1[:, c] = q[:, c - j]
        w[:, i1:i2] = w1
        w[:, i2:] -= err @ u[i1:i2, i2:]
    chunks = perm[::d] // d  # the order the chunks went in
    values = w[:, perm.argsort()]
    return idx[:, chunks.argsort()], values if exact is None else values[exact]
