"""A size budget shared by many matrices, each with its own menu of compressed forms: the
multiple-choice knapsack. Every matrix takes exactly one choice (its bytes, its estimated cost
to the model); the chosen bytes fit the budget and the summed cost is the least possible.

Solved exactly by dynamic programming over the budget in units of ``quantum`` bytes, each
choice's bytes rounded up to whole units: the choice is optimal among those whose rounded sizes
fit, and the real bytes, never more than the rounded ones, fit too. A matrix's rounding gives
away less than one unit, so a quantum of 1/65536 of the budget costs at most n/65536 of it.
One row of the table per matrix (an int8 argmin per unit) is what the way back needs.
"""

from __future__ import annotations

import math

import numpy as np

from ..errors import UsageError

UNITS = 1 << 16  # budget units the default quantum divides the budget into


def choose(costs: np.ndarray, sizes: np.ndarray, budget: int, quantum: int | None = None) -> list[int]:
    """Indices of the choices (one per row of ``costs`` / ``sizes``, (matrices, choices); an
    infinite cost marks a choice a matrix may not take) of least summed cost whose sizes sum to
    at most ``budget``; ``quantum`` bytes a unit (default: the budget over 65536, at least 1)."""
    costs, sizes = np.asarray(costs, dtype=np.float64), np.asarray(sizes, dtype=np.int64)
    if costs.shape != sizes.shape or costs.ndim != 2 or costs.shape[1] > 127:
        raise ValueError(f"costs {costs.shape} and sizes {sizes.shape} must be (matrices, <= 127 choices) alike")
    quantum = quantum or max(1, math.ceil(budget / UNITS))
    units = budget // quantum
    weight = -(-sizes // quantum)  # rounded up: what fits in units fits in bytes
    least = int(np.where(np.isfinite(costs), sizes, np.iinfo(np.int64).max // 4).min(1).sum())
    if least > budget:
        raise UsageError(f"the budget of {budget} bytes is below the smallest choices' {least} bytes",
                         "raise the budget, or add smaller layouts to the menu")
    best = np.zeros(units + 1)  # least cost of the matrices so far within c units (any c: at most c used)
    taken = np.empty((len(costs), units + 1), dtype=np.int8)
    for i, (cost, w) in enumerate(zip(costs, weight)):
        new = np.full(units + 1, np.inf)
        pick = np.full(units + 1, -1, dtype=np.int8)
        for j in np.flatnonzero(np.isfinite(cost)):
            if w[j] > units:
                continue
            candidate = np.full(units + 1, np.inf)
            candidate[w[j]:] = best[: units + 1 - w[j]] + cost[j]
            better = candidate < new
            new[better], pick[better] = candidate[better], j
        best, taken[i] = new, pick
    if not np.isfinite(best[units]):  # the smallest choices fit in bytes, not rounded up to units
        raise UsageError(f"the smallest choices fill the budget of {budget} bytes to within {quantum}-byte units",
                         "raise the budget a little")
    chosen, c = [0] * len(costs), units
    for i in range(len(costs) - 1, -1, -1):
        chosen[i] = int(taken[i, c])
        c -= int(weight[i, chosen[i]])
    return chosen
