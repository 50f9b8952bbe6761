"""Error compensation for low-rank stages: once a layer's modules are factorised, re-solve each
module's coefficients (its basis stays fixed) on the inputs the compressed model itself feeds
it, so the errors of earlier modules are absorbed instead of compounded (SVD-LLM's update step,
which the Basis Sharing code applies from 40 %).

For a module with original weight W, basis B, coefficients C₀, inputs X' in the compressed
model and reference inputs X, with G = X'ᵀX' and H = XᵀX' (float64):

    C = argmin ‖X'·Bᵀ·Cᵀ − X·Wᵀ‖² + λ‖C − C₀‖² = (W·H·Bᵀ + λ·C₀)·(B·G·Bᵀ + λ·I)⁻¹

with a ridge that pulls toward the coefficients it had (λ = ridge · tr(B·G·Bᵀ) / k; ridge → ∞
keeps C₀). The ``target`` says what X is:

- ``function`` (the official update): X = X', the original module's function on the compressed
  model's own activations; each module answers for its own error only.
- ``layer``: X is what the module reads in the original layer fed the same layer input, so
  o also makes up for q/k/v's error, down for everything before it in the layer.
- ``model``: X is what the module reads in the original model; every module also makes up for
  the error of all layers before (GPTQ-v2's asymmetric target). It runs a second stream of
  hidden states through the original layers.

On the protocol (scripts/bench_protocol.py) ``layer`` wins at every ratio on both texts, and
``model`` loses to ``function``: a low-rank module cannot undo the drift of all layers before
it, and chasing it costs fit on the inputs it does see. ``layer`` and ``model`` run the original
layer too, so the pass takes about twice as long as with ``function``.

Layers go in order and, inside a layer, modules in forward order (q/k/v, o, gate/up, down),
each fitted on inputs that already reflect the refits before it. One layer's activations (two
with ``model``) and one module's matrices are held at a time.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from typing import Callable, Iterator, Literal

import torch
from torch import nn

from .arch import Arch, get_module, replace_everywhere, set_module, weight_of
from .calibrate import LayerInputs, layerwise, run_layer
from .linalg import add_gram, refit_coefficients, symmetrize
from .offload import offload_of

Target = Literal["function", "layer", "model"]


class _Seen(Exception):
    """Raised to end a layer's forward once the input being recorded has been read."""


class FirstInput:
    """Runs a layer on one batch only as far as ``modules`` (name -> module) read their first
    input: which of them read it (in forward order) and that input, as (tokens, d). The
    forward ends where one of ``modules`` reads another tensor: what comes after is not needed
    (the refit of a layer's first modules costs almost no compute)."""

    def __init__(self, modules: dict[str, nn.Module]):
        self.modules = modules
        self.names: list[str] = []
        self.x: torch.Tensor | None = None

    def _hook(self, name: str):
        def hook(_module, args):
            x = args[0]
            if self.x is None:
                self.x = x
            if x.data_ptr() != self.x.data_ptr():
                raise _Seen
            if name not in self.names:
                self.names.append(name)
        return hook

    def __call__(self, layer: nn.Module, hidden: torch.Tensor, args: tuple, kwargs: dict) -> torch.Tensor:
        self.x = None
        with ExitStack() as stack:
            for name, module in self.modules.items():
                stack.callback(module.register_forward_pre_hook(self._hook(name)).remove)
            try:
                layer(hidden, *args, **kwargs)
            except _Seen:
                pass
        x, self.x = self.x, None
        return x.reshape(-1, x.shape[-1])


@contextmanager
def _originals(model: nn.Module, originals: dict[str, nn.Module], new: dict[str, nn.Module]) -> Iterator[None]:
    """The layer with its original modules back in place, for a reference forward."""
    for n, module in originals.items():
        set_module(model, n, module)
    try:
        yield
    finally:
        for n, module in new.items():
            set_module(model, n, module)


@torch.no_grad()
def refit_pass(model: nn.Module, arch: Arch, batches: list[torch.Tensor], build: Callable[[int], dict[str, nn.Module]],
               ridge: float, target: Target) -> None:
    """Compress the model layer by layer, refitting as it goes (see the module docstring):
    ``build(i)``, called with layer i onloaded, returns its low-rank replacements (module name
    -> module with ``basis``/``coeff``, built from the original weights); they are swapped in
    and their coefficients refit on the inputs the compressed layers before produce. A module
    that several layers share is fitted where it is first used."""
    offload = offload_of(model)
    reference: list[torch.Tensor] | None = None  # the original model's hidden states (target "model")
    for i, layer, inputs in layerwise(model, batches, arch, label="refit (error compensation)"):
        if target == "model" and reference is None:
            reference = list(inputs.hidden)  # layer 0's input is the same in both models
        new = build(i)
        originals = {n: get_module(model, n) for n in new}
        weights = {n: weight_of(m).detach() for n, m in originals.items()}
        for n, module in new.items():
            replace_everywhere(model, originals[n], module)
        offload.refresh([i])  # a basis shared with an earlier layer of its group may rest elsewhere
        ref_inputs = LayerInputs(reference or inputs.hidden, inputs.calls)
        pending = dict(new)
        while pending:
            first, ref = FirstInput(pending), FirstInput({n: originals[n] for n in pending})
            gram = cross = None
            for b, (hidden, (args, kwargs)) in enumerate(zip(inputs.hidden, inputs.calls)):
                x = first(layer, hidden, args, kwargs)
                gram = add_gram(gram, x)  # lower triangle
                if target != "function":
                    with _originals(model, originals, new):
                        x_ref = ref(layer, ref_inputs.hidden[b], args, kwargs)
                    cross = (x_ref.double().T @ x.double()) if cross is None else cross.addmm_(x_ref.double().T, x.double())
            symmetrize(gram)
            for n in first.names:
                c0 = pending.pop(n).coeff.weight
                c0.copy_(refit_coefficients(weights[n], new[n].basis.weight, gram, cross, ridge=ridge, prior=c0))
        if target == "model":
            with _originals(model, originals, new):
                reference = run_layer(layer, ref_inputs)
