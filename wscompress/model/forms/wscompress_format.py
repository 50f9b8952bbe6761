"""The storage format of wscompress's compressed folders, the base of every compressed layer, and
the transformers classes that load them.

This file and the forms beside it (``wscompress_<family>.py``, one file per family of compressed
layers) import torch, transformers, numpy and each other (relatively) and nothing of wscompress,
on purpose: wscompress uses them, and copies into every model folder it writes this file, the
files of the forms its layers use and an entry file importing them (``modeling_wscompress.py``,
named in ``config.json``'s ``auto_map``; ``write_code``), so the folder loads with
``AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)`` where wscompress is not
installed: transformers' remote code copies the files the entry imports relatively beside it.
There every layer runs its torch reference path; wscompress fills ``KERNELS`` with its compiled
and Triton kernels when it is imported.

A compressed folder is a HF checkpoint whose ``config.json`` has ``model_type: wscompress``:
the base model's own config (``base_config``) and how its layers are stored (``compression``:
the compressed layers by name with their constructor arguments, the modules reached under
several names and the tensors stored once for several names). ``config.json`` stays a valid
config for any reader (AutoTokenizer's probe, hub tooling), while the weights are a transformers
weight *variant* (``model.wscompress.safetensors``) that only these classes ask for: a stock
model class finds no weights and refuses the folder instead of filling it with random ones.

Everything read from a folder is checked before any kernel sees it (``check_format``,
``check_entry``, ``check_weight_files``, ``validate``): a crafted or damaged folder, or one of a
newer format, is a ValueError naming the problem, never an out-of-range read.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import json
import math
import os
import re
import sys
import types
from typing import Any, Callable, ClassVar, Literal, NamedTuple, Union, get_args, get_origin, get_type_hints

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.pytorch_utils import Conv1D

FORMAT = "wscompress"  # config.json's compression.format
FORMAT_VERSION = 3  # 3: weights as the "wscompress" variant, config.json a plain valid config; 2: "dtype" guard
CODE_FILE = "modeling_wscompress.py"  # the entry file config.json's auto_map names (written by ``write_code``)
# The weight files are this transformers variant (model.wscompress.safetensors, and its shards'
# index model.safetensors.index.wscompress.json): stock classes look for model.safetensors, find
# none and refuse the folder, while these classes ask for the variant.
VARIANT = "wscompress"
WEIGHTS = f"model.{VARIANT}.safetensors"
SHARD_INDEX = f"model.safetensors.index.{VARIANT}.json"
LEGACY_WEIGHTS, LEGACY_SHARD_INDEX = "model.safetensors", "model.safetensors.index.json"  # format 2 and before
AUTO_MAP = {"AutoConfig": "modeling_wscompress.WSCompressConfig",
            "AutoModelForCausalLM": "modeling_wscompress.WSCompressForCausalLM"}

# Fast paths, filled by wscompress when it is imported: each form names its own (a palettized
# layer "palettized", a low-rank one "low_rank", float16 and int8 ones "half" and "int8"); each
# returns None where it does not apply, and the layer then runs its torch reference path, as it
# always does where nothing is registered. "generate" and "decode_step"
# (wscompress.evaluation.step_cache): generate()'s arguments and its decode call on CPU, a
# compiled step kept across processes.
KERNELS: dict[str, Callable[..., Any]] = {}
# What each of those kernels does for a layer it takes, in words (``CompressedLayer.compute_path``,
# which wscompress bench reports); None where it does not take the layer
PATHS: dict[str, Callable[[nn.Module], str | None]] = {}
DECODE_ROWS = 8  # inputs with at most this many rows (decoding) go to the kernels; longer ones the BLAS

# ----------------------------------------------------------------------------- the layers

LAYERS: dict[str, type[nn.Module]] = {}  # class name -> class: what config.json's ``compression`` names
_JSON_TYPES = {int: (int,), float: (float, int), bool: (bool,), str: (str,), type(None): (type(None),)}


class Argument(NamedTuple):
    """One constructor argument of a compressed layer, as config.json may give it."""

    accepts: Callable[[Any], bool]  # whether a value read from JSON is one the argument takes
    required: bool


def _accepts(hint: Any, where: str) -> Callable[[Any], bool]:
    """The JSON values a type hint allows: int, float (an int too), bool, str, None, a Literal of
    those, or a union of them; any other hint is a TypeError naming ``where``."""
    if get_origin(hint) is Literal:
        options = get_args(hint)
        return lambda v: any(type(v) is type(o) and v == o for o in options)  # True is not 1 here
    if get_origin(hint) in (Union, types.UnionType):
        parts = [_accepts(h, where) for h in get_args(hint)]
        return lambda v: any(part(v) for part in parts)
    if hint not in _JSON_TYPES:  # an argument without a hint is Any: refused too
        raise TypeError(f"{where}: its type hint {hint!r} is no JSON value; a compressed layer's constructor takes "
                        "int, float, bool, str, None, Literals of those and unions of them (config.json records them)")
    return lambda v: type(v) in _JSON_TYPES[hint]  # exact types: a bool is no int


def register_layer(cls: type[CompressedLayer]) -> type[CompressedLayer]:
    """Make ``cls`` loadable by its name: config.json's ``compression`` names it with its
    constructor arguments (``spec``), which ``check_entry`` checks against the type hints of
    ``cls.__init__`` (``ARGUMENTS``, read here, so a hint no JSON value fits fails at import)."""
    hints = get_type_hints(cls.__init__)
    params = [p for p in inspect.signature(cls.__init__).parameters.values() if p.name != "self"]
    cls.ARGUMENTS = {p.name: Argument(_accepts(hints.get(p.name, Any), f"{cls.__name__}.__init__({p.name})"),
                                      p.default is inspect.Parameter.empty) for p in params}
    LAYERS[cls.__name__] = cls
    return cls


class CompressedLayer:
    """What every compressed layer is: its values always come from a checkpoint (transformers never
    initialises it), it describes itself (``spec``: the constructor arguments that rebuild its
    structure) and it turns back into a dense module (``to_dense``, for export to stock transformers).

    Everything loading needs to know of a form is declared here, on its class: its constructor
    arguments (``__init__``'s type hints, read by ``register_layer``), what a folder's values of
    them may be (``check_spec``), the shape of the dense module it stands for (``dense_shape``),
    the child modules it holds (``CHILDREN``), what its loaded tensors must satisfy before a kernel
    reads them (``check_values``), what it does once they are loaded (``settle``) and how it
    computes (``KERNEL``, ``TORCH_PATH``: ``compute_path``)."""

    _is_hf_initialized = True  # transformers' init skips modules that say so: every value is loaded
    ARGUMENTS: ClassVar[dict[str, Argument]]  # set by ``register_layer``
    CHILDREN: ClassVar[tuple[str, ...]] = ()  # its child modules: a later stage may compress them in turn
    KERNEL: ClassVar[str | None] = None  # the name of its fast path in ``KERNELS`` (and ``PATHS``); None: torch only
    TORCH_PATH: ClassVar[str] = "torch"  # what its reference path computes, in words
    UNCOUNTED: ClassVar[tuple[str, ...]] = ()  # its own tensors that are no parameters (a rotation's signs)

    @staticmethod
    def dense_shape(spec: dict) -> tuple[int, int]:
        """(out, in) of the linear, or (rows, width) of the table, that a layer of this spec replaces."""
        if "out_features" in spec:
            return spec["out_features"], spec["in_features"]
        return spec["num_embeddings"], spec["embedding_dim"]

    @classmethod
    def check_spec(cls, **spec) -> str | None:
        """What is wrong with these constructor arguments (read from a folder, their JSON types
        already checked), or None: checked before anything is built from them."""
        shape = cls.dense_shape(spec)
        if min(shape) < 1:
            return f"a dimension of {shape} is zero"
        if not 1 <= spec.get("rank", 1) <= sum(shape):  # a factorisation never needs more
            return f"rank {spec['rank']} is outside 1..{sum(shape)}"
        if spec.get("padding_idx") is not None and spec["padding_idx"] >= shape[0]:
            return f"padding_idx {spec['padding_idx']} is past the table's {shape[0]} rows"
        if not math.isfinite(spec.get("scale", 1.0)):
            return "its scale is not finite"
        return None

    def spec(self) -> dict:
        """Constructor keyword arguments that rebuild this module's structure (not its values)."""
        raise NotImplementedError

    def parameter_count(self) -> int | None:
        """The parameters this layer counts as in size reports, where they are not the values
        of its tensors: a form that packs every weight of its dense module into fewer bits
        counts those weights (bits a weight then divide its bytes by them). None: its tensors'
        values are its parameters (factors, int8 weights, float16 ones)."""
        return None

    def check_values(self, where: str) -> None:
        """Refuse loaded tensors that would make this layer read out of range (``where``: its name),
        with ``corrupt``; shapes and dtypes were checked on the files' headers already."""

    def settle(self, dtype: torch.dtype | None) -> None:
        """After its tensors are loaded and checked: what the layer derives from them, and values it
        stores in a dtype of its own brought to ``dtype`` (the floating dtype the model loads in, or None)."""

    def compute_path(self) -> str:
        """How this layer computes where it is, in words: its kernel's account (``PATHS``) where
        one is registered and takes this layer, else its torch path (``TORCH_PATH``)."""
        said = PATHS.get(self.KERNEL) if self.KERNEL else None
        return (said(self) if said is not None else None) or self.TORCH_PATH

    def to_dense(self) -> nn.Module:
        raise NotImplementedError


class DenseCopy(torch.Tensor):
    """What a compressed linear's ``weight`` is: its dense weight, built on request, for code that
    asks any linear for its weight's shape, dtype, device or values (peft does). It refuses to be
    written to: a write would change this copy, not the layer (peft's LoRA merge writes there)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name.endswith("_") and not name.endswith("__") or name in ("__setitem__", "__iadd__", "__isub__", "__imul__"):
            raise RuntimeError(f"{name}: the weight of a compressed layer is a read-only copy (the layer stores it "
                               "compressed). To merge a LoRA adapter, keep it separate or export the model dense "
                               "first (wscompress export DIR OUT); to change the layer, change its own tensors")
        with torch._C.DisableTorchFunctionSubclass():  # what it computes is a plain tensor
            return func(*args, **(kwargs or {}))

    @property
    def data(self) -> torch.Tensor:
        return self

    @data.setter
    def data(self, value) -> None:
        self.add_(0)  # refused, with the reason


def weight_of(module: nn.Module) -> torch.Tensor:
    """The (out, in) weight of a dense or compressed linear."""
    if isinstance(module, CompressedLinear):
        return module.dense_weight()
    return module.weight.t() if isinstance(module, Conv1D) else module.weight


class CompressedLinear(CompressedLayer, nn.Linear):
    """y = x W^T + b with W stored in another form. An ``nn.Linear`` to the ecosystem (peft wraps it
    with LoRA, device maps place it), but it has no dense ``weight``: ``dense_weight()`` builds one.

    ``conv1d`` records that the layer replaced a GPT-2 ``Conv1D`` (weight stored (in, out)), so
    ``to_dense`` gives one back: stock GPT-2 checkpoints expect that layout."""

    in_features: int
    out_features: int
    conv1d: bool = False

    def __init__(self) -> None:
        nn.Module.__init__(self)  # not nn.Linear's: it would allocate the dense weight this layer replaces

    def dense_weight(self) -> torch.Tensor:
        """The weight as an (out_features, in_features) tensor."""
        raise NotImplementedError

    @property
    def weight(self) -> torch.Tensor:
        """The dense weight as a read-only copy (``DenseCopy``), built on each access."""
        return self.dense_weight().detach().as_subclass(DenseCopy)

    def to_dense(self) -> nn.Module:
        """An nn.Linear (or Conv1D, see ``conv1d``) computing the same function."""
        w = self.dense_weight().detach()
        bias = getattr(self, "bias", None)
        if self.conv1d:
            dense = Conv1D(self.out_features, self.in_features).to(w.device, w.dtype)
            w = w.T
        else:
            dense = nn.Linear(self.in_features, self.out_features, bias=bias is not None, device=w.device, dtype=w.dtype)
        with torch.no_grad():
            dense.weight.copy_(w)
            if bias is not None:
                dense.bias.copy_(bias)
            elif self.conv1d:
                dense.bias.zero_()
        return dense

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.spec().items())


# ----------------------------------------------------------------------------- structure of a model


def _get(root: nn.Module, name: str) -> nn.Module:
    return root.get_submodule(name) if name else root


def _set(root: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(_get(root, parent), leaf, module)


def module_aliases(model: nn.Module) -> dict[str, str]:
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


def tensor_aliases(model: nn.Module) -> dict[str, str]:
    """alias -> first name of every state-dict entry reached under several names (a module
    shared between layers, an LM head tied to the embedding): the file holds each tensor once."""
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for mname, module in model.named_modules(remove_duplicate=False):
        own = [*module._parameters.items(),
               *((k, b) for k, b in module._buffers.items() if k not in module._non_persistent_buffers_set)]
        for leaf, t in own:
            if t is None:
                continue
            name = f"{mname}.{leaf}" if mname else leaf
            if first.setdefault(id(t), name) != name:
                aliases[name] = first[id(t)]
    return aliases


def describe(model: nn.Module) -> dict:
    """The ``compression`` section of config.json: what ``build`` needs to rebuild ``model``'s
    structure from its base architecture, and which names the file does not hold."""
    aliases = module_aliases(model)
    layers = {name: {"type": type(m).__name__, "spec": m.spec()} for name, m in model.named_modules()
              if type(m).__name__ in LAYERS and name not in aliases}
    return {"format": FORMAT, "version": FORMAT_VERSION, "modules": layers, "module_aliases": aliases,
            "tensor_aliases": tensor_aliases(model), "trains": list(model.__dict__.get("wscompress_trains", []))}


def build(model: nn.Module, compression: dict) -> None:
    """Swap the base model's modules for the compressed layers ``compression`` names (empty
    tensors, to be loaded) and make shared modules shared again. Every name, type, constructor
    argument and alias is checked against the base structure first (``check_entry``,
    ``check_aliases``): a crafted section never reaches a constructor or ``setattr`` unchecked."""
    check_format(compression)
    sections = {"modules": dict, "module_aliases": dict, "tensor_aliases": dict, "trains": list}
    for key, kind in sections.items():
        if not isinstance(compression.get(key, kind()), kind):
            raise corrupt(f"config.json: compression.{key} is not a JSON {'object' if kind is dict else 'array'}")
    for name, entry in compression.get("modules", {}).items():
        parent, leaf, cls = check_entry(model, name, entry)
        setattr(parent, leaf, cls(**entry["spec"]))
    module_aliases = compression.get("module_aliases", {})
    check_aliases(module_aliases, "module_aliases")
    for alias, canonical in module_aliases.items():
        parent, leaf = _slot(model, alias, "module_aliases")
        try:
            target = model.get_submodule(canonical)
        except AttributeError:
            raise corrupt(f"config.json: module_aliases names {canonical!r}, which the model does not have") from None
        setattr(parent, leaf, target)
    tensor_aliases = compression.get("tensor_aliases", {})
    check_aliases(tensor_aliases, "tensor_aliases")
    names = {n for n, _ in model.named_parameters(remove_duplicate=False)} | {n for n, _ in model.named_buffers(remove_duplicate=False)}
    unknown = sorted(n for pair in tensor_aliases.items() for n in pair if n not in names)
    if unknown:
        raise corrupt(f"config.json: tensor_aliases names {unknown[0]!r}, which the model does not have")
    trains = compression.get("trains", [])
    if not all(isinstance(n, str) for n in trains):
        raise corrupt("config.json: compression.trains holds something other than module names")
    model.__dict__["wscompress_trains"] = list(trains)


# ----------------------------------------------------------------------------- checks on what a folder holds

def corrupt(problem: str) -> ValueError:
    """The error for a folder whose contents do not hold together (damaged, or crafted)."""
    return ValueError(f"{problem}; the folder is damaged, or was not written by wscompress: write it again "
                      "(wscompress compress, or wscompress export --format hf)")


def check_format(compression: dict) -> None:
    """Refuse a ``compression`` section of another format, or of a newer version of this one,
    than this code reads: its layers may be stored in ways this code would misread."""
    form, version = compression.get("format", FORMAT), compression.get("version", FORMAT_VERSION)
    if form != FORMAT:
        raise ValueError(f"config.json: compression.format is {form!r}, not {FORMAT!r}: the folder was not written by "
                         "wscompress, or by a newer one; upgrade wscompress (pip install -U wscompress) and load it again")
    if type(version) is not int or version < 1:
        raise corrupt(f"config.json: compression.version is {version!r}, not a format version")
    if version > FORMAT_VERSION:
        raise ValueError(f"config.json: the folder is in wscompress format {version}, newer than the {FORMAT_VERSION} this "
                         f"code reads: upgrade wscompress (pip install -U wscompress), or load it with "
                         f"trust_remote_code=True to use the code the folder carries")


_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_]*(\.[A-Za-z0-9][A-Za-z0-9_]*)*")  # module paths; no dunders, no leading _


def _slot(model: nn.Module, name: Any, section: str) -> tuple[nn.Module, str]:
    """(parent, leaf) of an existing module slot ``name`` of ``model``: compression only ever
    replaces modules the base structure has (a slot may hold None: a compressed layer's own
    child, filled next)."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise corrupt(f"config.json: {section} names {name!r}, which is not a module path")
    parent_name, _, leaf = name.rpartition(".")
    try:
        parent = model.get_submodule(parent_name)
    except AttributeError:
        parent = None
    if parent is None or leaf not in parent._modules:
        raise corrupt(f"config.json: {section} names {name!r}, which the base model ({type(model).__name__}) does not have")
    return parent, leaf


