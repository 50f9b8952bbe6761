"""Saving and loading compressed models: a HF folder that transformers loads too.

A compressed checkpoint is a HF folder whose ``config.json`` describes the compressed model
(``wscompress_format.WSCompressConfig``: the base model's config and how its layers are
stored), with the weight files holding each distinct tensor once (under the first name that
reaches it), the modeling code beside them (``model/forms``' files its layers use, for
``trust_remote_code``), the tokenizer and a model card. ``load`` rebuilds the model through
the same classes ``AutoModelForCausalLM`` uses, so both give the same model. ``export_dense``
writes a plain checkpoint of the base architecture.
"""

from __future__ import annotations

import contextlib
import copy
import json
from pathlib import Path
from typing import Iterator

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn
from torch.utils._pytree import tree_leaves

from ..errors import UsageError
from ..model.arch import get_module, set_module
from ..model.forms.wscompress_format import (
    LAYERS,
    SHARD_INDEX,
    VARIANT,
    WEIGHTS,
    CompressedLayer,
    WSCompressConfig,
    check_weight_files,
    describe,
    expected_tensors,
    module_aliases,
    settle,
    tensor_aliases,
    tie,
    write_code,
)
from ..model.forms.wscompress_format import weight_files as _weight_files
from .files import atomic_dir, save_tensors
from .offload import offload_of

LEGACY_MANIFEST = "wscompress.json"  # folders written before config.json described the compression (format 1)


def is_compressed(path: str | Path) -> bool:
    path = Path(path)
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        config = None
    return isinstance(config, dict) and config.get("model_type") == WSCompressConfig.model_type \
        or (path / LEGACY_MANIFEST).is_file()


def entries(model: nn.Module, load: bool = False) -> Iterator[tuple[str, torch.Tensor | str]]:
    """Every state-dict entry once: (name, tensor) for the first name of each distinct tensor,
    (alias name, canonical name) for the others (a module reached under several names, a tensor
    tied to another). With ``load`` each decoder layer of an offloaded model is onloaded while
    its entries are read, one at a time; without, offloaded tensors are shape-only placeholders."""
    aliases = tensor_aliases(model)
    offload = offload_of(model)
    arch = offload.arch if offload.moves else None
    seen: set[int] = set()
    current, holding = None, contextlib.nullcontext()
    try:
        for mname, module in model.named_modules(remove_duplicate=False):
            prefix = f"{mname}." if mname else ""
            if id(module) in seen:  # the same module under an earlier name: every entry is an alias
                yield from ((n, aliases[n]) for n in aliases if n.startswith(prefix) and "." not in n[len(prefix):])
                continue
            seen.add(id(module))
            layer = arch.layer_of(mname) if arch is not None and load else None
            if layer != current:
                holding.__exit__(None, None, None)
                holding = offload.onload([] if layer is None else [layer])
                holding.__enter__()
                current = layer
            own: dict[str, torch.Tensor] = {}
            module._save_to_state_dict(own, prefix, True)  # a layer's own storage rules apply
            for name, t in own.items():
                yield (name, aliases[name]) if name in aliases else (name, t.detach())
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
    """The size of what ``save`` writes (each shared tensor once): its bytes, its parameters
    and bits a parameter. Parameters are the dense-equivalent count: a compressed layer's
    tensors count their values, except where it packs each weight of its dense module into
    fewer bits (``parameter_count``: palettized forms), which counts those weights; elsewhere
    the floating-point values (not a model's integer buffers)."""
    tensors, _ = unique_tensors(model)
    layers = {name: m for name, m in model.named_modules() if isinstance(m, CompressedLayer)}
    params, packed = 0, {}
    for name, t in tensors.items():
        parts = name.split(".")[:-1]
        owner = next((p for p in (".".join(parts[:i]) for i in range(len(parts), 0, -1)) if p in layers), None)
        count = layers[owner].parameter_count() if owner is not None else None
        module, _, leaf = name.rpartition(".")
        if module == owner and leaf in layers[owner].UNCOUNTED:
            continue  # bytes, not parameters (a rotation's signs)
        if count is not None:
            packed[owner] = count  # once a layer, whichever of its tensors comes
        elif owner is not None or t.is_floating_point():
            params += t.numel()
    params += sum(packed.values())
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    return {"tensor_bytes": nbytes, "bits_per_weight": 8 * nbytes / max(params, 1), "params": params}


def resident_bytes(model: nn.Module) -> int:
    """Bytes the model's tensors occupy in memory now (each storage once): parameters, buffers
    and any layout a layer prepared for its kernel (``_layout``), whatever the file holds."""
    tensors = [*model.parameters(), *model.buffers()]
    for module in model.modules():
        tensors += [t for t in tree_leaves(getattr(module, "_layout", ())) if isinstance(t, torch.Tensor)]
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


