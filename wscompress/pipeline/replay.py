"""What keeps ``refit.fit_pass`` from running a layer more than it must, apart from the
algorithm it serves.

A stage of the pass needs its modules' input only: ``FirstInput`` runs the layer as far as that
input and stops. A block whose modules are all fitted (the attention block once o is) neither
changes its input nor its weights again: ``Replays`` records its output the first time a later
stage runs it and hands the record back after. A block that one module ends (o, down) is
recorded by ``Ends`` while that module's own stage runs; a low-rank refit changes only the
module's coefficients, so the record is corrected by the change (out + basis(x)·(C − C₀)ᵀ) and
the block never runs again.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from typing import Collection, Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from .layerwise import Stub


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
        self.through = False  # later batches run on (to where an Ends stops them)

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


class _Saved(Stub):
    """Returns a recorded output instead of computing its module."""

    def __init__(self, module: nn.Module, out: object):
        super().__init__(module)
        self.out = out

    def forward(self, *_args, **_kwargs) -> object:
        return _copy(self.out)  # a copy: the layer may change what it gets in place


def _copy(out: object) -> object:
    return tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, out)


class Replays:
    """Outputs of a layer's blocks (its direct children, e.g. the attention block) whose
    fitted modules are all done, recorded the first time a stage runs them and replayed by
    the stages after, one per stream ("compressed", "original") and batch. Their inputs do not
    change either: a block that has finished ran wholly before the modules still pending."""

    def __init__(self, layer: nn.Module, prefix: str, new: Iterable[str]):
        self.layer = layer
        self.owns: dict[str, set[str]] = {}  # block -> its fitted modules
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


class Ends:
    """Outputs of the block that a stage's module ends (its output is the block's output, as o
    ends the attention block and down the MLP), recorded while that stage runs so that no later
    pass runs the block again. With ``low_rank`` the record still has the old coefficients C₀;
    once the module is refit, out + basis(x)·(C − C₀)ᵀ is the new output (basis and bias stay).
    The first batch records every block that has one pending module; once the stage's group is
    known, later batches record its block only and stop at the block's end."""

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

    def publish(self, replays: Replays, stream: str, changes: dict[str, torch.Tensor]) -> None:
        """Hand the records, corrected by the coefficient ``changes`` (C − C₀), to ``replays``."""
        for (block, batch), (leaves, spec, at, z) in self.saved.items():
            if z is not None:
                leaves[at] += F.linear(z, changes[self.candidates[block]].to(z.dtype))
            replays.saved[stream, block, batch] = tree_unflatten(leaves, spec)
