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
each fitted on inputs that already reflect the refits before it. Each stage runs the layer only
as far as its modules' input, and a block whose modules are all refit (the attention block once
o is) is replayed after: its input and weights no longer change. A block that one module ends
(o, down) is recorded by that module's own stage and corrected by its coefficient change, so
it is never run again; others are recorded the first time a later stage runs them. One
layer's activations (two with ``model``), its block outputs and one module's matrices are
held at a time.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from typing import Callable, Collection, Iterable, Iterator, Literal, Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from ..io.offload import offload_of
from ..maths.linalg import add_gram, add_product, refit_coefficients, ridged, solve_coefficients, symmetrize
from ..model.arch import Arch, get_module, replace_everywhere, set_module, weight_of
from .layerwise import LayerInputs, Stub, computing_in, layerwise, run_layer

Target = Literal["function", "layer", "model"]


class _Seen(Exception):
    """Raised to end a layer's forward once the input being recorded has been read."""


class FirstInput:
    """Runs a layer on one batch only as far as ``modules`` (name -> module) read their first
    input: which of them read it (in forward order) and that input, as (tokens, d). On the
    first batch the forward ends where one of ``modules`` reads another tensor, which is how
    the group reading the input is found; on later batches it ends as soon as the input is
    read. What comes after is not needed (the refit of a layer's first modules costs almost no
    compute)."""

    def __init__(self, modules: dict[str, nn.Module]):
        self.modules = modules
        self.names: list[str] = []
        self.x: torch.Tensor | None = None
        self.through = False  # later batches run on (to where an _Ends stops them)

    def _hook(self, name: str):
        def hook(_module, args):
            x = args[0]
            if self.x is None:
                self.x = x
                if self.names and not self.through:  # the group is known: the forward reaches its input in the same order
                    raise _Seen
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


@torch.no_grad()
def module_inputs(layer: nn.Module, inputs: LayerInputs, module: nn.Module, dtype: torch.dtype | None) -> list[torch.Tensor]:
    """``module``'s input for every batch of ``inputs``, (tokens, d): the layer runs, in
    ``dtype``, only as far as the module (``FirstInput``)."""
    reader = FirstInput({"module": module})
    with computing_in(layer, dtype):
        return [reader(layer, hidden, args, kwargs) for hidden, (args, kwargs) in zip(inputs.hidden, inputs.calls)]


class LeastSquares:
    """A linear's weight refit by ridge least squares, W̃ = argmin Σ ‖X'·W̃ᵀ − X·Wᵀ‖² + λ‖W̃ − W₀‖²:
    X' what it reads in the compressed model, X what the original it stands for reads, W that
    original's weight. The sum runs over batches and, for a weight that several layers share,
    over those layers, each with its own W. Normal equations in float64; λ = ridge × mean
    diagonal of X'ᵀX', toward ``prior`` W₀."""

    def __init__(self, prior: torch.Tensor, ridge: float):
        self.prior, self.ridge = prior.detach().clone(), ridge
        self.gram: torch.Tensor | None = None
        self.r: torch.Tensor | None = None

    def add(self, weight: torch.Tensor, x: list[torch.Tensor], x_ref: list[torch.Tensor]) -> None:
        cross = None
        for a, b in zip(x, x_ref):
            self.gram, cross = add_gram(self.gram, a), add_product(cross, b, a)
        r = weight.detach().double() @ cross.to(weight.device)
        self.r = r if self.r is None else self.r + r

    def add_outputs(self, x: list[torch.Tensor], target: list[torch.Tensor]) -> None:
        """Batches whose wanted outputs ``target`` (rows) are given, not an original's weight."""
        for a, t in zip(x, target):
            self.gram, self.r = add_gram(self.gram, a), add_product(self.r, t, a)

    def solve(self) -> torch.Tensor:
        return solve_coefficients(symmetrize(self.gram), self.r, self.ridge, self.prior)

    def metric(self) -> torch.Tensor:
        """H = X'ᵀX' + λ·I, which measures any weight's loss above the solution's, the ridge
        term included: loss(W) − loss(solve()) = tr((W − M)·H·(W − M)ᵀ)."""
        return ridged(symmetrize(self.gram), self.ridge)[0]


