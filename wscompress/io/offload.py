"""Where the decoder layers wait while they are not used (recipe key ``model.offload``).

- ``none``: the whole model sits on the execution device (the default; nothing moves).
- ``cpu``: the model stays in CPU memory and the layers in use are moved to the execution
  device and back: a GPU holds one layer group plus the activations, whatever the depth.
- ``disk``: the decoder layers' tensors stay in safetensors files (the checkpoint's own, or
  spill files for layers a stage changed) and are read when a layer is used; in memory they
  are empty ``meta`` tensors. Memory then holds the embeddings, the head and one layer group.

The layer-by-layer pipeline (``pipeline.layerwise``) and the methods' per-group steps bring
layers in with ``onload``; plain forward passes over an offloaded model (evaluation,
generation) go through ``running``, whose hooks bring each layer in as the model reaches it.
A layer used by several callers at once (nested ``onload``) leaves when the last one is done,
and a module shared between layers (a shared basis) stays while any layer using it is loaded.
"""

from __future__ import annotations

import itertools
import shutil
import tempfile
import weakref
from contextlib import ExitStack, contextmanager
from functools import cached_property
from pathlib import Path
from typing import Iterable, Iterator, Literal

import torch
from safetensors import safe_open
from torch import nn

from ..model.arch import Arch, discover
from . import ui
from .files import save_tensors
from .memory import file_backed, page_out

Mode = Literal["none", "cpu", "disk"]
Slot = tuple[nn.Module, str]  # a module and the leaf name of one of its tensors


