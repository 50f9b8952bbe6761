"""The refit pass of every method that refits modules: once a layer's modules are compressed (factorised,
palettized, shared, merged), each is re-solved on the inputs the compressed model itself feeds
it, so the errors of earlier modules are absorbed instead of compounded (SVD-LLM's update step,
GPTQ's sequential mode, the refit of shared and merged weights).

``fit_pass`` takes the layers in order. ``build(i)`` gives layer i's new modules, which are
swapped in; inside the layer the modules go in forward order (q/k/v, o, gate/up, down), one
stage per group reading one input, each fitted on inputs that already reflect the stages
before it. A stage's fit (``Fit``) sums what it needs over the calibration batches and then
solves: ``WeightFit`` for a whole weight (a shared, merged or delta-coded linear; the solution
may be summed over the layers that share it), ``_Normals`` for low-rank coefficients, and
k-means palettizes on the same sums. The options (``recipe.schema.Refit``) are named once.
(``merge_drop`` refits a window of whole layers, not a module: it uses ``LeastSquares`` on its
own walk of ``layerwise``.)

For a module with original weight W, inputs X' in the compressed model and reference inputs X,
with G = X'ᵀX' and H = XᵀX' (float64), a whole weight is

    W̃ = argmin ‖X'·W̃ᵀ − X·Wᵀ‖² + λ‖W̃ − W₀‖² = (W·H + λ·W₀)·(G + λ·I)⁻¹

and low-rank coefficients C of a fixed basis B (start C₀) are

    C = argmin ‖X'·Bᵀ·Cᵀ − X·Wᵀ‖² + λ‖C − C₀‖² = (W·H·Bᵀ + λ·C₀)·(B·G·Bᵀ + λ·I)⁻¹

with a ridge that pulls toward what it had (λ = ridge × the mean diagonal of the quadratic
form; ridge → ∞ keeps it). The ``target`` says what X is:

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
layer too, so the pass takes about twice as long as with ``function``. What keeps the pass
from running a layer more than it must (each stage runs the layer only as far as its input;
finished blocks are replayed) is in ``replay.py``: one layer's activations (two with
``model``), its block outputs and one module's matrices are held at a time.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Callable, Iterator, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from ..io.offload import offload_of
from ..maths.linalg import add_gram, add_product, refit_coefficients, ridged, solve_coefficients, symmetrize
from ..model.arch import Arch, get_module, replace_everywhere, set_module, weight_of
from ..recipe.schema import Target
from .layerwise import LayerInputs, computing_in, layerwise, run_layer
from .replay import Ends, FirstInput, Replays


class Sums:
    """G = X'ᵀX' of what a stage's modules read in the compressed model and, unless the target
    reads the same (``same``), H = XᵀX', summed over batches in float64."""

    def __init__(self, same: bool):
        self.same = same
        self._gram: torch.Tensor | None = None  # lower triangle (``add_gram``)
        self.cross: torch.Tensor | None = None

    def add(self, x: torch.Tensor, x_ref: torch.Tensor | None) -> None:
        self._gram = add_gram(self._gram, x)
        if not self.same:
            self.cross = add_product(self.cross, x_ref, x)

    def gram(self) -> torch.Tensor:
        return symmetrize(self._gram)


