"""Error compensation for low-rank stages: once a layer's modules are factorised, re-solve each
module's coefficients (its basis stays fixed) on the inputs the compressed model itself feeds
it, so the errors of earlier modules are absorbed instead of compounded (SVD-LLM's update step,
which the Basis Sharing code applies from 40 %).

For a module with original weight W, basis B, coefficients C₀ and inputs X' in the compressed
model, with G = X'ᵀX' (float64):

    C = argmin ‖X'·Bᵀ·Cᵀ − X'·Wᵀ‖² + λ‖C − C₀‖² = (W·G·Bᵀ + λ·C₀)·(B·G·Bᵀ + λ·I)⁻¹

the original module's function on the compressed model's activations, with a ridge that pulls
toward the coefficients it had (λ = ridge · tr(B·G·Bᵀ) / k; ridge → ∞ keeps C₀). Layers go in
order and, inside a layer, modules in forward order (q/k/v, o, gate/up, down), each fitted on
inputs that already reflect the refits before it. One layer's activations and one Gram matrix
are held at a time.
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Callable

import torch
from torch import nn

from .arch import Arch, get_module, replace_everywhere, weight_of
from .calibrate import LayerInputs, layerwise
from .linalg import add_gram, refit_coefficients, symmetrize
from .offload import offload_of


class _Seen(Exception):
    """Raised to end a layer's forward once the input being recorded has been read."""


class FirstInput:
    """While a layer runs over the calibration batches: which of ``modules`` read the first
    input any of them reads (in forward order), and that input's Gram matrix X'ᵀX' (float64).
    Each batch's forward ends where one of ``modules`` reads another input: what comes after
    is not needed for this input (the refit of a layer's first modules costs almost no compute)."""

    def __init__(self, layer: nn.Module, modules: dict[str, nn.Module]):
        self.names: list[str] = []
        self.gram: torch.Tensor | None = None
        self._x: torch.Tensor | None = None  # held, so no later tensor can reuse its address
        self._stack = ExitStack()
        for name, module in modules.items():
            self._stack.callback(module.register_forward_pre_hook(self._hook(name)).remove)

    def _hook(self, name: str):
        def hook(_module, args):
            x = args[0]
            if self._x is None:
                self._x = x
            if x.data_ptr() != self._x.data_ptr():
                raise _Seen
            if name not in self.names:
                self.names.append(name)
            if name == self.names[0]:
                self.gram = add_gram(self.gram, x.reshape(-1, x.shape[-1]))  # lower triangle; see run()
        return hook

    def run(self, layer: nn.Module, inputs: LayerInputs) -> None:
        """Run the layer on every batch (each as far as needed) and stop observing."""
        try:
            for hidden, (args, kwargs) in zip(inputs.hidden, inputs.calls):
                self._x = None
                try:
                    layer(hidden, *args, **kwargs)
                except _Seen:
                    pass
        finally:
            self._stack.close()
            self._x = None
        if self.gram is not None:
            symmetrize(self.gram)


@torch.no_grad()
def refit_pass(model: nn.Module, arch: Arch, batches: list[torch.Tensor], build: Callable[[int], dict[str, nn.Module]],
               ridge: float) -> None:
    """Compress the model layer by layer, refitting as it goes (see the module docstring):
    ``build(i)``, called with layer i onloaded, returns its low-rank replacements (module name
    -> module with ``basis``/``coeff``, built from the original weights); they are swapped in
    and their coefficients refit on the inputs the compressed layers before produce. A module
    that several layers share is fitted where it is first used."""
    offload = offload_of(model)
    for i, layer, inputs in layerwise(model, batches, arch, label="refit (error compensation)"):
        new = build(i)
        weights = {n: weight_of(get_module(model, n)).detach() for n in new}
        for n, module in new.items():
            replace_everywhere(model, get_module(model, n), module)
        offload.refresh([i])  # a basis shared with an earlier layer of its group may rest elsewhere
        pending = dict(new)
        while pending:
            first = FirstInput(layer, pending)
            first.run(layer, inputs)
            for n in first.names:
                c0 = pending.pop(n).coeff.weight
                c0.copy_(refit_coefficients(weights[n], new[n].basis.weight, first.gram, ridge=ridge, prior=c0))