def _dense_shape(module: nn.Module | None) -> tuple[int, int] | None:
    """(out, in) of a linear, (rows, width) of an embedding table; None for other modules."""
    if isinstance(module, Conv1D):
        return module.weight.shape[1], module.weight.shape[0]
    if isinstance(module, CompressedLayer):  # a compressed layer's own child slot, filled next (a table)
        return type(module).dense_shape(module.spec())
    if isinstance(module, nn.Linear):
        return module.out_features, module.in_features
    if isinstance(module, nn.Embedding):
        return module.num_embeddings, module.embedding_dim
    return None


def check_entry(model: nn.Module, name: str, entry: Any) -> tuple[nn.Module, str, type]:
    """(parent, leaf, class) of one ``compression.modules`` entry, after checking that its type
    is known, its arguments are those of the class (``ARGUMENTS``) with sane values (``check_spec``)
    and its shape is that of the module it replaces."""
    if not isinstance(entry, dict) or not isinstance(entry.get("spec"), dict):
        raise corrupt(f"config.json: compression.modules[{name!r}] is not {{type, spec}}")
    cls = LAYERS.get(entry.get("type"))  # type: ignore[arg-type]
    if cls is None:
        raise ValueError(f"compressed layer type {entry.get('type')!r} is unknown to this modeling_wscompress.py: "
                         "the folder was written by a newer wscompress; upgrade wscompress (pip install -U "
                         "wscompress), or load the folder with trust_remote_code=True to use the code it carries")
    parent, leaf = _slot(model, name, "compression.modules")
    spec, arguments = entry["spec"], cls.ARGUMENTS
    for key, value in spec.items():
        if key not in arguments or not arguments[key].accepts(value):
            raise corrupt(f"config.json: {name} ({cls.__name__}) has argument {key}={value!r}, which it does not take")
        if type(value) is int and not 0 <= value < 2**40:
            raise corrupt(f"config.json: {name} ({cls.__name__}) has {key}={value}, out of range")
    missing = {key for key, argument in arguments.items() if argument.required} - set(spec)
    problem = f"arguments {sorted(missing)} are missing" if missing else cls.check_spec(**spec)
    shape, slot = cls.dense_shape(spec), parent._modules[leaf]
    expected = _dense_shape(slot if slot is not None else parent)
    if problem is None and expected is not None and shape != expected:
        problem = f"its shape {shape} is not that of the module it replaces {expected}"
    if problem:
        raise corrupt(f"config.json: {name} ({cls.__name__}): {problem}")
    return parent, leaf, cls