class _Saved(Stub):
    """Returns a recorded output instead of computing its module."""

    def __init__(self, module: nn.Module, out: object):
        super().__init__(module)
        self.out = out

    def forward(self, *_args, **_kwargs) -> object:
        return _copy(self.out)  # a copy: the layer may change what it gets in place


def _copy(out: object) -> object:
    return tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, out)


class _Replays:
    """Outputs of a layer's blocks (its direct children, e.g. the attention block) whose
    compressed modules are all refit, recorded the first time a stage runs them and replayed by
    the stages after, one per stream ("compressed", "original") and batch. Their inputs do not
    change either: a block that has finished ran wholly before the modules still pending."""

    def __init__(self, layer: nn.Module, prefix: str, new: Iterable[str]):
        self.layer = layer
        self.owns: dict[str, set[str]] = {}  # block -> its compressed modules
        for n in new:
            self.owns.setdefault(n[len(prefix):].split(".")[0], set()).add(n)
        self.saved: dict[tuple[str, str, int], object] = {}

    def ended_by_one(self, pending: Collection[str]) -> dict[str, str]:
        """Blocks with exactly one module still ``pending``: block -> that module."""
        return {block: next(iter(left)) for block, names in self.owns.items() if len(left := names & set(pending)) == 1}

    @contextmanager
    def __call__(self, stream: str, batch: int, pending: Collection[str], record: bool = True) -> Iterator[None]:
        """Inside the block, the finished blocks replay their outputs for this stream and batch,
        or (``record``) save them as they run."""
        finished = [b for b, names in self.owns.items() if names.isdisjoint(pending)]
        with ExitStack() as stack:
            for block in finished:
                module, key = getattr(self.layer, block), (stream, block, batch)
                if key in self.saved:
                    setattr(self.layer, block, _Saved(module, self.saved[key]))
                    stack.callback(setattr, self.layer, block, module)
                elif record:
                    hook = module.register_forward_hook(lambda _m, _a, out, key=key: self.saved.__setitem__(key, _copy(out)))
                    stack.callback(hook.remove)
            yield


class _Ends:
    """Outputs of the block that a stage's module ends (its output is the block's output, as o
    ends the attention block and down the MLP), recorded while that stage runs so that no later
    pass runs the block again. The compressed stream's record still has the old coefficients
    C₀; once the module is refit, out + basis(x)·(C − C₀)ᵀ is the new output (basis and bias
    stay). The first batch records every block that has one pending module; once the stage's
    group is known, later batches record its block only and stop at the block's end."""

    def __init__(self, layer: nn.Module, candidates: dict[str, str], modules: dict[str, nn.Module], low_rank: bool):
        self.layer, self.candidates, self.modules, self.low_rank = layer, candidates, modules, low_rank
        self.block: str | None = None
        self.saved: dict[tuple[str, int], tuple[list, object, int, torch.Tensor | None]] = {}

    @contextmanager
    def __call__(self, batch: int) -> Iterator[None]:
        blocks = [self.block] if self.block else list(self.candidates) if batch == 0 else []
        seen: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        codes: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # basis(x) as the module computed it
        with ExitStack() as stack:
            for block in blocks:
                def on_module(_m, args, out, block=block):
                    seen[block] = (args[0], out)

                def on_basis(_m, args, out, block=block):
                    codes[block] = (args[0], out)

                def on_block(_m, _args, out, block=block):
                    if block in seen:
                        x, y = seen[block]
                        z = codes[block][1] if block in codes and codes[block][0] is x else None
                        self._keep(block, batch, out, y, z)
                    if self.block:
                        raise _Seen

                module = self.modules[self.candidates[block]]
                stack.callback(module.register_forward_hook(on_module).remove)
                if self.low_rank:
                    stack.callback(module.basis.register_forward_hook(on_basis).remove)
                stack.callback(getattr(self.layer, block).register_forward_hook(on_block).remove)
            yield

    def _keep(self, block: str, batch: int, out: object, y: torch.Tensor, z: torch.Tensor | None) -> None:
        """Record ``out`` if ``y`` (the module's output) is a leaf of it, with z = basis(x)."""
        leaves, spec = tree_flatten(out)
        at = next((j for j, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.data_ptr() == y.data_ptr()
                   and t.shape == y.shape), None)
        # Not kept (a later pass runs the block): the block does more after the module, so it is
        # not one the module ends, or the module skipped its basis call (a fused decoding path).
        if at is None or self.low_rank and z is None:
            return
        self.saved[block, batch] = ([t.clone() if isinstance(t, torch.Tensor) else t for t in leaves], spec, at, z)

    def settle(self, names: list[str]) -> bool:
        """After the first batch: whether the stage's group (``names``; none: record nothing)
        ends a block."""
        self.block = next((b for b, n in self.candidates.items() if [n] == names and (b, 0) in self.saved), None)
        self.saved = {k: v for k, v in self.saved.items() if k[0] == self.block}
        return self.block is not None

    def publish(self, replays: _Replays, stream: str, changes: dict[str, torch.Tensor]) -> None:
        """Hand the records, corrected by the coefficient ``changes`` (C − C₀), to ``replays``."""
        for (block, batch), (leaves, spec, at, z) in self.saved.items():
            if z is not None:
                leaves[at] += F.linear(z, changes[self.candidates[block]].to(z.dtype))
            replays.saved[stream, block, batch] = tree_unflatten(leaves, spec)


