"""Layer-by-layer calibration: run calibration text through one decoder layer at a time.

The inputs of decoder layer 0, and the other arguments the model passes each layer (masks,
rotary embeddings: they may differ by layer), are captured once with every layer replaced by a
recorder; then each layer runs alone on the cached hidden states, hooks observe what they need
(Gram matrices, activations), and the layer's outputs become the next layer's inputs.
Peak memory is one layer plus the calibration activations, never the whole model's.
"""

from __future__ import annotations

import hashlib
import json
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn
from transformers.cache_utils import Cache

from . import linalg, ui
from .arch import Arch, discover, first_names, get_module, is_linear, weight_of
from .errors import UsageError
from .model import model_device


class _Stop(Exception):
    pass


Call = tuple[tuple, dict]  # what a decoder layer receives besides its hidden states: (args, kwargs)
CACHE_KEYS = ("past_key_values", "past_key_value", "layer_past", "use_cache")


@dataclass
class LayerInputs:
    """What enters one decoder layer, one entry per calibration batch: the hidden states and
    the layer's own other arguments (its attention mask and rotary embeddings differ by layer
    type on Gemma3 or sliding-window Qwen2/Mistral; GPT-2 passes its mask positionally)."""

    hidden: list[torch.Tensor]
    calls: list[Call]


class _Stub(nn.Module):
    """Stands in for a decoder layer without computing it. Attribute reads the model makes of
    its layers (e.g. ``attention_type``) reach the layer."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("layer"), name)


class _Recorder(_Stub):
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


class _Replay(_Stub):
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


@torch.no_grad()
def capture_inputs(model: nn.Module, arch: Arch, batches: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[list[Call]]]:
    """The hidden states entering decoder layer 0 (one tensor a batch) and every layer's own
    other arguments ([layer][batch]), from one pass per batch in which no layer runs."""
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
    return hidden, calls


@torch.no_grad()
def run_layer(layer: nn.Module, inputs: LayerInputs) -> list[torch.Tensor]:
    """Outputs of one decoder layer for every cached batch."""
    outs = []
    for hidden, (args, kwargs) in zip(inputs.hidden, inputs.calls):
        out = layer(hidden, *args, **kwargs)
        outs.append(out[0] if isinstance(out, tuple) else out)
    return outs


def layerwise(model: nn.Module, batches: list[torch.Tensor], arch: Arch | None = None,
              label: str = "calibration layers") -> Iterator[tuple[int, nn.Module, LayerInputs]]:
    """Yield (index, layer, its inputs) for each decoder layer in order.

    The caller may observe the layer (hooks) or even replace its weights while it holds it;
    after the caller's step the layer runs on the inputs to produce the next layer's inputs,
    so a layer compressed in the loop feeds the compressed activations forward.
    """
    arch = arch or discover(model)
    hidden, calls = capture_inputs(model, arch, batches)
    for i in ui.track(range(arch.num_layers), label):
        layer, inputs = arch.layers[i], LayerInputs(hidden, calls[i])
        yield i, layer, inputs
        hidden = run_layer(layer, inputs)
        calls[i] = []  # layer i's arguments are done with


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
            g = linalg.gram(x.reshape(-1, x.shape[-1]))
            self.grams[name] = self.grams[name] + g if name in self.grams else g
        return hook

    def close(self) -> None:
        self._stack.close()
        self._seen.clear()


@torch.no_grad()
def collect_grams(model: nn.Module, batches: list[torch.Tensor], names: list[str]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Gram matrices of the inputs of the named linear modules, layer by layer.

    The hooks observe the pass that ``layerwise`` makes anyway to feed the next layer, so
    every layer runs once per batch. Returns (canonical name -> Gram (float64, on CPU),
    module name -> canonical name).
    """
    arch = discover(model)
    grams: dict[str, torch.Tensor] = {}
    owner: dict[str, str] = {}
    hook: GramHook | None = None

    def harvest() -> None:
        hook.close()
        grams.update({k: v.cpu() for k, v in hook.grams.items()})
        owner.update(hook.owner)

    try:
        for i, _layer, _inputs in layerwise(model, batches, arch, label="calibration (Gram)"):
            if hook is not None:
                harvest()  # layer i - 1 has run on every batch
            prefix = arch.layer_name(i) + "."
            mine = {n: get_module(model, n) for n in names if n.startswith(prefix)}
            hook = GramHook(mine) if mine else None
        if hook is not None:
            harvest()
    finally:
        if hook is not None:
            hook.close()
    outside = [n for n in names if n not in owner]
    if outside:
        raise UsageError(f"calibration covers decoder-layer linears only; {outside[0]} is outside the layers",
                         "drop it from the stage's targets")
    return grams, owner


def shared_grams(model: nn.Module, names: list[str], grams: dict[str, torch.Tensor], owner: dict[str, str]) -> dict[str, torch.Tensor]:
    """First name -> the Gram matrix of every use of that module: the sum over all the names
    that reach it (a module an earlier stage, e.g. cross_layer, shares between layers is fed
    by each of them)."""
    out: dict[str, torch.Tensor] = {}
    seen: set[tuple[str, str]] = set()
    for name, first in first_names(model, names).items():
        if (first, owner[name]) not in seen:  # q/k/v of one layer read one Gram: count it once
            seen.add((first, owner[name]))
            out[first] = out[first] + grams[owner[name]] if first in out else grams[owner[name]]
    return out


