"""Rank allocation: share one parameter budget between low-rank factorisations.

A *unit* is one factorisation: a matrix, or a group of matrices stacked over one shared
basis. Rank j of a unit costs ``cost`` parameters (d_in + n·d_out) and, once truncated, adds
its squared singular value of the whitened matrix (its share of the output error on the
calibration activations, SVD-LLM's truncation loss) times the unit's sensitivity (how much
the model's loss grows per unit of output error there, see ``pipeline.calibration.output_sensitivity``)
to the expected loss. Keeping the ranks with the highest loss per parameter, across every
unit at once, under the global budget is the greedy solution of that knapsack; because each
unit's spectrum descends, the kept ranks of a unit are always its top ones. A unit whose
rank reaches the break-even point (the factors as large as the dense matrices) stays dense.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import UsageError
from .linalg import whitening


@dataclass
class Unit:
    """One factorisation: squared singular values (descending) already multiplied by the
    unit's sensitivity, parameters per rank, and parameters of the dense matrices."""

    name: str
    spectrum: torch.Tensor
    cost: int
    dense: int

    @property
    def max_rank(self) -> int:
        """Ranks below break-even: from this rank on the factors are no smaller than dense."""
        return min(len(self.spectrum), self.dense // self.cost)


@torch.no_grad()  # the spectra are kept for the whole model: a graph behind each would keep its matrices too
def spectrum(w: torch.Tensor, gram: torch.Tensor | None) -> torch.Tensor:
    """Squared singular values of W·S (S·Sᵀ = the Gram matrix; W alone without one), descending,
    float64: the eigenvalues of W·G·Wᵀ for a wide W, of (W·S)ᵀ(W·S) for a tall one (the smaller
    side, as in ``linalg.low_rank``). Only the values: the stages factorise again once the ranks
    are known, so no more than one unit's factors exist at a time."""
    a = w.double()
    if gram is None:
        small = a.T @ a if a.shape[0] >= a.shape[1] else a @ a.T
    elif a.shape[0] <= a.shape[1]:
        small = a @ gram.to(a.device).double()
        del gram  # d×d float64 less while the product and eigenvalues are computed
        small = small @ a.T
    else:
        a = a @ whitening(gram.to(a.device))[0]
        small = a.T @ a
    return torch.linalg.eigvalsh(small).flip(0).clamp_min(0).cpu()


def allocate(units: list[Unit], ratio: float) -> dict[str, int | None]:
    """Rank per unit (None: keep it dense) removing at least ``ratio`` of the units' dense
    parameters, within one rank's cost of exactly that."""
    budget = math.floor((1 - ratio) * sum(u.dense for u in units))
    if budget < sum(u.cost for u in units):
        raise UsageError(f"ratio {ratio} leaves less than rank 1 for every matrix", "use a smaller ratio")
    value = torch.cat([u.spectrum[:u.max_rank] / u.cost for u in units])
    owner = torch.cat([torch.full((u.max_rank,), i) for i, u in enumerate(units)])
    order = value.argsort(descending=True, stable=True)
    costs = torch.tensor([u.cost for u in units])[owner[order]]
    ranks = torch.bincount(owner[order][costs.cumsum(0) <= budget], minlength=len(units))
    ranks = ranks.clamp_min(1)  # every matrix keeps at least rank 1 (paid for by the check above)

    def spent(r: torch.Tensor) -> int:
        return sum(u.dense if k >= u.max_rank else int(k) * u.cost for u, k in zip(units, r.tolist()))

    while spent(ranks) > budget:  # a unit gone dense costs a little more than its factors would: give back
        last = min((i for i, k in enumerate(ranks.tolist()) if k > 1),
                   key=lambda i: units[i].spectrum[ranks[i] - 1].item() / units[i].cost)
        ranks[last] -= 1
    return {u.name: None if k >= u.max_rank else int(k) for u, k in zip(units, ranks.tolist())}