class Offload:
    """Moves decoder layers between their resting place and the execution device ``device``."""

    def __init__(self, model: nn.Module, mode: Mode, device: torch.device, folder: str | Path | None = None):
        self.model, self.mode, self.device = model, mode, torch.device(device)
        self.home = _Slots()  # disk: where each tensor rests (file, name in it)
        self._version = _Slots()  # disk: tensor versions when loaded (an in-place change bumps them)
        self._users: dict[int, int] = {}  # layer -> how many open onloads hold it
        self._spills = itertools.count()
        self.folder: Path | None = None
        if mode == "disk":
            parent, made = _made(folder)
            self.folder = Path(tempfile.mkdtemp(prefix="offload-", dir=parent))
            weakref.finalize(self, _remove, self.folder, parent if made else None)

    @cached_property
    def arch(self) -> Arch:
        return discover(self.model)

    @property
    def moves(self) -> bool:
        """Whether onloading does anything (it does not when the layers already sit on the device)."""
        return self.mode == "disk" or (self.mode == "cpu" and self.device.type != "cpu")

    # -------------------------------------------------------------- bringing layers in and out

    @contextmanager
    def onload(self, layers: Iterable[int]) -> Iterator[None]:
        """The decoder layers ``layers`` with real tensors on the execution device inside the block."""
        layers = list(dict.fromkeys(layers))
        for i in layers:
            self._enter(i)
        try:
            yield
        finally:
            for i in reversed(layers):
                self._exit(i)

    def _enter(self, i: int) -> None:
        self._users[i] = self._users.get(i, 0) + 1
        if self._users[i] == 1 and self.moves:
            self._bring(self.arch.layers[i])

    def _exit(self, i: int) -> None:
        self._users[i] -= 1
        if self._users[i] == 0 and self.moves:
            busy = {id(m) for j, n in self._users.items() if n and j != i for m in self.arch.layers[j].modules()}
            self._send(self.arch.layers[i], busy, f"layer{i}")

    def groups(self, groups: list[list[int]], label: str) -> Iterator[list[int]]:
        """Each layer group in turn, onloaded while the caller works on it."""
        for group in ui.track(groups, label):
            with self.onload(group):
                yield group

    def refresh(self, layers: Iterable[int]) -> None:
        """After modules were swapped into onloaded layers: bring whatever of theirs rests elsewhere
        (a module shared with a layer that has left, e.g. a basis shared by a group)."""
        if self.moves:
            for i in layers:
                self._bring(self.arch.layers[i])

    @contextmanager
    def running(self) -> Iterator[None]:
        """Inside the block a forward pass of the model onloads each decoder layer as it runs it."""
        if not self.moves:
            yield
            return
        with ExitStack() as stack:
            for i, layer in enumerate(self.arch.layers):
                stack.callback(layer.register_forward_pre_hook(lambda *_a, i=i: self._enter(i)).remove)
                stack.callback(layer.register_forward_hook(lambda *_a, i=i: self._exit(i)).remove)
            yield

    def _bring(self, layer: nn.Module) -> None:
        if self.mode == "cpu":
            layer.to(self.device)
            return
        files: dict[str, safe_open] = {}
        with ExitStack() as stack:
            def read(slot: Slot, meta: torch.Tensor) -> torch.Tensor:
                file, name = self.home[slot]
                if file not in files:
                    files[file] = stack.enter_context(safe_open(file, "pt", backend="pread"))
                return files[file].get_tensor(name).to(device=self.device, dtype=meta.dtype)

            for slot in _replace(layer, lambda slot, t: t.is_meta, read):
                self._version[slot] = _tensor(slot)._version

    def _send(self, layer: nn.Module, busy: set[int], label: str) -> None:
        if self.mode == "cpu":
            for m in layer.modules():
                if id(m) not in busy:
                    _to(m, torch.device("cpu"))
            return
        new = {slot: t for m in layer.modules() if id(m) not in busy for slot, t in _slots(m)
               if not t.is_meta and (slot not in self.home or t._version != self._version.get(slot))}
        if new:  # a stage changed these: they rest in a spill file from now on
            file = str(self.folder / f"{label}-{next(self._spills)}.safetensors")
            names = {slot: f"{i}.{slot[1]}" for i, slot in enumerate(new)}
            save_tensors({names[s]: t for s, t in new.items()}, file)
            self.home.update({s: (file, names[s]) for s in new})
        keep = lambda slot, t: id(slot[0]) not in busy and not t.is_meta  # noqa: E731
        _replace(layer, keep, lambda _slot, t: torch.empty_like(t, device="meta"))

    # -------------------------------------------------------------- disk: adopting files

    def adopt(self, files: list[Path]) -> None:
        """Rest the decoder layers in ``files`` (safetensors): every layer tensor found there under
        its name (a shared module's first name) and shape is read from there when needed; the
        others (converted on loading, or not in the files) are spilled once."""
        found: dict[str, tuple[str, tuple]] = {}
        for file in files:
            with safe_open(str(file), "pt") as f:
                found.update((k, (str(file), tuple(f.get_slice(k).get_shape()))) for k in f.keys())
        for name, module in self.model.named_modules(remove_duplicate=False):
            if not name.startswith(self.arch.layers_path + "."):
                continue
            for leaf, t in _tensors(module):
                hit = found.get(f"{name}.{leaf}")
                if hit is not None and hit[1] == tuple(t.shape) and (module, leaf) not in self.home:
                    self.home[(module, leaf)] = (hit[0], f"{name}.{leaf}")
                    self._version[(module, leaf)] = t._version
        for i, layer in enumerate(self.arch.layers):
            self._send(layer, set(), f"layer{i}")


class _Slots:
    """A map slot -> value that holds the modules weakly: a module a stage swapped out (with the
    tensors it had onloaded) is freed with its last other reference instead of being kept alive
    by this bookkeeping, which would keep every replaced layer's weights in memory."""

    def __init__(self):
        self._of: weakref.WeakKeyDictionary[nn.Module, dict[str, object]] = weakref.WeakKeyDictionary()

    def __contains__(self, slot: Slot) -> bool:
        return slot[1] in self._of.get(slot[0], ())

    def __getitem__(self, slot: Slot):
        return self._of[slot[0]][slot[1]]

    def __setitem__(self, slot: Slot, value) -> None:
        self._of.setdefault(slot[0], {})[slot[1]] = value

    def get(self, slot: Slot, default=None):
        return self._of.get(slot[0], {}).get(slot[1], default)

    def update(self, items: dict[Slot, object]) -> None:
        for slot, value in items.items():
            self[slot] = value


def _made(folder: str | Path | None) -> tuple[Path | None, bool]:
    """``folder``, created where missing, and whether this call created it."""
    if folder is None:
        return None, False
    made = not Path(folder).exists()
    Path(folder).mkdir(parents=True, exist_ok=True)
    return Path(folder), made


def _remove(folder: Path, made: Path | None) -> None:
    """The spill folder, and its parent where this run created it and nothing else is left there."""
    shutil.rmtree(folder, ignore_errors=True)
    if made is not None:
        try:
            made.rmdir()
        except OSError:  # another run's spills, or the user's files
            pass


