"""Trellis-coded quantization (QTIP's bit-shift trellis with a computed code): the Viterbi search
of a walk, and the search of a whole matrix, a walk a tile, with error feedback through the
inverse Gram matrix a block of tile columns at a time.

Per weight of a Gaussian source a walk through 2^12 states at 3 bits a weight reaches about 0.019
of the source's variance in squared error, against 0.0345 for the best scalar codebook (Lloyd-Max)
and 0.0297 for 2-d vectors (docs/lowbit.md): the trellis lets each weight choose among 2^k values
that depend on the weights before it, and the search looks at the whole row before choosing.
"""

from __future__ import annotations

import functools

import torch

from .. import kernels
from ..model.forms.wscompress_trellis import TILE, code, from_tiles, to_tiles
from .clustering import GramFactors


def viterbi(w: torch.Tensor, h: torch.Tensor, values: torch.Tensor, bits: int,
            overlap: torch.Tensor | None = None) -> torch.Tensor:
    """The least-error walks (B, T) int64 of runs ``w`` (B, T), each weight's squared error
    weighted by ``h`` (B, T), through the code ``values`` (2^L,) with ``bits`` new bits a step.
    ``overlap`` (B,): where not -1, the L - k bits each walk's first state begins with and its
    last state ends with (a tail-biting walk); without it every walk is free."""
    overlap = torch.full((w.shape[0],), -1, dtype=torch.int64) if overlap is None else overlap.long().cpu()
    fast = kernels.trellis() if w.device.type == "cpu" else None
    if fast is not None:
        return fast.trellis_viterbi(w.float().contiguous(), h.float().contiguous(), values.float().cpu(), bits,
                                    overlap).long()
    rows, steps = w.shape
    n, k = values.numel(), 1 << bits
    groups = n // k
    values = values.to(w.device, torch.float32)
    overlap = overlap.to(w.device)[:, None]
    s = torch.arange(n, device=w.device)
    free = overlap < 0
    inf = torch.tensor(float("inf"), device=w.device)
    cost = torch.where(free | (s >> bits == overlap), h[:, :1] * (w[:, :1] - values) ** 2, inf)
    back = torch.zeros(steps, rows, groups, dtype=torch.uint8, device=w.device)
    for t in range(1, steps):
        least, back[t] = cost.view(rows, k, groups).min(1)
        cost = least.repeat_interleave(k, 1) + h[:, t:t + 1] * (w[:, t:t + 1] - values) ** 2
    s = torch.where(free | (s % groups == overlap), cost, inf).argmin(1)
    states = torch.empty(rows, steps, dtype=torch.int64, device=w.device)
    for t in range(steps - 1, 0, -1):
        states[:, t] = s
        r = s >> bits
        s = back[t].gather(1, r[:, None])[:, 0].long() * groups + r
    states[:, 0] = s
    return states


def tail_biting(w: torch.Tensor, h: torch.Tensor, values: torch.Tensor, bits: int) -> torch.Tensor:
    """Walks as ``viterbi``'s whose last state ends with the L - k bits their first begins with,
    so a walk's stream needs no bits of its own for the first state (QTIP): a free search of
    each run turned half way round gives the state its first weight takes between its circular
    neighbours, whose bits a second search keeps to."""
    half = w.shape[1] // 2
    turned = viterbi(w.roll(-half, 1), h.roll(-half, 1), values, bits)
    return viterbi(w, h, values, bits, turned[:, half] >> bits)


@torch.no_grad()
def search(weight: torch.Tensor, bits: int, state_bits: int, grams: GramFactors | None,
           damp: float = 0.01) -> tuple[torch.Tensor, torch.Tensor]:
    """The state (out, in) int64 of each weight of ``weight`` (out, in) and the row scales (out,)
    float32 (rounded to float16, as stored) in the trellis code of 2^``state_bits`` states at
    ``bits`` a weight, a walk a tile (``wscompress_trellis.TILE``).

    Each row is divided by its RMS, so the code's N(0, 1) values fit it. With ``grams`` (the
    layer inputs' Gram matrix) the error is judged at the layer's output, as GPTQ judges it: a
    block of TILE columns at a time (in their own order, the order of the stream), each tile's
    weights' squared errors weighted by their column's share of the block's loss (the diagonal
    of S = U_bb⁻¹U_bb⁻ᵀ, U the Cholesky factor of the damped inverse Gram matrix: the loss of
    the block's error Δ once the columns after it have absorbed it is ΔSΔᵀ) and by their row's
    scale squared, and the block's error pushed onto the columns after it. Searching a block's
    columns together leaves S's off-diagonal terms out, which 16 columns after a rotation lose
    little of; a column at a time would keep them but give each weight only 2^bits values to
    choose from (measured: several times the error). Finally each row's scale is refit for the
    least output error of its walks."""
    out, inp = weight.shape
    w = weight.detach().float()
    rms = w.pow(2).mean(1).sqrt()
    scale = torch.where(rms > 0, rms, torch.ones_like(rms)).to(torch.float16).float()
    x = w / scale[:, None]
    values = code(state_bits).to(w.device)
    rows = scale.pow(2)[:, None]

    def walks(target: torch.Tensor, weigh: torch.Tensor) -> torch.Tensor:  # (out, TILE·c) -> states
        tiles = to_tiles(target)
        found = tail_biting(tiles.flatten(0, 1), to_tiles(weigh.expand_as(target)).flatten(0, 1), values, bits)
        return from_tiles(found.to(w.device).view_as(tiles))

    if grams is None:
        states, gram = walks(x, rows), None
    else:
        dead, _, u = grams.factor(1, damp, w.device, act_order=False)
        x[:, dead] = 0
        states = torch.empty(out, inp, dtype=torch.int64, device=w.device)
        for i1 in range(0, inp, TILE):
            i2 = i1 + TILE
            inv = torch.linalg.inv(u[i1:i2, i1:i2].double())
            states[:, i1:i2] = walks(x[:, i1:i2], rows * (inv @ inv.T).diagonal().float())
            # the block's errors as GPTQ's column-by-column feedback makes them: E U_bb = X_b - Q_b
            err = torch.linalg.solve_triangular(u[i1:i2, i1:i2], x[:, i1:i2] - values[states[:, i1:i2]], upper=True,
                                                left=False)
            x[:, i2:] -= err @ u[i1:i2, i2:]
        gram = grams.gram.to(w.device).double()
    q = values[states].double()
    gq = q if gram is None else q @ gram  # s_i = w_i G q_iᵀ / q_i G q_iᵀ (G = I without statistics):
    fit = (w.double() * gq).sum(1) / (q * gq).sum(1).clamp_min(1e-30)  # the row's least error for its walk
    scale = torch.where(fit > 0, fit, scale.double()).float().to(torch.float16).float()
    return states, scale


@functools.lru_cache(maxsize=None)
def distortion(bits: int, state_bits: int) -> float:
    """The squared error per weight, relative to its variance, of tail-biting walks of ``bits`` a
    weight through 2^``state_bits`` states on Gaussian weights (64 tiles' worth, a fixed draw):
    what a size budget weighs each choice of bits by (docs/lowbit.md)."""
    w = torch.randn(64, TILE * TILE, generator=torch.Generator().manual_seed(0))
    values = code(state_bits)
    states = tail_biting(w, torch.ones_like(w), values, bits)
    q = values[states]
    fit = (w * q).sum(1, keepdim=True) / (q * q).sum(1, keepdim=True)
    return (q * fit - w).pow(2).mean().item()