class LeastSquares:
    """The normal equations of a linear's whole weight, W̃ = argmin Σ ‖X'·W̃ᵀ − X·Wᵀ‖² + λ‖W̃ − W₀‖²
    (module docstring), summed over batches and, for a weight that several layers share, over
    those layers, each with its own W; λ = ridge × mean diagonal of Σ X'ᵀX', toward ``prior`` W₀."""

    def __init__(self, prior: torch.Tensor, ridge: float):
        self.prior, self.ridge = prior.detach().clone(), ridge
        self.gram: torch.Tensor | None = None
        self.r: torch.Tensor | None = None

    def add(self, weight: torch.Tensor, sums: Sums) -> None:
        """One member's sums, its original weight ``weight`` the target."""
        gram = sums.gram()
        r = weight.detach().double() @ (gram if sums.cross is None else sums.cross).to(weight.device)
        self.gram = gram if self.gram is None else self.gram + gram
        self.r = r if self.r is None else self.r + r

    def add_outputs(self, x: torch.Tensor, target: torch.Tensor) -> None:
        """A batch whose wanted outputs ``target`` (rows) are given, not an original's weight."""
        self.gram = add_gram(self.gram, x)
        self.r = add_product(self.r, target, x)
        self.gram = symmetrize(self.gram)

    def solve(self) -> torch.Tensor:
        return solve_coefficients(self.gram, self.r, self.ridge, self.prior)

    def write(self, module: nn.Module) -> None:
        """The solution into ``module``'s weight, in its dtype."""
        weight = weight_of(module)
        weight.copy_(self.solve().to(weight.dtype))

    def metric(self) -> torch.Tensor:
        """H = X'ᵀX' + λ·I, which measures any weight's loss above the solution's, the ridge
        term included: loss(W) − loss(solve()) = tr((W − M)·H·(W − M)ᵀ)."""
        return ridged(self.gram, self.ridge)[0]


class Fit(Protocol):
    """One stage of ``fit_pass``: the modules reading one input, fitted once every batch's
    input has been summed."""

    def add(self, x: torch.Tensor, x_ref: torch.Tensor | None) -> None:
        """One batch: what the modules read in the compressed model and in the target (None: the same)."""

    def finish(self) -> tuple[dict[str, nn.Module], dict[str, torch.Tensor]]:
        """Fit: (modules that replace the stage's modules, coefficient changes of those kept)."""


class WeightFit:
    """The ``Fit`` of one module's whole weight: sums the stage's batches, adds them to ``solver``
    with ``weight`` (the original's) as the target, and calls ``write`` with it, which puts the
    solution where it belongs (a weight several layers share, a base and its deltas)."""

    def __init__(self, weight: torch.Tensor, same: bool, solver: LeastSquares, write: Callable[[LeastSquares], None]):
        self.weight, self.sums, self.solver, self.write = weight, Sums(same), solver, write

    def add(self, x: torch.Tensor, x_ref: torch.Tensor | None) -> None:
        self.sums.add(x, x_ref)

    def finish(self) -> tuple[dict[str, nn.Module], dict[str, torch.Tensor]]:
        self.solver.add(self.weight, self.sums)
        self.write(self.solver)
        return {}, {}