def output_sensitivity(model: nn.Module, names: list[str], batches: list[torch.Tensor], samples: int) -> dict[str, float]:
    """Fisher-style sensitivity of each named linear: the mean over calibration tokens and output
    channels of (∂L/∂y)², L a sequence's mean next-token loss and y the module's output, from
    ``samples`` calibration sequences. An error δ in that output raises the loss by about
    ½·sensitivity·‖δ‖², so it converts a module's output error into model loss.

    Needs one forward and backward of the whole model per sequence (the weights get no
    gradients); a module used by several layers sums over its uses.
    """
    modules = {n: get_module(model, n) for n in names}
    sums = {id(m): torch.zeros((), dtype=torch.float64) for m in modules.values()}
    stack = ExitStack()

    def observe(module, _args, out):
        def grad_hook(g):
            sums[id(module)] += g.detach().double().pow(2).sum().cpu() / g.shape[-1]
        out.register_hook(grad_hook)

    for m in {id(m): m for m in modules.values()}.values():
        stack.callback(m.register_forward_hook(observe).remove)
    emb = model.get_input_embeddings()  # a graph without weight gradients: start it at the embeddings
    stack.callback(emb.register_forward_hook(lambda _m, _a, out: out.detach().requires_grad_()).remove)
    grad_state = {p: p.requires_grad for p in model.parameters()}
    device = model_device(model)
    tokens = 0
    try:
        for p in grad_state:
            p.requires_grad_(False)
        rows = torch.cat(batches)[:samples]
        for ids in rows.to(device).split(1):  # one sequence at a time: the backward holds every activation
            logits = model(input_ids=ids, use_cache=False).logits[0, :-1].float()
            torch.nn.functional.cross_entropy(logits, ids[0, 1:]).backward()
            tokens += ids.numel()
    finally:
        stack.close()
        for p, state in grad_state.items():
            p.requires_grad_(state)
    return {n: (sums[id(m)] / tokens).item() for n, m in modules.items()}


def fingerprint(model: nn.Module) -> str:
    """Identifies a model's weights: config plus a checksum of a few tensors."""
    h = hashlib.sha256(json.dumps(model.config.to_diff_dict(), sort_keys=True, default=str).encode())
    arch = discover(model)
    for name in list(arch.projections(0).values())[:2] + [arch.embedding_name]:
        module = get_module(model, name)
        w = (weight_of(module) if is_linear(module) else module.weight).detach().double()  # compressed layers too
        # float64 sums: the same digits whatever the thread count's reduction order
        h.update(f"{w.sum().item():.6e}:{w.abs().sum().item():.6e}".encode())
    return h.hexdigest()[:16]


def save_grams(path: str | Path, grams: dict[str, torch.Tensor], owner: dict[str, str], meta: dict,
               sensitivity: dict[str, float] | None = None) -> None:
    """Write the Gram matrices (and, when given, the output sensitivities) with ``meta``
    identifying the model and calibration data they were computed on."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tensors = {f"gram.{k}": v.contiguous() for k, v in grams.items()}
    tensors.update({f"sensitivity.{k}": torch.tensor(v, dtype=torch.float64) for k, v in (sensitivity or {}).items()})
    save_file(tensors, tmp, metadata={"wscompress": json.dumps({**meta, "owner": owner})})
    tmp.replace(path)


def _unreadable(path: str | Path, err: Exception) -> UsageError:
    return UsageError(f"calibration file {path} is unreadable: {err}", "delete it and run `wscompress calibrate` again")


def _read_meta(path: str | Path, expect: dict) -> dict:
    """The file's metadata, refusing statistics computed for another model or calibration set."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), "pt") as f:
            meta = json.loads((f.metadata() or {}).get("wscompress", "{}"))
    except (OSError, SafetensorError, json.JSONDecodeError) as err:
        raise _unreadable(path, err) from None
    for key, want in expect.items():
        if meta.get(key) != want:
            raise UsageError(f"calibration file {path} was made with {key}={meta.get(key)!r}, this run has {want!r}",
                             "run `wscompress calibrate` for this model and calibration set, or remove the file")
    return meta


def load_grams(path: str | Path, expect: dict) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Load saved Gram matrices, refusing ones computed for another model or calibration set."""
    meta = _read_meta(path, expect)
    try:
        tensors = load_file(str(path))
    except (OSError, SafetensorError) as err:
        raise _unreadable(path, err) from None
    grams = {k.removeprefix("gram."): v for k, v in tensors.items() if k.startswith("gram.")}
    return grams, meta.get("owner", {})


def load_sensitivity(path: str | Path, expect: dict) -> dict[str, float]:
    """Saved output sensitivities (empty when the file has none), refusing a mismatched file;
    ``expect`` includes the number of sequences they were computed on."""
    from safetensors import safe_open

    _read_meta(path, expect)
    with safe_open(str(path), "pt") as f:
        return {k.removeprefix("sensitivity."): f.get_tensor(k).item() for k in f.keys() if k.startswith("sensitivity.")}