def _tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The module's own parameters and buffers (not its children's)."""
    return [(k, t) for k, t in itertools.chain(module._parameters.items(), module._buffers.items()) if t is not None]


def _slots(module: nn.Module) -> list[tuple[Slot, torch.Tensor]]:
    return [((module, leaf), t) for leaf, t in _tensors(module)]


def _tensor(slot: Slot) -> torch.Tensor:
    module, leaf = slot
    return module._parameters[leaf] if leaf in module._parameters else module._buffers[leaf]


def _to(module: nn.Module, device: torch.device) -> None:
    """Move the module's own tensors (not its children's), keeping parameter objects."""
    for leaf, t in _tensors(module):
        if leaf in module._parameters:
            t.data = t.data.to(device)
        else:
            module._buffers[leaf] = t.to(device)


def _set(module: nn.Module, leaf: str, value: torch.Tensor) -> None:
    if leaf in module._parameters:
        old = module._parameters[leaf]
        module._parameters[leaf] = nn.Parameter(value, requires_grad=old.requires_grad)
    else:
        module._buffers[leaf] = value


def _replace(layer: nn.Module, which, make) -> list[Slot]:
    """Give each tensor of ``layer`` for which ``which(slot, tensor)`` holds the tensor ``make(slot,
    tensor)``; a tensor reachable from several modules stays one object. Returns the slots changed."""
    done: dict[int, torch.Tensor] = {}
    changed = []
    for m in {id(m): m for m in layer.modules()}.values():
        for leaf, t in _tensors(m):
            if which((m, leaf), t):
                if id(t) not in done:
                    _set(m, leaf, make((m, leaf), t))
                    done[id(t)] = _tensor((m, leaf))
                elif leaf in m._parameters:
                    m._parameters[leaf] = done[id(t)]
                else:
                    m._buffers[leaf] = done[id(t)]
                changed.append((m, leaf))
    return changed


def prepare(model: nn.Module, mode: Mode, device: torch.device, files: list[Path] = (),
            folder: str | Path | None = None) -> None:
    """Set up a model loaded on the CPU for ``mode``: everything outside the decoder layers goes
    to ``device``; the layers stay on the CPU (``cpu``) or rest in ``files`` and spill files
    (``disk``); ``none`` moves the whole model to ``device``."""
    if mode != "disk":
        own_memory(model)
    if mode == "none":
        model.to(device)
        return
    offload = Offload(model, mode, device, folder)
    inside = offload.arch.layers_path
    for name, m in model.named_modules():
        if not (name == inside or name.startswith(inside + ".")):
            _to(m, offload.device)
    if mode == "disk":
        offload.adopt(list(files))
        embed, head = model.get_input_embeddings(), model.get_output_embeddings()
        if (head is None or head.weight is not embed.weight) and file_backed(embed.weight):
            # a lookup reads a few rows, but the kernel's read-ahead maps most of the table in
            # (380 MB of a 1B model's 400 MB for 1024 tokens): hand its pages back after each
            # forward (a tied table is read whole by the head anyway)
            embed.register_forward_hook(lambda m, _args, _out: page_out(m.weight))
    model.__dict__["wscompress_offload"] = offload


def own_memory(model: nn.Module) -> None:
    """Copy every tensor that still lives in the checkpoint's memory map (transformers maps
    safetensors files) into the process's own memory, handing the mapped pages back as it goes.
    Mapped pages stay resident while any tensor of the file lives, so a weight a stage replaced
    would otherwise keep its memory until the embeddings die too."""
    for t in [*model.parameters(), *model.buffers()]:
        if t.device.type == "cpu" and t.numel():
            old = t.data
            t.data = old.clone()
            page_out(old)


def offload_of(model: nn.Module) -> Offload:
    """The model's offloader (its recipe's ``model.offload``); one that moves nothing by default."""
    found = model.__dict__.get("wscompress_offload")
    if found is not None:
        return found
    return Offload(model, "none", next(model.parameters()).device)


def model_device(model: nn.Module) -> torch.device:
    """The device the model computes on (with offloaded layers: where they are brought to)."""
    offload = model.__dict__.get("wscompress_offload")
    return offload.device if offload is not None else next(model.parameters()).device
