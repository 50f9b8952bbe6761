"""Saving and loading compressed models as safetensors, every shared tensor stored once.

A compressed checkpoint is a normal HF folder (``config.json``, tokenizer files) plus:

- ``model.safetensors``: each distinct tensor once, under the first name that reaches it;
- ``wscompress.json``: the manifest: which modules were swapped for compressed layers (type
  and constructor spec), which module names are aliases of another (cross-layer sharing,
  shared bases) and which tensor names are aliases (tied embeddings).

``load`` rebuilds the model from its config, swaps the modules, re-creates the aliases and
loads the tensors, so shared weights are shared in memory again. ``export_dense`` writes a
plain checkpoint that stock transformers loads.
"""

from __future__ import annotations

import copy
import ctypes
import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from .arch import get_module, set_module
from .errors import UsageError
from .modules import MODULE_TYPES

MANIFEST = "wscompress.json"
WEIGHTS = "model.safetensors"
FORMAT_VERSION = 1


def is_compressed(path: str | Path) -> bool:
    return (Path(path) / MANIFEST).is_file()


def _module_aliases(model: nn.Module) -> dict[str, str]:
    """alias name -> canonical (first) name, for modules reachable under several names."""
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        if any(name.startswith(a + ".") for a in aliases):
            continue  # inside an aliased module: covered by the alias itself
        if id(module) in first:
            aliases[name] = first[id(module)]
        else:
            first[id(module)] = name
    return aliases