class _Normals:
    """The normal equations of the refits of the modules that read one input X' (see
    ``linalg.solve_coefficients``): A = B·X'ᵀX'·Bᵀ and R = W·XᵀX'·Bᵀ, summed batch by batch.

    Two routes give the same sums. Through the input's Gram matrices, G' = X'ᵀX' and
    H = XᵀX': ~1.5·d_in² multiply-adds a token (0.5·d_in² when X is X'), shared by the modules
    reading X'. Through each module's outputs, A = ZᵀZ and R = YᵀZ with Z = X'·Bᵀ and
    Y = X·Wᵀ: d_in·(k + d_out) + k·(d_out + k/2) a token. The cheaper one is taken: the outputs
    for a wide input such as the down projection's (about 2.5x fewer at the ranks used), the
    Gram matrices for the others. Z and Y are the module's outputs, computed in the pass's dtype
    as the model computes them; their products are summed in float64 (see
    ``linalg.product_dtype``)."""

    def __init__(self, modules: dict[str, nn.Module], weights: dict[str, torch.Tensor], same: bool, dtype: torch.dtype,
                 ridge: float):
        self.modules, self.ridge = modules, ridge
        bases = {n: m.basis.weight.detach() for n, m in modules.items()}
        self.weights, self.bases = weights, bases  # as the model holds them: the Gram route solves with these
        self.same = same
        d_in = next(iter(weights.values())).shape[1]
        outputs = sum(d_in * (b.shape[0] + w.shape[0]) + b.shape[0] * (w.shape[0] + b.shape[0] / 2)
                      for w, b in zip(weights.values(), bases.values()))
        self.through_outputs = not same and outputs < 1.5 * d_in * d_in
        # the outputs route computes Z and Y as the pass runs the modules: in its dtype
        self.fast = {n: (weights[n].to(dtype), bases[n].to(dtype)) for n in weights} if self.through_outputs else {}
        self.sums = Sums(same)
        self.a: dict[str, torch.Tensor] = {}
        self.r: dict[str, torch.Tensor] = {}

    def add(self, x: torch.Tensor, x_ref: torch.Tensor | None) -> None:
        """One batch: what the modules read in the compressed model (x) and in the target
        (x_ref; None when it is x)."""
        if not self.through_outputs:
            self.sums.add(x, x_ref)
            return
        x_ref = x if x_ref is None else x_ref
        for n, (w, basis) in self.fast.items():
            z, y = F.linear(x, basis), F.linear(x_ref, w)
            self.a[n] = add_gram(self.a.get(n), z)
            self.r[n] = add_product(self.r.get(n), y, z)

    def finish(self) -> tuple[dict[str, nn.Module], dict[str, torch.Tensor]]:
        """Solve each module's coefficients (float64) and write them in its dtype; no module is
        replaced, and the changes C − C₀ correct the block outputs recorded before."""
        priors = {n: m.coeff.weight for n, m in self.modules.items()}
        if self.through_outputs:
            coeffs = {n: solve_coefficients(symmetrize(self.a[n]), self.r[n], self.ridge, priors[n]) for n in self.weights}
        else:
            gram = self.sums.gram()
            coeffs = {n: refit_coefficients(w, self.bases[n], gram, self.sums.cross, ridge=self.ridge, prior=priors[n])
                      for n, w in self.weights.items()}
        changes = {n: c.to(priors[n].dtype) - priors[n] for n, c in coeffs.items()}
        for n, c in coeffs.items():
            self.modules[n].coeff.weight.copy_(c)
        return {}, changes


# (the stage's modules by name, their original weights, whether the target input is the
# compressed one, the pass's dtype) -> the stage's fit, or None where the group is not fitted
Stage = Callable[[dict[str, nn.Module], dict[str, torch.Tensor], bool, torch.dtype], Fit | None]


def refit_pass(model: nn.Module, arch: Arch, batches: list[torch.Tensor], build: Callable[[int], dict[str, nn.Module]],
               ridge: float, target: Target, dtype: torch.dtype | None = None) -> None:
    """Compress the model layer by layer, refitting low-rank coefficients as it goes:
    ``build(i)``, called with layer i onloaded, returns its low-rank replacements (module name
    -> module with ``basis``/``coeff``, built from the original weights); their coefficients
    are refit on the inputs the compressed layers before produce. A module that several layers
    share is fitted where it is first used. The normal equations are summed in float64 and the
    coefficients written in the model's dtype."""
    fit_pass(model, arch, batches, build, lambda *args: _Normals(*args, ridge=ridge), target, dtype, corrects=True)


