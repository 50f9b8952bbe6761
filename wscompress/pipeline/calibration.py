"""Calibration statistics, layer by layer: the Gram matrices of every decoder-layer linear's inputs
(XᵀX, float64, streamed to disk a layer at a time), the output sensitivities that rank
allocation weighs errors by, and the per-token output gradients that k-means' ``objective:
fisher`` weighs its Gram matrices by (both from one backward sweep, ``_backward_sweep``)."""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import UsageError
from ..io import ui
from ..io.data import first_samples
from ..io.distributed import barrier, reduced, world
from ..io.offload import offload_of
from ..maths import linalg
from ..model.arch import Arch, discover, get_module
from .layerwise import LayerInputs, capture_inputs, computing_in, layerwise, run_layer, start_at
from .stats import Stats, StatsWriter, scratch_folder


class GramHook:
    """Accumulates X^T X (float64) of a module's inputs; modules fed the very same tensor
    (q/k/v, gate/up) are detected by pointer and share one accumulator."""

    def __init__(self, modules: dict[str, nn.Module]):
        self.grams: dict[str, torch.Tensor] = {}
        self.owner: dict[str, str] = {}  # module name -> name whose Gram it shares
        self._seen: dict[int, tuple[str, torch.Tensor]] = {}  # holding x keeps its address unique
        self._last: dict[str, int] = {}  # name -> key of the last input it owned (only that one is held)
        self._stack = ExitStack()
        for name, module in modules.items():
            self._stack.callback(module.register_forward_hook(self._hook(name)).remove)

    def _hook(self, name: str) -> Callable:
        def hook(_module, args, _out):
            x = args[0]
            key = x.data_ptr()
            if key in self._seen and self._seen[key][0] != name:
                self.owner.setdefault(name, self._seen[key][0])
                return
            self._seen.pop(self._last.get(name), None)  # the previous batch's input is done with
            self._seen[key], self._last[name] = (name, x), key
            self.owner.setdefault(name, name)
            self.grams[name] = linalg.add_gram(self.grams.get(name), x.reshape(-1, x.shape[-1]))  # lower triangle
        return hook

    def close(self) -> dict[str, torch.Tensor]:
        """Stop observing; returns the Gram matrices (canonical name -> XᵀX)."""
        self._stack.close()
        self._seen.clear()
        return {k: linalg.symmetrize(v) for k, v in self.grams.items()}



@torch.no_grad()
def collect_grams(model: nn.Module, batches: list[torch.Tensor], names: list[str], folder: str | Path | None = None,
                  meta: dict | None = None, sensitivity_samples: int = 0, scratch: bool | None = None,
                  dtype: torch.dtype | None = None) -> Stats:
    """Gram matrices of the inputs of the named linear modules (and, with
    ``sensitivity_samples``, their output sensitivities), layer by layer, written to ``folder``
    one layer at a time (default: a scratch folder), the layers run in ``dtype`` (default: the
    model's). With ``scratch`` (default: no folder given) the folder is deleted with the
    returned ``Stats``.

    The hooks observe the pass that ``layerwise`` makes anyway to feed the next layer, so
    every layer runs once per batch. Under torchrun each rank runs ``batches[rank::world]``.
    """
    arch = discover(model)
    rank, size = world()
    meta = {**(meta or {}), **({"sensitivity_samples": sensitivity_samples} if sensitivity_samples else {})}
    writer = StatsWriter(folder or scratch_folder(), meta)
    hook: GramHook | None = None
    done: set[str] = set()

    def harvest(i: int) -> None:
        grams = {k: reduced(v) for k, v in sorted(hook.close().items())}  # the same order on every rank
        if rank == 0:
            writer.layer(i, grams, hook.owner)
        done.update(hook.owner)

    # The sensitivity pass's first chunk is batch 0 (one process): its forward is this pass's.
    first: list[LayerInputs] | None = [] if sensitivity_samples >= len(batches[0]) and size == 1 else None
    try:
        for i, _layer, inputs in layerwise(model, batches[rank::size], arch, "calibration (Gram)", dtype):
            if hook is not None:
                harvest(i - 1)  # layer i - 1 has run on every batch
            prefix = arch.layer_name(i) + "."
            mine = {n: get_module(model, n) for n in names if n.startswith(prefix)}
            hook = GramHook(mine) if mine else None
            if first is not None:
                first.append(LayerInputs(inputs.hidden[:1], inputs.calls[:1]))
        if hook is not None:
            harvest(arch.num_layers - 1)
            hook = None
    finally:
        if hook is not None:  # interrupted: stop observing
            hook.close()
    outside = [n for n in names if n not in done]
    if outside:
        raise UsageError(f"calibration covers decoder-layer linears only; {outside[0]} is outside the layers",
                         "drop it from the stage's targets")
    forward = (first, inputs.outputs[:1]) if first else None  # layerwise ran the last layer on its inputs
    del inputs  # the last layer's outputs for every batch
    sensitivity = output_sensitivity(model, names, batches, sensitivity_samples, dtype, forward) if sensitivity_samples else {}
    if rank == 0:
        writer.finish(sensitivity)
    barrier()  # the folder is complete for every rank
    return Stats(writer.folder, scratch=folder is None if scratch is None else scratch)