def unique_tensors(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(name -> tensor for each distinct tensor, alias name -> canonical name)."""
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        t = t.detach()
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()))
        if key in seen:
            aliases[name] = seen[key]
        else:
            seen[key] = name
            tensors[name] = t
    return tensors, aliases


def stats(model: nn.Module) -> dict:
    """Unique parameter count and bytes of what ``save`` writes (each shared tensor once)."""
    tensors, _ = unique_tensors(model)
    params = sum(t.numel() for t in tensors.values() if t.is_floating_point())
    return {"params": params, "tensor_bytes": sum(t.numel() * t.element_size() for t in tensors.values())}


def resident_bytes(model: nn.Module) -> int:
    """Bytes the model's tensors occupy in memory now (each storage once): parameters, buffers
    and any layout a layer prepared for its kernel (``_layout``), whatever the file holds."""
    tensors = [*model.parameters(), *model.buffers()]
    for module in model.modules():
        tensors += [t for t in getattr(module, "_layout", ()) if isinstance(t, torch.Tensor)]
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def structure(model: nn.Module) -> dict:
    modules, aliases = {}, _module_aliases(model)
    for name, module in model.named_modules():
        if type(module).__name__ in MODULE_TYPES and name not in aliases:
            modules[name] = {"type": type(module).__name__, "spec": module.spec()}
    return {"modules": modules, "module_aliases": aliases}


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one atomic step (Linux renameat2 with RENAME_EXCHANGE); False where
    the system or file system cannot."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


@contextmanager
def atomic_dir(target: str | Path) -> Iterator[Path]:
    """Yield a temporary folder that replaces ``target`` only if the block succeeds.

    An existing ``target`` is swapped with the finished folder in one atomic step where the
    system allows it; elsewhere it is renamed aside only once the new one is complete, and put
    back if the new one cannot take its place, so a reader never finds neither.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        yield tmp
        if not target.exists():
            tmp.rename(target)
        elif not _exchange(tmp, target):  # after an exchange tmp holds the old output: removed below
            old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old.", dir=target.parent))
            target.rename(old / target.name)
            try:
                tmp.rename(target)
            except BaseException:
                (old / target.name).rename(target)
                raise
            finally:
                shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def save(model: nn.Module, tokenizer, out_dir: str | Path, info: dict | None = None) -> dict:
    """Write a compressed checkpoint atomically; returns its stats incl. the real file size."""
    tensors, tensor_aliases = unique_tensors(model)
    manifest = {"format": "wscompress", "version": FORMAT_VERSION, **structure(model),
                "tensor_aliases": tensor_aliases, "info": info or {}}
    with atomic_dir(out_dir) as tmp:
        save_file({k: v.contiguous().cpu() for k, v in tensors.items()}, tmp / WEIGHTS, metadata={"format": "pt"})
        model.config.save_pretrained(tmp)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
        file_bytes = (tmp / WEIGHTS).stat().st_size
    return {**stats(model), "file_bytes": file_bytes}


def load(path: str | Path, dtype: torch.dtype | None = None) -> tuple[nn.Module, object]:
    """Rebuild a model written by ``save``: same modules, same sharing, same tensors."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # transformers 4
        from transformers.modeling_utils import no_init_weights

    from . import methods  # noqa: F401  (importing the methods registers their module types)

    path = Path(path)
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        tensors = load_file(path / WEIGHTS)
    except (OSError, json.JSONDecodeError, SafetensorError) as err:
        raise UsageError(f"{path}: corrupt or incomplete compressed checkpoint ({type(err).__name__}: {err})",
                         "re-run `wscompress compress` to write it again") from None
    config = AutoConfig.from_pretrained(path)
    with no_init_weights():  # every weight comes from the file: a random init first is wasted time (minutes at 7B)
        model = AutoModelForCausalLM.from_config(config)
        for name, entry in manifest["modules"].items():
            cls = MODULE_TYPES.get(entry["type"])
            if cls is None:
                raise UsageError(f"{path}: unknown module type {entry['type']!r}", "upgrade wscompress to the version that wrote it")
            set_module(model, name, cls(**entry["spec"]))
    for alias, canonical in manifest["module_aliases"].items():
        set_module(model, alias, get_module(model, canonical))
    missing, unexpected = model.load_state_dict(tensors, strict=False, assign=True)
    aliases = manifest["tensor_aliases"]
    if unexpected or set(missing) - set(aliases):
        raise UsageError(f"{path}: weights do not match the manifest (missing {sorted(set(missing) - set(aliases))[:3]}, "
                         f"unexpected {unexpected[:3]})", "re-run `wscompress compress` to write it again")
    for alias, canonical in aliases.items():
        owner, _, leaf = alias.rpartition(".")
        target = model.get_parameter(canonical) if canonical in dict(model.named_parameters()) else model.get_buffer(canonical)
        if getattr(get_module(model, owner), leaf) is not target:
            setattr(get_module(model, owner), leaf, target)
    if dtype is not None:
        model.to(dtype)  # only floating tensors change: packed integer indices stay as they are
    tokenizer = AutoTokenizer.from_pretrained(path) if (path / "tokenizer_config.json").is_file() else None
    if tokenizer is not None and tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.eval()
    return model, tokenizer


def export_dense(model: nn.Module, tokenizer, out_dir: str | Path) -> None:
    """Write a plain HF checkpoint: compressed layers materialised, sharing undone (tied
    embeddings stay tied through the config), loadable by stock ``from_pretrained``."""
    dense = copy.deepcopy(model)
    replaced: list[str] = []
    for name, module in list(dense.named_modules(remove_duplicate=False)):
        inside = any(name.startswith(r + ".") for r in replaced)  # materialised with its parent
        if not inside and hasattr(module, "to_dense") and type(module).__name__ in MODULE_TYPES:
            set_module(dense, name, module.to_dense())
            replaced.append(name)
    for alias in _module_aliases(dense):
        set_module(dense, alias, copy.deepcopy(get_module(dense, alias)))
    tied = {id(dense.get_input_embeddings().weight)} if getattr(dense.config, "tie_word_embeddings", False) else set()
    seen: set[int] = set()
    for name, p in list(dense.named_parameters(remove_duplicate=False)):
        if id(p) in seen and id(p) not in tied:
            owner, _, leaf = name.rpartition(".")
            setattr(get_module(dense, owner), leaf, nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad))
        seen.add(id(p))
    with atomic_dir(out_dir) as tmp:
        dense.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)


def file_size(path: str | Path) -> int:
    return os.path.getsize(Path(path) / WEIGHTS)
