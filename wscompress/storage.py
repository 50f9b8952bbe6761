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

import contextlib
import copy
import ctypes
import json
import os
import shutil
import tempfile
import weakref
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn

from . import tensorio
from .arch import get_module, set_module
from .errors import UsageError
from .modules import MODULE_TYPES
from .offload import offload_of

MANIFEST = "wscompress.json"
WEIGHTS = "model.safetensors"
SHARD_INDEX = "model.safetensors.index.json"
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


def entries(model: nn.Module, load: bool = False) -> Iterator[tuple[str, torch.Tensor | str]]:
    """Every state-dict entry once: (name, tensor) for the first name of each distinct tensor,
    (alias name, canonical name) for the others (a module reached under several names, a tensor
    tied to another). With ``load`` each decoder layer of an offloaded model is onloaded while
    its entries are read, one at a time; without, offloaded tensors are shape-only placeholders."""
    offload = offload_of(model)
    arch = offload.arch if offload.moves else None
    first_module: dict[int, str] = {}
    first_tensor: dict[int, tuple[weakref.ref, str]] = {}  # weak: an offloaded layer's tensors must be freed
    first_name: dict[str, str] = {}
    current, holding = None, contextlib.nullcontext()
    try:
        for mname, module in model.named_modules(remove_duplicate=False):
            layer = arch.layer_of(mname) if arch is not None and load else None
            if layer != current:
                holding.__exit__(None, None, None)
                holding = offload.onload([] if layer is None else [layer])
                holding.__enter__()
                current = layer
            own: dict[str, torch.Tensor] = {}
            module._save_to_state_dict(own, f"{mname}." if mname else "", True)  # a layer's own storage rules apply
            canonical = first_module.setdefault(id(module), mname)
            for name, t in own.items():
                leaf = name.rpartition(".")[2]
                if canonical != mname:  # the same module under an earlier name
                    first = f"{canonical}.{leaf}"
                    yield name, first_name.get(first, first)
                    continue
                source = module._parameters.get(leaf, module._buffers.get(leaf, t))  # own holds stored forms
                hit = first_tensor.get(id(source))
                if hit is not None and hit[0]() is source:  # tied to a tensor met before
                    first_name[name] = hit[1]
                    yield name, hit[1]
                else:
                    first_tensor[id(source)] = (weakref.ref(source), name)
                    yield name, t.detach()
    finally:
        holding.__exit__(None, None, None)


def unique_tensors(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(name -> tensor for each distinct tensor, alias name -> canonical name), see ``entries``."""
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    for name, value in entries(model):
        (aliases if isinstance(value, str) else tensors)[name] = value
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
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if not t.is_meta}.values())


def mark_trainable(model: nn.Module, names: list[str]) -> None:
    """Record modules whose parameters recovery trains in ``finetune.mode: method`` (the modules a
    structural stage made: shared, merged or pooled ones; compressed layers say so themselves).
    Saved in the manifest and restored on loading."""
    known = model.__dict__.setdefault("wscompress_trains", [])
    known.extend(n for n in names if n not in known)


def trainable_modules(model: nn.Module) -> list[nn.Module]:
    """The modules ``mark_trainable`` recorded that the model still has."""
    names = dict(model.named_modules())
    return [names[n] for n in model.__dict__.get("wscompress_trains", []) if n in names]


def structure(model: nn.Module) -> dict:
    modules, aliases = {}, _module_aliases(model)
    for name, module in model.named_modules():
        if type(module).__name__ in MODULE_TYPES and name not in aliases:
            modules[name] = {"type": type(module).__name__, "spec": module.spec()}
    return {"modules": modules, "module_aliases": aliases, "trains": model.__dict__.get("wscompress_trains", [])}


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


def save(model: nn.Module, tokenizer, out_dir: str | Path, info: dict | None = None,
         max_shard_size: int = 2**30) -> dict:
    """Write a compressed checkpoint atomically, shard by shard (``max_shard_size`` bytes at most
    in memory and in each file; an offloaded model is read one decoder layer at a time);
    returns its stats incl. the real file size."""
    with atomic_dir(out_dir) as tmp:
        shards: list[str] = []
        pending: dict[str, torch.Tensor] = {}
        aliases: dict[str, str] = {}

        def flush() -> None:
            shards.append(f"model-{len(shards) + 1:05d}.safetensors")
            tensorio.save(pending, tmp / shards[-1], {"format": "pt"})
            index.update((k, shards[-1]) for k in pending)
            pending.clear()

        index: dict[str, str] = {}
        size = 0
        for name, value in entries(model, load=True):
            if isinstance(value, str):
                aliases[name] = value
                continue
            nbytes = value.numel() * value.element_size()
            if pending and size + nbytes > max_shard_size:
                flush()
                size = 0
            pending[name], size = value, size + nbytes
        if pending or not shards:
            flush()
        if len(shards) == 1:  # one file: the plain name
            (tmp / shards[0]).rename(tmp / WEIGHTS)
        else:
            named = {old: f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i, old in enumerate(shards, 1)}
            for old, new in named.items():
                (tmp / old).rename(tmp / new)
            (tmp / SHARD_INDEX).write_text(json.dumps({"metadata": {"format": "pt"},
                                                       "weight_map": {k: named[v] for k, v in index.items()}}, indent=1))
        manifest = {"format": "wscompress", "version": FORMAT_VERSION, **structure(model),
                    "tensor_aliases": aliases, "info": info or {}}
        model.config.save_pretrained(tmp)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
        file_bytes = sum(f.stat().st_size for f in weight_files(tmp))
    return {**stats(model), "file_bytes": file_bytes}


def weight_files(path: str | Path) -> list[Path]:
    """The weight files of a compressed checkpoint: one file, or the shards its index names."""
    path = Path(path)
    if (path / SHARD_INDEX).is_file():
        return sorted({path / f for f in json.loads((path / SHARD_INDEX).read_text())["weight_map"].values()})
    return [path / WEIGHTS]


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
        tensors = {k: v for f in weight_files(path) for k, v in load_file(f).items()}
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
    mark_trainable(model, manifest.get("trains", []))
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
    return sum(f.stat().st_size for f in weight_files(path))
