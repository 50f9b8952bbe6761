"""Layer-by-layer calibration: run calibration text through one decoder layer at a time.

The inputs of decoder layer 0, and the other arguments the model passes each layer (masks,
rotary embeddings: they may differ by layer), are captured once with every layer replaced by a
recorder; then each layer runs alone on the cached hidden states, hooks observe what they need
(Gram matrices, activations), and the layer's outputs become the next layer's inputs.
Each layer is brought to the execution device only while it runs (see ``offload``), and its
statistics go to disk before the next one starts (see ``stats``), so peak memory is one layer,
its statistics and the calibration activations, never the whole model's.

The passes may run in a lower compute dtype than the model's (``calibration.dtype``): each
layer's parameters are cast while it runs and get their own values back after, so the model
itself never changes. The statistics are summed in float64 whatever the compute dtype.

Under ``torchrun`` (several processes with ``torch.distributed`` initialised) every rank runs
its share of the calibration batches and the statistics are summed over ranks with
``all_reduce`` before they are written: the same numbers as one process, computed in parallel.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from torch import nn
from torch.utils._pytree import tree_map
from transformers.cache_utils import Cache

from .. import kernels
from ..io import ui
from ..io.hardware import native_bfloat16
from ..io.offload import model_device, offload_of
from ..model.arch import Arch, discover, replace_linear
from ..model.forms.wscompress_format import CompressedLinear


class _Stop(Exception):
    pass


Call = tuple[tuple, dict]  # what a decoder layer receives besides its hidden states: (args, kwargs)
CACHE_KEYS = ("cache", "past_key_values", "past_key_value", "layer_past", "use_cache")  # "cache": transformers >= 5.2x


@dataclass
class LayerInputs:
    """What enters one decoder layer, one entry per calibration batch: the hidden states and
    the layer's own other arguments (its attention mask and rotary embeddings differ by layer
    type on Gemma3 or sliding-window Qwen2/Mistral; GPT-2 passes its mask positionally)."""

    hidden: list[torch.Tensor]
    calls: list[Call]
    outputs: list[torch.Tensor] | None = None  # set by a caller of ``layerwise`` that computed them


class Stub(nn.Module):
    """Stands in for a module (a decoder layer, an attention block) without computing it.
    Attribute reads the model makes of it (e.g. a layer's ``attention_type``) reach the module."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("layer"), name)


class _Recorder(Stub):
    """Records the arguments the model passes its layer and hands the hidden states on."""

    def __init__(self, layer: nn.Module, calls: list[Call], hidden: list[torch.Tensor] | None, last: bool):
        super().__init__(layer)
        self.calls, self.hidden, self.last = calls, hidden, last

    def forward(self, *args, **kwargs) -> torch.Tensor:
        hidden, args = (args[0], args[1:]) if args else (kwargs.pop("hidden_states"), ())
        args = tuple(None if isinstance(a, Cache) else a for a in args)  # GPT-2 passes its cache positionally
        self.calls.append((args, {k: v for k, v in kwargs.items() if k not in CACHE_KEYS}))
        if self.hidden is not None:
            self.hidden.append(hidden)
        if self.last:
            raise _Stop  # nothing after the layers (final norm, LM head) is needed
        return hidden


class _Replay(Stub):
    """Returns the given hidden states (one a batch, in turn) instead of its layer's output;
    with none given, hands its input on."""

    def __init__(self, layer: nn.Module, hidden: list[torch.Tensor] | None):
        super().__init__(layer)
        self.hidden, self.calls = hidden, 0

    def forward(self, *args, **kwargs) -> torch.Tensor:
        if self.hidden is None:
            return args[0] if args else kwargs["hidden_states"]
        self.calls += 1
        return self.hidden[(self.calls - 1) % len(self.hidden)]


@contextmanager
def start_at(arch: Arch, first: int, hidden: list[torch.Tensor]):
    """Inside the block, a forward of the model skips decoder layers 0..first-1 and feeds layer
    ``first`` the cached ``hidden`` (what enters it, one tensor a batch, for the same batches in
    the same order): a search that changes layers from ``first`` on need not rerun the others."""
    layers = list(arch.layers)
    for i in range(first):
        arch.layers[i] = _Replay(layers[i], hidden if i == first - 1 else None)
    try:
        yield
    finally:
        for i in range(first):
            arch.layers[i] = layers[i]


def compute_dtype(setting: str, model: nn.Module) -> torch.dtype:
    """The dtype the calibration passes run in. ``auto``: bfloat16 for a float32 model where the
    device multiplies bfloat16 natively (the statistics come out the same to the noise, at 2-3x
    the matmul speed), else the model's own."""
    own = next(model.parameters()).dtype
    if setting != "auto":
        return getattr(torch, setting)
    return torch.bfloat16 if own == torch.float32 and native_bfloat16(model_device(model)) else own


@contextmanager
def computing_in(module: nn.Module, dtype: torch.dtype | None) -> Iterator[None]:
    """The module's floating-point parameters in ``dtype`` inside the block, their own tensors
    back after (buffers such as rotary frequencies keep their precision), and in bfloat16 its
    LLaMA-style RMSNorms in one pass (``kernels.rms_norm_forward``). Only for passes that read
    the weights: a change made inside the block is lost."""
    saved = [(p, p.data) for p in module.parameters() if dtype is not None and p.is_floating_point() and p.dtype != dtype]
    norms = [(m, f) for m in module.modules() if dtype == torch.bfloat16 and (f := kernels.rms_norm_forward(m))]
    try:
        for p, data in saved:
            p.data = data.to(dtype)
        for m, forward in norms:  # one pass instead of seven (kernels/norms.cpp)
            m.forward = forward
        yield
    finally:
        for m, _ in norms:
            del m.forward
        for p, data in saved:
            p.data = data


def in_dtype(tree: object, dtype: torch.dtype | None) -> object:
    """``tree`` (hidden states, a layer's arguments) with its floating-point tensors in ``dtype``."""
    if dtype is None:
        return tree
    return tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, tree)