def output_sensitivity(model: nn.Module, names: list[str], batches: list[torch.Tensor], samples: int,
                       dtype: torch.dtype | None = None,
                       forward: tuple[list[LayerInputs], list[torch.Tensor]] | None = None) -> dict[str, float]:
    """Fisher-style sensitivity of each named linear: the mean over calibration tokens and output
    channels of (∂L/∂y)², L a sequence's mean next-token loss and y the module's output, from the
    first ``samples`` calibration sequences. An error δ in that output raises the loss by about
    ½·sensitivity·‖δ‖², so it converts a module's output error into model loss. Under torchrun
    each rank takes its share of the sequences. ``forward``, when given, is the first chunk's
    forward already run (every layer's inputs, the last one's output), as the Gram pass runs it
    for its first batch.
    """
    modules = {n: get_module(model, n) for n in names}
    sums = {id(m): torch.zeros((), dtype=torch.float64) for m in modules.values()}
    rank, size = world()
    rows = first_samples(batches, samples)
    tokens = sum(b.numel() for b in rows)

    def square(module: nn.Module, g: torch.Tensor, _chunk: int) -> None:
        sums[id(module)].add_(torch.linalg.vector_norm(g, dtype=torch.float64).cpu() ** 2 / g.shape[-1])

    _backward_sweep(model, modules, torch.cat(rows)[rank::size].split(len(rows[0])), dtype, square, "output sensitivity",
                    forward)
    return {n: reduced(sums[id(m)]).item() / tokens for n, m in modules.items()}