def check_aliases(aliases: dict, section: str) -> None:
    """Alias maps are acyclic and name paths: no alias is a canonical name, and no name lies
    inside another (a module aliased to its own child or parent would contain itself)."""
    for alias, canonical in aliases.items():
        for n in (alias, canonical):
            if not isinstance(n, str) or not _NAME.fullmatch(n):
                raise corrupt(f"config.json: {section} names {n!r}, which is not a module or tensor path")
        inside = [a for a in aliases if canonical == a or canonical.startswith(a + ".") or a.startswith(canonical + ".")]
        if inside or alias.startswith(canonical + "."):
            raise corrupt(f"config.json: {section} maps {alias!r} to {canonical!r}, which is itself aliased or contains it "
                          "(a cycle)")


_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                       "BOOL": torch.bool}


def read_header(path: str | os.PathLike) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """name -> (shape, dtype) of a safetensors file, reading only its header, after checking
    that every tensor's bytes lie inside the file (a truncated file is refused here)."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if n < 2 or 8 + n > size:
            raise corrupt(f"{os.fspath(path)}: truncated, or not a safetensors file")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError):
            header = None
    if not isinstance(header, dict):
        raise corrupt(f"{os.fspath(path)}: its safetensors header is not a JSON object")
    body, out = size - 8 - n, {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype = _SAFETENSORS_DTYPES.get(entry.get("dtype")) if isinstance(entry, dict) else None
        shape, offsets = (entry.get("shape"), entry.get("data_offsets")) if isinstance(entry, dict) else (None, None)
        if (dtype is None or not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape)
                or not isinstance(offsets, list) or len(offsets) != 2 or not all(isinstance(o, int) for o in offsets)):
            raise corrupt(f"{os.fspath(path)}: tensor {name!r} has an unreadable header entry")
        if not 0 <= offsets[0] <= offsets[1] <= body or offsets[1] - offsets[0] != math.prod(shape) * dtype.itemsize:
            raise corrupt(f"{os.fspath(path)}: tensor {name!r} lies outside the file (truncated?)")
        out[name] = tuple(shape), dtype
    return out


def expected_tensors(model: nn.Module) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """name -> (shape, dtype) of every state-dict entry of ``model`` (built on the meta device:
    nothing is allocated), aliases included."""
    return {k: (tuple(t.shape), t.dtype) for k, t in model.state_dict().items()}


def check_weight_files(files: list, expected: dict[str, tuple[tuple[int, ...], torch.dtype]],
                       aliases: dict[str, str]) -> None:
    """The weight files hold every expected tensor once (under any name of its alias group:
    transformers' own save may keep another name than the first) and nothing else, with its
    shape, integer tensors in their own dtype and values in a floating one: checked on the
    headers, before anything is allocated for them (absurd shapes never reach an allocation)."""
    found: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for f in files:
        if not os.path.isfile(f):
            raise corrupt(f"weight file {os.fspath(f)} is missing")
        found.update(read_header(f))
    groups: dict[str, list[str]] = {}
    for name in expected:
        groups.setdefault(aliases.get(name, name), []).append(name)
    missing = sorted(c for c, names in groups.items() if not any(n in found for n in names))
    unexpected = sorted(found.keys() - expected.keys())
    if missing or unexpected:
        raise corrupt(f"the weight files do not match config.json's compression section (missing {missing[:3]}, "
                      f"unexpected {unexpected[:3]})")
    for name, (got_shape, got_dtype) in found.items():
        shape, dtype = expected[name]
        if got_shape != shape or (got_dtype != dtype if not dtype.is_floating_point else not got_dtype.is_floating_point):
            raise corrupt(f"tensor {name!r} is {list(got_shape)} {got_dtype} in the weight files, "
                          f"where config.json implies {list(shape)} {dtype}")


def validate(model: nn.Module) -> None:
    """Check the loaded values every kernel will index with (each layer's ``check_values``)."""
    for name, module in model.named_modules():
        if isinstance(module, CompressedLayer):
            module.check_values(name)


def tie(model: nn.Module, aliases: dict[str, str]) -> None:
    """Make every aliased tensor name point at its canonical tensor again (after loading)."""
    for alias, canonical in aliases.items():
        owner, _, leaf = alias.rpartition(".")
        target = model.get_parameter(canonical) if canonical in dict(model.named_parameters()) else model.get_buffer(canonical)
        if getattr(_get(model, owner), leaf) is not target:
            setattr(_get(model, owner), leaf, target)


def settle(model: nn.Module, dtype: torch.dtype | None) -> None:
    """After the tensors are loaded: check them all (``validate``), then let each compressed layer
    settle (``CompressedLayer.settle``: decode what the file held coded, bring values stored in a
    dtype of their own to the one the model computes in, as ``load_state_dict`` does)."""
    validate(model)
    floating = dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else None
    for module in model.modules():
        if isinstance(module, CompressedLayer):
            module.settle(floating)


def weight_files(folder: str | os.PathLike) -> list[str]:
    """The weight files of a compressed folder: one file, or the shards its index names (this
    format's names, else those of format 2 and before)."""
    for index in (SHARD_INDEX, LEGACY_SHARD_INDEX):
        path = os.path.join(folder, index)
        if os.path.isfile(path):
            try:
                with open(path) as f:
                    names = sorted(set(json.load(f)["weight_map"].values()))
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                raise corrupt(f"{path} is not a shard index") from None
            if not all(isinstance(n, str) and n and os.path.basename(n) == n for n in names):
                raise corrupt(f"{path} names a weight file outside the folder")
            return [os.path.join(folder, n) for n in names]
    present = [n for n in (WEIGHTS, LEGACY_WEIGHTS) if os.path.isfile(os.path.join(folder, n))]
    return [os.path.join(folder, (present or [WEIGHTS])[0])]


def legacy_layout(folder: str | os.PathLike) -> bool:
    """Whether a local folder holds its weights under the plain names (format 2 and before)."""
    has = lambda name: os.path.isfile(os.path.join(folder, name))  # noqa: E731
    return not (has(WEIGHTS) or has(SHARD_INDEX)) and (has(LEGACY_WEIGHTS) or has(LEGACY_SHARD_INDEX))


def travels(cls: type) -> bool:
    """Whether ``cls`` is defined in a file that folders carry: this one or a form's beside it, a
    module of this one's package (a form defined elsewhere, a test's or a plugin's, loads only
    where its class is registered)."""
    return cls.__module__.rpartition(".")[0] == __name__.rpartition(".")[0]


def code_files(model: nn.Module) -> dict[str, str]:
    """The files a folder of ``model`` carries, name -> text: this one, the file of each family of
    forms its layers use, and the entry file (``CODE_FILE``, which ``auto_map`` names) importing
    them relatively, which is how transformers' remote code knows to copy them beside it."""
    imports = {__name__: {"WSCompressConfig", "WSCompressForCausalLM"}}  # module -> the names the entry imports
    for module in model.modules():
        cls = type(module)
        if isinstance(module, CompressedLayer) and travels(cls):
            imports.setdefault(cls.__module__, set()).add(cls.__name__)
    files, lines = {}, []
    for name in sorted(imports, key=lambda n: (n != __name__, n)):
        leaf = name.rpartition(".")[2]
        with open(sys.modules[name].__file__, encoding="utf-8", newline="") as f:
            files[f"{leaf}.py"] = f.read()
        lines.append(f"from .{leaf} import {', '.join(sorted(imports[name]))}  # noqa: F401")
    files[CODE_FILE] = ('"""This folder\'s code (config.json\'s auto_map), written by wscompress: the format and the forms\n'
                        'its layers use, each a file beside this one that transformers\' remote code copies with it."""\n\n'
                        + "\n".join(lines) + "\n")
    return files


def write_code(folder: str | os.PathLike, model: nn.Module) -> None:
    """Write the files ``code_files`` names into ``folder``, where ``auto_map`` finds them
    (trust_remote_code): the travelling files byte for byte, from the copy that runs."""
    for name, text in code_files(model).items():
        with open(os.path.join(folder, name), "w", encoding="utf-8", newline="") as f:
            f.write(text)


# ----------------------------------------------------------------------------- transformers classes

_FAMILY: dict[str, tuple[type, type]] = {}  # base model type -> (config class, model class) made for it


def _stored_dtype(data: dict) -> str | None:
    """The dtype config.json records: ``dtype``, or in format 2 (whose ``dtype`` was a sentence
    that stopped stock classes) ``torch_dtype``."""
    dtype = data.get("dtype")
    if isinstance(dtype, str) and isinstance(getattr(torch, dtype, None), torch.dtype):
        return dtype
    legacy = data.get("torch_dtype")
    return legacy if isinstance(legacy, str) and isinstance(getattr(torch, legacy, None), torch.dtype) else None


def _stale_quantization(quantization: Any) -> bool:
    """Whether a base config's ``quantization_config`` no longer describes the weights: a GGUF
    source's (transformers de-quantizes GGUF weights as it loads them), which would make
    transformers treat the folder as GGUF again (a warning on load, ``save_pretrained`` refused)."""
    return isinstance(quantization, dict) and quantization.get("quant_method") == "gguf"


def writer_version() -> str | None:
    """The installed wscompress's version (None where only this file is: a folder re-saved
    through trust_remote_code), recorded in config.json beside transformers' own."""
    try:
        return importlib.metadata.version("wscompress")
    except importlib.metadata.PackageNotFoundError:
        return None


class WSCompressConfig(PretrainedConfig):
    """``config.json`` of a compressed folder. On disk the base model's config is nested under
    ``base_config`` (so no stock class reads it as its own); in memory a config is an instance of
    a subclass of the base config's class made for it (``family``), so the base model's code
    finds every field it reads, plus ``compression`` (see ``describe``)."""

    model_type = "wscompress"
    base_model_type: ClassVar[str | None] = None  # set on the classes made for each base model type
    base_architecture: ClassVar[str | None] = None
    compression: dict | None = None

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], **kwargs):
        data = dict(config_dict)
        if "base_config" in data:  # config.json's layout
            if not isinstance(data["base_config"], dict) or not isinstance(data.get("compression"), dict):
                raise ValueError("config.json: base_config and compression must be JSON objects; the folder is damaged: "
                                 "write it again with wscompress")
            data = {**data["base_config"], "dtype": _stored_dtype(data), "compression": data["compression"]}
        data.pop("wscompress_version", None)  # the writer's, not this config's: saving records its own
        if _stale_quantization(data.get("quantization_config")):
            del data["quantization_config"]
        base_type = data.pop("model_type", None)
        if base_type in (None, cls.model_type):  # flat, from another config of this family
            base_type = cls.base_model_type
        if base_type is None:
            raise ValueError("a wscompress config needs the base model's type (base_config.model_type)")
        data.pop("auto_map", None)
        config_class = family(base_type)[0]
        return super(WSCompressConfig, config_class).from_dict(data, **kwargs)

    @classmethod
    def wrapping(cls, config: PretrainedConfig, compression: dict) -> WSCompressConfig:
        """A compressed model's config from its base model's (or a compressed one's) config."""
        base_type = getattr(config, "base_model_type", None) or config.model_type
        data = {**config.to_dict(), "model_type": base_type, "compression": compression}
        return family(base_type)[0].from_dict(data)

    def base_config(self) -> PretrainedConfig:
        """The base model's config alone (what a dense export of this model carries)."""
        data = self.to_dict()
        for key in ("compression", "model_type", "auto_map", "architectures"):
            data.pop(key, None)
        return AutoConfig.for_model(self.base_model_type, **data)

    def to_json_string(self, use_diff: bool = True) -> str:
        flat = self.to_diff_dict() if use_diff else self.to_dict()
        compression = flat.pop("compression", None)
        version = flat.pop("transformers_version", None)
        dtype = flat.pop("dtype", None)
        for key in ("model_type", "architectures", "auto_map", "torch_dtype", "wscompress_version"):
            flat.pop(key, None)
        if _stale_quantization(flat.get("quantization_config")):
            del flat["quantization_config"]
        # a plain valid config at both levels (real dtype): readers that only read config.json work
        nested = {"model_type": WSCompressConfig.model_type, "architectures": ["WSCompressForCausalLM"], "auto_map": AUTO_MAP,
                  "dtype": dtype,
                  "base_config": {"model_type": self.base_model_type, "architectures": [self.base_architecture], **flat,
                                  "dtype": dtype},
                  "compression": compression, "transformers_version": version, "wscompress_version": writer_version()}
        return json.dumps(nested, indent=2, sort_keys=False) + "\n"