@contextmanager
def originals_in(model: nn.Module, originals: dict[str, nn.Module], new: dict[str, nn.Module]) -> Iterator[None]:
    """The layer with its original modules back in place, for a reference forward."""
    for n, module in originals.items():
        set_module(model, n, module)
    try:
        yield
    finally:
        for n, module in new.items():
            set_module(model, n, module)


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
        self.gram: torch.Tensor | None = None
        self.cross: torch.Tensor | None = None
        self.a: dict[str, torch.Tensor] = {}
        self.r: dict[str, torch.Tensor] = {}

    def add(self, x: torch.Tensor, x_ref: torch.Tensor | None) -> None:
        """One batch: what the modules read in the compressed model (x) and in the target
        (x_ref; None when it is x)."""
        if not self.through_outputs:
            self.gram = add_gram(self.gram, x)  # lower triangle
            if not self.same:
                self.cross = add_product(self.cross, x if x_ref is None else x_ref, x)
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
            gram = symmetrize(self.gram)
            coeffs = {n: refit_coefficients(w, self.bases[n], gram, self.cross, ridge=self.ridge, prior=priors[n])
                      for n, w in self.weights.items()}
        changes = {n: c.to(priors[n].dtype) - priors[n] for n, c in coeffs.items()}
        for n, c in coeffs.items():
            self.modules[n].coeff.weight.copy_(c)
        return {}, changes


class Fit(Protocol):
    """One stage of ``fit_pass``: the modules reading one input, fitted once every batch's
    input has been summed (``_Normals`` for low-rank coefficients; a method may bring its own)."""

    def add(self, x: torch.Tensor, x_ref: torch.Tensor | None) -> None:
        """One batch: what the modules read in the compressed model and in the target (None: the same)."""

    def finish(self) -> tuple[dict[str, nn.Module], dict[str, torch.Tensor]]:
        """Fit: (modules that replace the stage's modules, coefficient changes of those kept)."""


# (the stage's modules by name, their original weights, whether the target input is the
# compressed one, the pass's dtype) -> the stage's fit
Stage = Callable[[dict[str, nn.Module], dict[str, torch.Tensor], bool, torch.dtype], Fit]