def output_fisher(model: nn.Module, blocks: dict[str, int], batches: list[torch.Tensor],
                  dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Per token and block of output channels, Σ (∂L/∂y)² over the block's channels (L a
    sequence's mean next-token loss): for each named linear, split into ``blocks[name]`` equal
    blocks of rows, a (tokens, blocks) float32 tensor, tokens in the order of ``batches``
    flattened. Weighting each token's input by it turns a block's Gram matrix into the block's
    share of the loss's Fisher (GuidedQuant), which is what rounding should minimise. One
    process (every sequence); a module used by several layers sums over its uses."""
    modules = {n: get_module(model, n) for n in blocks}
    count = {id(m): blocks[n] for n, m in modules.items()}
    starts = [0]
    for b in batches:
        starts.append(starts[-1] + b.numel())
    out = {id(m): torch.zeros(starts[-1], blocks[n]) for n, m in modules.items()}

    def square(module: nn.Module, g: torch.Tensor, c: int) -> None:
        part = g.float().reshape(-1, count[id(module)], g.shape[-1] // count[id(module)]).pow(2).sum(-1)
        out[id(module)][starts[c]:starts[c + 1]] += part.cpu()

    _backward_sweep(model, modules, batches, dtype, square, "output gradients (fisher)")
    return {n: out[id(m)] for n, m in modules.items()}


def _backward_sweep(model: nn.Module, modules: dict[str, nn.Module], chunks, dtype: torch.dtype | None,
                    on_grad: Callable[[nn.Module, torch.Tensor, int], None], label: str,
                    forward: tuple[list[LayerInputs], list[torch.Tensor]] | None = None) -> None:
    """``on_grad(module, ∂L/∂y, c)`` for every named module's output y on chunk c of sequences,
    L each sequence's mean next-token loss. Computed layer by layer like the statistics, so
    memory holds one layer, not the model: a forward pass keeps every layer's inputs for the
    chunk, the loss's gradient is taken at the last layer's output (one sequence at a time
    through the head), and the backward walks the layers in reverse, recomputing one layer at a
    time and passing the gradient at its input on. The weights get no gradients. The layers run
    in ``dtype`` (default: the model's), the head in the model's. ``label``: the progress bar's;
    ``forward``: the first chunk's forward already run."""
    arch = discover(model)
    offload = offload_of(model)
    chunk_at = [0]

    def observe(module, _args, out):
        if out.requires_grad:  # only in the backward sweep's recomputation
            c = chunk_at[0]
            out.register_hook(lambda g: on_grad(module, g.detach(), c))

    with ExitStack() as stack:
        for m in {id(m): m for m in modules.values()}.values():
            stack.callback(m.register_forward_hook(observe).remove)
        stack.enter_context(frozen(model))  # a graph without weight gradients
        for c, chunk in enumerate(ui.track(chunks, label)):
            chunk_at[0] = c
            if c == 0 and forward:
                inputs, hidden = forward
            else:
                hidden, calls = capture_inputs(model, arch, [chunk], dtype)
                inputs = []
                with torch.no_grad():
                    for i in range(arch.num_layers):
                        inputs.append(LayerInputs(hidden, calls[i]))
                        with offload.onload([i]), computing_in(arch.layers[i], dtype):
                            hidden = run_layer(arch.layers[i], inputs[-1])
            grad = torch.cat([_head_gradient(model, arch, ids, h) for ids, h in zip(chunk.split(1), hidden[0].split(1))])
            for i in reversed(range(arch.num_layers)):
                with offload.onload([i]), computing_in(arch.layers[i], dtype), torch.enable_grad():
                    x = inputs[i].hidden[0].detach().requires_grad_()
                    args, kwargs = inputs[i].calls[0]
                    out = arch.layers[i](x, *args, **kwargs)
                    (grad,) = torch.autograd.grad(out[0] if isinstance(out, tuple) else out, x, grad)
                inputs[i] = None  # done with


def _head_gradient(model: nn.Module, arch: Arch, ids: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """∂L/∂(last decoder layer's output) for one sequence, L its mean next-token loss: the model
    runs from the cached output ``last`` on (final norm, LM head, in the model's dtype) with no
    weight gradients; the gradient comes in ``last``'s dtype."""
    x = last.detach().to(next(model.parameters()).dtype).requires_grad_()
    with torch.enable_grad(), start_at(arch, arch.num_layers, [x]):
        logits = model(input_ids=ids.to(x.device), use_cache=False).logits[0, :-1].float()
        return torch.autograd.grad(F.cross_entropy(logits, ids[0, 1:].to(logits.device)), x)[0].to(last.dtype)



@contextmanager
def frozen(model: nn.Module) -> Iterator[None]:
    """No parameter requires a gradient inside the block (each gets its setting back after)."""
    state = {p: p.requires_grad for p in model.parameters()}
    try:
        for p in state:
            p.requires_grad_(False)
        yield
    finally:
        for p, wanted in state.items():
            p.requires_grad_(wanted)