class WSCompressForCausalLM(PreTrainedModel, GenerationMixin):
    """A causal LM whose layers are stored compressed. ``WSCompressForCausalLM(config)`` and
    ``from_pretrained`` give an instance of the subclass made for the base architecture
    (``WSCompressLlamaForCausalLM`` is a ``LlamaForCausalLM``): the base class builds its
    modules, ``build`` swaps in the compressed layers, transformers loads the tensors."""

    config_class = WSCompressConfig

    def __new__(cls, config: PretrainedConfig | None = None, *args, **kwargs):
        if cls is WSCompressForCausalLM:  # the name config.json gives: become the class of its base architecture
            cls = family(config.base_model_type)[1]
        return super().__new__(cls)

    def __init__(self, config: WSCompressConfig, *args, **kwargs):
        super().__init__(config, *args, **kwargs)  # the base class: its dense modules (empty, on the meta device when loading)
        build(self, config.compression or {})
        self._tied_weights_keys = self.all_tied_weights_keys = self.get_expanded_tied_weights_keys()

    def get_expanded_tied_weights_keys(self, all_submodels: bool = False) -> dict:
        """Every name the file does not hold -> the name it holds (transformers ties them when
        loading, leaves them out when saving), as far as this structure has both names yet."""
        aliases = (self.config.compression or {}).get("tensor_aliases", {})
        names = {n for n, _ in self.named_parameters(remove_duplicate=False)} | {n for n, _ in self.named_buffers(remove_duplicate=False)}
        return {a: c for a, c in aliases.items() if a in names and c in names}

    def get_parameter(self, target: str) -> torch.Tensor:
        """A parameter, or else a buffer of that name: transformers ties names through this, and a
        palettized module shared by several names (the table behind a tied head) has buffers too."""
        try:
            return super().get_parameter(target)
        except AttributeError:
            return self.get_buffer(target)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        if cls is WSCompressForCausalLM:
            config = kwargs.get("config")
            if not isinstance(config, WSCompressConfig):
                hub = {k: kwargs[k] for k in ("cache_dir", "force_download", "local_files_only", "token", "revision",
                                              "subfolder", "proxies") if k in kwargs}
                config = WSCompressConfig.from_pretrained(config or pretrained_model_name_or_path, **hub)
            return family(config.base_model_type)[1].from_pretrained(pretrained_model_name_or_path, *model_args, **kwargs)
        with_info = kwargs.pop("output_loading_info", False)
        folder = os.path.join(os.fspath(pretrained_model_name_or_path), kwargs.get("subfolder") or "")
        if kwargs.get("variant") is None:  # the weights are this format's variant (format 2 and before: plain names)
            kwargs["variant"] = None if legacy_layout(folder) else VARIANT
        if os.path.isdir(folder):  # checked on the headers before transformers allocates anything for them
            config = kwargs.get("config")
            config = config if isinstance(config, WSCompressConfig) else cls.config_class.from_pretrained(folder)
            with torch.device("meta"):
                expected = expected_tensors(cls(config))
            check_weight_files(weight_files(folder), expected, config.compression.get("tensor_aliases", {}))
        model, info = super().from_pretrained(pretrained_model_name_or_path, *model_args, output_loading_info=True, **kwargs)
        wrong = {k: sorted(info[k])[:3] for k in ("missing_keys", "unexpected_keys", "mismatched_keys") if info.get(k)}
        if wrong:  # transformers would fill the gaps with random weights: refuse instead
            raise corrupt(f"{pretrained_model_name_or_path}: the weight files do not match config.json's compression "
                          f"section ({wrong})")
        settle(model, model.config.dtype)
        return (model, info) if with_info else model

    def generate(self, *args, **kwargs):
        """transformers' ``generate``; with wscompress installed, decoding on CPU goes through a
        compiled step kept across processes where it qualifies (``KERNELS["generate"]``)."""
        prepare = KERNELS.get("generate")
        return super().generate(*args, **(kwargs if prepare is None else prepare(self, args, kwargs)))

    def get_compiled_call(self, compile_config):
        """What ``generate`` calls each decoded token when it compiles: wscompress's cached step on
        CPU (``KERNELS["decode_step"]``), transformers' ``torch.compile`` elsewhere."""
        step = KERNELS.get("decode_step")
        call = None if step is None else step(self, compile_config)
        return super().get_compiled_call(compile_config) if call is None else call

    def save_pretrained(self, save_directory, *args, **kwargs) -> None:
        """transformers' save, with the structure described as it is now, the weights as this
        format's variant and this code beside them."""
        adopt(self)  # the structure as it is now
        if kwargs.get("variant") is None:
            kwargs["variant"] = VARIANT
        os.makedirs(save_directory, exist_ok=True)
        if kwargs.get("is_main_process", True):
            write_code(save_directory, self)  # first: a push_to_hub inside the save uploads it too
        super().save_pretrained(save_directory, *args, **kwargs)