@torch.no_grad()
def fit_pass(model: nn.Module, arch: Arch, batches: list[torch.Tensor], build: Callable[[int], dict[str, nn.Module]],
             stage: Stage, target: Target, dtype: torch.dtype | None = None, *, corrects: bool = False,
             layers: range | None = None, hidden: list[torch.Tensor] | None = None,
             as_original: Callable[[int], AbstractContextManager] | None = None, label: str = "refit") -> None:
    """The layer-by-layer refit (module docstring). ``build(i)``, called with layer i onloaded,
    returns its new modules by name (a method that replaces a module only once it is fitted
    returns the original itself); they are swapped in for the originals everywhere, and
    ``stage`` makes each stage's fit (None: the group is swapped, not fitted), which may
    replace its modules. The layers run in ``dtype`` (default: the model's).

    ``corrects``: every fit is a ``_Normals`` (coefficient changes only), so block outputs
    recorded before a fit are corrected rather than computed again. ``layers``: the layers
    ``build`` has modules for (default: all); the pass starts at the first, fed ``hidden``
    (what enters it, which also stands for the original model's there), and ends after the
    last. ``as_original(i)``: a context in which layer i, its original modules back, computes
    as the original (GQA's kv-head counts go with its merged projections)."""
    offload = offload_of(model)
    layers = layers or range(arch.num_layers)
    reference: list[torch.Tensor] | None = None  # the original model's hidden states (target "model")
    stream = layerwise(model, batches, arch, label, dtype, first=layers.start, hidden=hidden if layers.start else None)
    for i, layer, inputs in stream:
        if target == "model" and reference is None:
            reference = list(inputs.hidden)  # the first layer's input is the same in both models
        new = build(i)
        originals = {n: get_module(model, n) for n in new}
        weights = {n: weight_of(m).detach() for n, m in originals.items()}
        for n, module in new.items():
            replace_everywhere(model, originals[n], module)
        offload.refresh([i])  # a module shared with an earlier layer may rest elsewhere

        @contextmanager
        def original() -> Iterator[None]:
            with _originals_in(model, originals, new), (as_original or (lambda _i: nullcontext()))(i):
                yield

        ref_inputs = LayerInputs(reference or inputs.hidden, inputs.calls)
        replays = Replays(layer, arch.layer_name(i) + ".", new)
        pending = dict(new)
        while pending:
            # The layer's first modules read the same input in the compressed and the original
            # layer when the target is the layer: nothing compressed has run before them.
            same = target == "function" or (target == "layer" and len(pending) == len(new))
            first, ref = FirstInput(pending), FirstInput({n: originals[n] for n in pending})
            candidates = replays.ended_by_one(pending)
            ends = Ends(layer, candidates if corrects else {}, new, low_rank=True)
            ends_ref = Ends(layer, candidates, originals, low_rank=False)
            fit: Fit | None = None
            for b, (hidden_b, (args, kwargs)) in enumerate(zip(inputs.hidden, inputs.calls)):
                with replays("compressed", b, pending), ends(b), computing_in(layer, dtype):
                    x = first(layer, hidden_b, args, kwargs)
                if b == 0:
                    names = first.names
                    fit = stage({n: new[n] for n in names}, {n: weights[n] for n in names}, same, x.dtype)
                    if fit is None:  # swapped only: nothing to sum
                        break
                    first.through = ends.settle(names)
                x_ref = None
                if not same:
                    with original(), replays("original", b, pending), ends_ref(b), computing_in(layer, dtype):
                        x_ref = ref(layer, ref_inputs.hidden[b], args, kwargs)
                if b == 0:  # the original stream's block output is needed by later stages or a reference pass
                    needed = not same and (len(pending) > len(names) or target == "model")
                    ref.through = ends_ref.settle(names if needed else [])
                fit.add(x, x_ref)
            for n in first.names:
                del pending[n]
            if fit is None:
                continue
            replaced, changes = fit.finish()
            for n, module in replaced.items():
                replace_everywhere(model, new[n], module)
                new[n] = module
            ends.publish(replays, "compressed", changes)
            ends_ref.publish(replays, "original", {})
        with computing_in(layer, dtype):
            inputs.outputs = run_layer(layer, inputs, lambda b: replays("compressed", b, (), record=False))
        if target == "model":
            with original(), computing_in(layer, dtype):
                reference = run_layer(layer, ref_inputs, lambda b: replays("original", b, (), record=False))
        if i == layers[-1]:
            stream.close()  # the layers after need no outputs
            break


@contextmanager
def _originals_in(model: nn.Module, originals: dict[str, nn.Module], new: dict[str, nn.Module]) -> Iterator[None]:
    """The layer with its original modules back in place, for a reference forward."""
    for n, module in originals.items():
        set_module(model, n, module)
    try:
        yield
    finally:
        for n, module in new.items():
            set_module(model, n, module)