def save(model: nn.Module, tokenizer, out_dir: str | Path, max_shard_size: int = 2**30) -> dict:
    """Write a compressed checkpoint atomically, shard by shard (``max_shard_size`` bytes at most
    in memory and in each file; an offloaded model is read one decoder layer at a time);
    returns its stats incl. the real file size."""
    with atomic_dir(out_dir) as tmp:
        shards: list[str] = []
        pending: dict[str, torch.Tensor] = {}

        def flush() -> None:
            shards.append(f"model.{VARIANT}-{len(shards) + 1:05d}.safetensors")
            save_tensors(pending, tmp / shards[-1], {"format": "pt"})
            index.update((k, shards[-1]) for k in pending)
            pending.clear()

        index: dict[str, str] = {}
        size = 0
        for name, value in entries(model, load=True):
            if isinstance(value, str):
                continue  # an alias: config.json names it, the files hold the tensor once
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
            named = {old: f"model.{VARIANT}-{i:05d}-of-{len(shards):05d}.safetensors" for i, old in enumerate(shards, 1)}
            for old, new in named.items():
                (tmp / old).rename(tmp / new)
            (tmp / SHARD_INDEX).write_text(json.dumps({"metadata": {"format": "pt"},
                                                       "weight_map": {k: named[v] for k, v in index.items()}}, indent=1))
        config = WSCompressConfig.wrapping(model.config, describe(model))
        if config.dtype is None:  # say it: "auto" would otherwise take the first tensor's, maybe a codebook's float16
            config.dtype = next(t.dtype for t in model.parameters() if t.is_floating_point())
        config.save_pretrained(tmp)
        write_code(tmp, model)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        file_bytes = sum(f.stat().st_size for f in weight_files(tmp))
    return {**stats(model), "file_bytes": file_bytes}


def weight_files(path: str | Path) -> list[Path]:
    """The weight files of a compressed checkpoint: one file, or the shards its index names."""
    return [Path(f) for f in _weight_files(path)]


def compressed_config(path: Path) -> WSCompressConfig:
    """The config of a compressed folder (one written before config.json described the
    compression: its base config and manifest together)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    if isinstance(config, WSCompressConfig):
        return config
    manifest = json.loads((path / LEGACY_MANIFEST).read_text())
    return WSCompressConfig.wrapping(config, {k: manifest.get(k, {}) for k in ("modules", "module_aliases", "tensor_aliases")}
                                     | {"trains": manifest.get("trains", [])})


def load(path: str | Path, dtype: torch.dtype | None = None) -> tuple[nn.Module, object]:
    """Rebuild a model written by ``save``: same modules, same sharing, same tensors (the model
    ``AutoModelForCausalLM.from_pretrained`` gives, loaded by wscompress's own reader, which
    also takes folders of format 1)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # transformers 4
        from transformers.modeling_utils import no_init_weights

    path = Path(path)
    try:
        config = compressed_config(path)
        unknown = sorted({str(e.get("type")) for e in config.compression.get("modules", {}).values()
                          if isinstance(e, dict)} - set(LAYERS))
        if unknown:
            raise UsageError(f"{path}: compressed layer type {unknown[0]!r} is unknown: the folder was written by a newer "
                             "wscompress", "upgrade wscompress (pip install -U wscompress)")
        # names, shapes and dtypes checked on the files' headers against the structure built on the
        # meta device, before anything is allocated (a crafted config.json's absurd shapes never are)
        with torch.device("meta"), no_init_weights():
            expected = expected_tensors(AutoModelForCausalLM.from_config(config))
        files = weight_files(path)
        check_weight_files(files, expected, config.compression.get("tensor_aliases", {}))
        tensors = {k: v for f in files for k, v in load_file(f).items()}
        with no_init_weights():  # every weight comes from the file: a random init first is wasted time (minutes at 7B)
            # the base architecture with the compressed layers in place, made in ``dtype`` as transformers makes
            # it (buffers it computes itself, RoPE's frequencies, stay in float32)
            model = AutoModelForCausalLM.from_config(config, **({} if dtype is None else {"dtype": dtype}))
        aliases = config.compression["tensor_aliases"]
        # as stored: the file's tensors themselves; in another dtype: copied into the model's (cast on the way)
        model.load_state_dict(tensors, strict=False, assign=dtype is None)
        tie(model, aliases)
        settle(model, None)  # the values checked before any kernel reads them
    except UsageError:
        raise
    except (OSError, json.JSONDecodeError, SafetensorError, ValueError, KeyError, RuntimeError) as err:
        raise UsageError(f"{path}: corrupt or incomplete compressed checkpoint ({type(err).__name__}: {err})",
                         "re-run `wscompress compress` to write it again") from None
    tokenizer = AutoTokenizer.from_pretrained(path) if (path / "tokenizer_config.json").is_file() else None
    if tokenizer is not None and tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.eval()
    return model, tokenizer


def export_dense(model: nn.Module, tokenizer, out_dir: str | Path) -> None:
    """Write a plain HF checkpoint of the base architecture: compressed layers materialised,
    sharing undone (tied embeddings stay tied through the config), loadable by stock
    ``from_pretrained``."""
    from transformers import AutoModelForCausalLM

    dense = copy.deepcopy(model)
    replaced: list[str] = []
    for name, module in list(dense.named_modules(remove_duplicate=False)):
        inside = any(name.startswith(r + ".") for r in replaced)  # materialised with its parent
        if not inside and type(module).__name__ in LAYERS:
            set_module(dense, name, module.to_dense())
            replaced.append(name)
    for alias in module_aliases(dense):
        set_module(dense, alias, copy.deepcopy(get_module(dense, alias)))
    config = model.config.base_config() if isinstance(model.config, WSCompressConfig) else copy.deepcopy(model.config)
    plain = AutoModelForCausalLM.from_config(config)  # the base class: its config is all it writes
    plain.load_state_dict(dense.state_dict(), strict=True)
    plain.to(next(dense.parameters()).dtype)
    with atomic_dir(out_dir) as tmp:
        plain.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)


def file_size(path: str | Path) -> int:
    return sum(f.stat().st_size for f in weight_files(path))