def refit_pass(model: nn.Module, arch: Arch, batches: list[torch.Tensor], build: Callable[[int], dict[str, nn.Module]],
               ridge: float, target: Target, dtype: torch.dtype | None = None) -> None:
    """Compress the model layer by layer, refitting as it goes (see the module docstring):
    ``build(i)``, called with layer i onloaded, returns its low-rank replacements (module name
    -> module with ``basis``/``coeff``, built from the original weights); they are swapped in
    and their coefficients refit on the inputs the compressed layers before produce. A module
    that several layers share is fitted where it is first used. The layers run in ``dtype``
    (default: the model's); the normal equations are summed in float64 and the coefficients
    written in the model's dtype."""
    fit_pass(model, arch, batches, build, lambda *args: _Normals(*args, ridge=ridge), target, dtype, corrects=True)


@torch.no_grad()
def fit_pass(model: nn.Module, arch: Arch, batches: list[torch.Tensor], build: Callable[[int], dict[str, nn.Module]],
             stage: Stage, target: Target, dtype: torch.dtype | None = None, corrects: bool = False) -> None:
    """The layer-by-layer pass behind ``refit_pass``, for any fit: ``build(i)`` returns the
    modules of layer i to fit (swapped in for the originals; a method that replaces a module
    only once it is fitted returns the original itself), and ``stage`` makes each stage's fit
    (see ``Fit``), which may replace its modules. ``corrects``: every fit is a ``_Normals``
    (coefficient changes only), so block outputs recorded before a fit are corrected."""
    offload = offload_of(model)
    reference: list[torch.Tensor] | None = None  # the original model's hidden states (target "model")
    for i, layer, inputs in layerwise(model, batches, arch, "refit (error compensation)", dtype):
        if target == "model" and reference is None:
            reference = list(inputs.hidden)  # layer 0's input is the same in both models
        new = build(i)
        originals = {n: get_module(model, n) for n in new}
        weights = {n: weight_of(m).detach() for n, m in originals.items()}
        for n, module in new.items():
            replace_everywhere(model, originals[n], module)
        offload.refresh([i])  # a basis shared with an earlier layer of its group may rest elsewhere
        ref_inputs = LayerInputs(reference or inputs.hidden, inputs.calls)
        replays = _Replays(layer, arch.layer_name(i) + ".", new)
        pending = dict(new)
        while pending:
            # The layer's first modules read the same input in the compressed and the original
            # layer when the target is the layer: nothing compressed has run before them.
            same = target == "function" or (target == "layer" and len(pending) == len(new))
            first, ref = FirstInput(pending), FirstInput({n: originals[n] for n in pending})
            candidates = replays.ended_by_one(pending)
            ends = _Ends(layer, candidates if corrects else {}, new, low_rank=True)
            ends_ref = _Ends(layer, candidates, originals, low_rank=False)
            fit: Fit | None = None
            for b, (hidden, (args, kwargs)) in enumerate(zip(inputs.hidden, inputs.calls)):
                with replays("compressed", b, pending), ends(b), computing_in(layer, dtype):
                    x = first(layer, hidden, args, kwargs)
                x_ref = None
                if not same:
                    with originals_in(model, originals, new), replays("original", b, pending), ends_ref(b), \
                            computing_in(layer, dtype):
                        x_ref = ref(layer, ref_inputs.hidden[b], args, kwargs)
                if fit is None:
                    names = first.names
                    fit = stage({n: new[n] for n in names}, {n: weights[n] for n in names}, same, x.dtype)
                    first.through = ends.settle(names)
                    # the original stream's block output is needed by later stages or a reference pass
                    needed = not same and (len(pending) > len(names) or target == "model")
                    ref.through = ends_ref.settle(names if needed else [])
                fit.add(x, x_ref)
            replaced, changes = fit.finish()
            for n in first.names:
                del pending[n]
            for n, module in replaced.items():
                replace_everywhere(model, new[n], module)
                new[n] = module
            ends.publish(replays, "compressed", changes)
            ends_ref.publish(replays, "original", {})
        with computing_in(layer, dtype):
            inputs.outputs = run_layer(layer, inputs, lambda b: replays("compressed", b, (), record=False))
        if target == "model":
            with originals_in(model, originals, new), computing_in(layer, dtype):
                reference = run_layer(layer, ref_inputs, lambda b: replays("original", b, (), record=False))
