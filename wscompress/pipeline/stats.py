"""Calibration statistics on disk, one decoder layer a file.

The layer-by-layer calibration pass streams them into a folder as it goes:
``layer-NNNN.safetensors`` holds the Gram matrices XᵀX (float64) of that layer's linear inputs,
and ``stats.json`` what they were computed on (model fingerprint, calibration settings), which
module reads which Gram matrix and the output sensitivities. Only one layer's matrices are in
memory while they are written, and readers load one matrix at a time, so the statistics of a
70B model take no more memory than one layer's. ``wscompress calibrate`` keeps the folder
(``<out>/calibration``) for later compress runs; a stage that computes its own statistics
writes them to a scratch folder that is deleted with the ``Stats`` object.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import shutil
import tempfile
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import Iterator

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from ..errors import UsageError
from ..io import storage
from ..io.files import save_tensors
from ..model.arch import first_names

INDEX = "stats.json"


class Stats(Mapping[str, torch.Tensor]):
    """Gram matrices by canonical name (``stats[name]`` reads one from disk); ``owner`` maps
    every module name to the canonical name whose Gram matrix it reads (q/k/v read one),
    ``sensitivity`` module name -> output sensitivity, ``meta`` what they were computed on."""

    def __init__(self, folder: str | Path, expect: dict | None = None, scratch: bool = False):
        self.folder = Path(folder)
        try:
            index = json.loads((self.folder / INDEX).read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise _unreadable(self.folder, err) from None
        self.meta: dict = index["meta"]
        self.owner: dict[str, str] = index["owner"]
        self.sensitivity: dict[str, float] = index["sensitivity"]
        self._files: dict[str, str] = index["files"]
        if scratch:  # a stage's own statistics: gone with this object
            weakref.finalize(self, shutil.rmtree, self.folder, True)
        for key, want in (expect or {}).items():
            if self.meta.get(key) != want:
                raise UsageError(f"calibration statistics {self.folder} were made with {key}={self.meta.get(key)!r}, "
                                 f"this run has {want!r}",
                                 "run `wscompress calibrate` for this model and calibration set, or remove the folder")

    def __getitem__(self, name: str) -> torch.Tensor:
        try:
            with safe_open(str(self.folder / self._files[name]), "pt", backend="pread") as f:
                return f.get_tensor(name)
        except (OSError, SafetensorError) as err:
            raise _unreadable(self.folder, err) from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._files)

    def __len__(self) -> int:
        return len(self._files)

    def of(self, name: str) -> torch.Tensor:
        """The Gram matrix of module ``name``'s inputs."""
        return self[self.owner[name]]


class StatsWriter:
    """Writes a statistics folder one layer at a time (see the module docstring)."""

    def __init__(self, folder: str | Path, meta: dict):
        self.folder, self.meta = Path(folder), meta
        self.folder.mkdir(parents=True, exist_ok=True)
        self.owner: dict[str, str] = {}
        self.files: dict[str, str] = {}

    def layer(self, i: int, grams: dict[str, torch.Tensor], owner: dict[str, str]) -> None:
        file = f"layer-{i:04d}.safetensors"
        save_tensors(grams, self.folder / file)
        self.files.update((k, file) for k in grams)
        self.owner.update(owner)

    def finish(self, sensitivity: dict[str, float]) -> None:
        """Write the index: the folder is complete."""
        index = {"meta": self.meta, "owner": self.owner, "files": self.files, "sensitivity": sensitivity}
        (self.folder / INDEX).write_text(json.dumps(index, indent=1))


def scratch_folder(parent: str | Path | None = None) -> Path:
    """A fresh folder for statistics that live only as long as one stage (``Stats(scratch=True)``)."""
    if parent is not None:
        Path(parent).mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix=".stats-", dir=parent))
    atexit.register(shutil.rmtree, folder, True)  # also when the stage stops before its Stats exists
    return folder


class SharedGrams(Mapping[str, torch.Tensor]):
    """First name -> the Gram matrix of every use of that module: the sum over all the names
    that reach it (a module an earlier stage, e.g. cross_layer, shares between layers is fed
    by each of them). Summed when read, so no more than one is in memory."""

    def __init__(self, model: nn.Module, names: list[str], stats: Stats):
        self.stats = stats
        self.parts: dict[str, list[str]] = {}
        for name, first in first_names(model, names).items():
            canonical = stats.owner[name]
            if canonical not in self.parts.setdefault(first, []):  # q/k/v of one layer read one Gram: once
                self.parts[first].append(canonical)

    def __getitem__(self, name: str) -> torch.Tensor:
        parts = self.parts[name]
        total = self.stats[parts[0]]
        for p in parts[1:]:
            total += self.stats[p]
        return total

    def __iter__(self) -> Iterator[str]:
        return iter(self.parts)

    def __len__(self) -> int:
        return len(self.parts)


def fingerprint(model: nn.Module) -> str:
    """Identifies a model's weights, for caches keyed by them: its config and an evenly spaced
    sample of every tensor it stores (each decoder layer brought in while it is read), so two
    models that differ in any tensor, the last layer's as much as the first's, differ."""
    h = hashlib.sha256(json.dumps(model.config.to_diff_dict(), sort_keys=True, default=str).encode())
    for name, t in storage.entries(model, load=True):
        if isinstance(t, str):  # an alias: its tensor is hashed under its first name
            h.update(f"{name}={t};".encode())
            continue
        flat = t.reshape(-1)
        sample = flat[:: max(1, flat.numel() // 4096)].contiguous().cpu()
        h.update(f"{name}:{t.dtype}:{list(t.shape)};".encode())
        h.update(sample.view(torch.uint8).numpy().tobytes())  # the bits themselves: no reduction order to vary
    return h.hexdigest()[:16]


def _unreadable(folder: Path, err: Exception) -> UsageError:
    return UsageError(f"calibration statistics {folder} are unreadable: {err}",
                      "delete the folder and run `wscompress calibrate` again")