@torch.no_grad()
def capture_inputs(model: nn.Module, arch: Arch, batches: list[torch.Tensor],
                   dtype: torch.dtype | None = None) -> tuple[list[torch.Tensor], list[list[Call]]]:
    """The hidden states entering decoder layer 0 (one tensor a batch) and every layer's own
    other arguments ([layer][batch]), from one pass per batch in which no layer runs; their
    floating-point tensors in ``dtype`` when given."""
    hidden: list[torch.Tensor] = []
    calls: list[list[Call]] = [[] for _ in range(arch.num_layers)]
    layers = list(arch.layers)
    for i, layer in enumerate(layers):
        arch.layers[i] = _Recorder(layer, calls[i], hidden if i == 0 else None, last=i == len(layers) - 1)
    device = model_device(model)
    try:
        for batch in batches:
            try:
                model(input_ids=batch.to(device), use_cache=False)
            except _Stop:
                pass
    finally:
        for i, layer in enumerate(layers):
            arch.layers[i] = layer
    return in_dtype(hidden, dtype), in_dtype(calls, dtype)


@torch.no_grad()
def run_layer(layer: nn.Module, inputs: LayerInputs,
              around: Callable[[int], AbstractContextManager] = lambda _batch: nullcontext()) -> list[torch.Tensor]:
    """Outputs of one decoder layer for every cached batch, batch b run inside ``around(b)``."""
    outs = []
    for b, (hidden, (args, kwargs)) in enumerate(zip(inputs.hidden, inputs.calls)):
        with around(b):
            out = layer(hidden, *args, **kwargs)
        outs.append(out[0] if isinstance(out, tuple) else out)
    return outs


def layerwise(model: nn.Module, batches: list[torch.Tensor], arch: Arch | None = None,
              label: str = "calibration layers", dtype: torch.dtype | None = None, first: int = 0,
              hidden: list[torch.Tensor] | None = None) -> Iterator[tuple[int, nn.Module, LayerInputs]]:
    """Yield (index, layer, its inputs) for each decoder layer in order, the layer onloaded;
    from layer ``first`` on when given ``hidden``, what enters it (one tensor a batch, cached
    by an earlier pass over the same batches), so the layers before it need not run again.

    The caller may observe the layer (hooks) or even replace its weights while it holds it;
    after the caller's step the layer runs on the inputs to produce the next layer's inputs,
    so a layer compressed in the loop feeds the compressed activations forward. A caller that
    computed those outputs itself hands them back in ``inputs.outputs`` and the layer does not
    run again. With ``dtype`` the inputs come in that dtype and the layer runs in it (its own
    weights stay as they are during the caller's step, which runs in what it chooses).
    """
    arch = arch or discover(model)
    offload = offload_of(model)
    if first and hidden is None:
        raise ValueError(f"layerwise from layer {first} needs the hidden states entering it")
    entering, calls = capture_inputs(model, arch, batches, dtype)
    hidden = entering if hidden is None else in_dtype(hidden, dtype)
    for i in ui.track(range(first, arch.num_layers), label):
        with offload.onload([i]):
            layer, inputs = arch.layers[i], LayerInputs(hidden, calls[i])
            yield i, layer, inputs
            if inputs.outputs is None:
                with computing_in(layer, dtype):
                    inputs.outputs = run_layer(layer, inputs)
            hidden = inputs.outputs
        calls[i] = []  # layer i's arguments are done with


def onloaded(model: nn.Module, names: list[str], description: str) -> Iterator[str]:
    """``names`` (modules of ``model``), grouped by the decoder layer they lie in, each yielded
    while its layer is onloaded (``offload``: one layer group in memory at a time, modules outside
    the layers with none), with a progress bar by module: how every method that reads target
    weights walks them, so offload is right by construction."""
    arch, offload = discover(model), offload_of(model)
    groups: dict[int | None, list[str]] = {}
    for name in names:  # a module shared by several layers comes under its first name (see target_layers)
        groups.setdefault(arch.layer_of(name), []).append(name)
    with ui.bar(description, len(names)) as advance:
        for i, group in groups.items():
            with offload.onload([] if i is None else [i]):
                for name in group:
                    try:
                        yield name
                    finally:  # also where the caller, done with this module, closes the loop
                        advance()


def replace_each(model: nn.Module, layers: dict[str, nn.Module], make: Callable[[str, nn.Module], CompressedLinear],
                 description: str) -> None:
    """Replace each linear of ``layers`` (name -> module) by ``make(name, module)``, its compressed
    form, one decoder layer at a time (``onloaded``); a head tied to the input embedding stays one
    table with it (``replace_linear``)."""
    for name in onloaded(model, list(layers), description):
        replace_linear(model, layers[name], make(name, layers[name]))