def family(base_type: str) -> tuple[type[WSCompressConfig], type[WSCompressForCausalLM]]:
    """The (config, model) classes of compressed models of one base model type, made once:
    subclasses of the base config and causal-LM classes transformers has for ``base_type``,
    registered with ``AutoModelForCausalLM`` so their configs find them."""
    if base_type not in _FAMILY:
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

        if base_type not in CONFIG_MAPPING:
            raise ValueError(f"the compressed model's base type {base_type!r} is not one this transformers knows: "
                             "upgrade transformers")
        base_config = CONFIG_MAPPING[base_type]
        base_model = MODEL_FOR_CAUSAL_LM_MAPPING[base_config]
        config_class = type(f"WSCompress{base_config.__name__}", (WSCompressConfig, base_config),
                            {"model_type": WSCompressConfig.model_type, "base_model_type": base_type,
                             "base_architecture": base_model.__name__, "__module__": __name__})
        model_class = type(f"WSCompress{base_model.__name__}", (WSCompressForCausalLM, base_model),
                           {"config_class": config_class, "__module__": __name__})
        AutoModelForCausalLM.register(config_class, model_class, exist_ok=True)
        _FAMILY[base_type] = config_class, model_class
    return _FAMILY[base_type]


def adopt(model: nn.Module) -> None:
    """Make a model whose modules were swapped in memory (``wscompress.compress``) an instance of
    its compressed-model class, and its config of the matching config class, describing the
    structure it has now: transformers' own ``save_pretrained`` then writes a compressed folder,
    never a base config over compressed weights."""
    if not isinstance(model, WSCompressForCausalLM):
        config_class, model_class = family(model.config.model_type)
        if not isinstance(model, model_class.__mro__[2]):
            raise ValueError(f"{type(model).__name__} is not the causal LM class transformers has for "
                             f"{model.config.model_type!r} ({model_class.__mro__[2].__name__})")
        model.config.__class__ = config_class  # the same object: every submodule holding it sees the change
        model.config.__dict__.pop("model_type", None)  # a GGUF source's config sets its own: the class says it now
        model.__class__ = model_class
    model.config.compression = describe(model)
    if model.config.dtype is None:  # say it: "auto" would otherwise take the first tensor's, maybe a codebook's float16
        model.config.dtype = model.dtype
    model._tied_weights_keys = model.all_tied_weights_keys = model.get_expanded_tied_weights_keys()


def register() -> None:
    """Let ``AutoConfig``/``AutoModelForCausalLM`` load compressed folders without
    trust_remote_code (wscompress calls this on import)."""
    AutoConfig.register(WSCompressConfig.model_type, WSCompressConfig, exist_ok=True)
