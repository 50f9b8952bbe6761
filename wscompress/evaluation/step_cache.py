"""Decode steps compiled once per machine and model structure, and kept across processes.

Plain ``generate()`` on a compressed model runs every token through Python, module by module:
on a small model that costs as much as the products themselves (docs/runtime.md). A compiled
step removes it, but ``torch.compile`` traces the whole model again in every process, about a
minute on two cores. Here a step is compiled once with torch's ahead-of-time precompile
(``torch.compile(...).aot_compile``) and saved as ``<key>.step`` in ``folder()``; a later
process loads it in seconds, without tracing.

The step takes the model as its argument: one file serves every model of the same structure
(class, config, every tensor's shape and dtype, the compressed layers' kernel layouts included)
with the same call (batch, cache length, the arguments ``generate`` passes), on the same CPU,
thread count, torch, transformers and wscompress source. That key stands in for dynamo's guards,
which the step drops, as ``StaticDecoder`` does: checking thousands of them before each call
cost a fifth of a compiled step.

How ``generate()`` uses it, on CPU (``WSCompressForCausalLM.generate`` asks ``prepare_generate``):
decoding runs on a static KV cache whose length is rounded up to ``CACHE_BLOCK`` (so prompts of
other lengths reuse the step) and each decoded token goes through ``CachedStep``. Where no step
is saved yet, it decodes eagerly, as before, and ``WSCOMPRESS_COMPILE`` says what happens next:

- unset (``auto``): a background process (``wscompress precompile``) loads the model's folder,
  compiles the step and saves it; later calls and processes use it.
  The first call is as fast as before; only a model loaded from a compressed folder qualifies.
- ``1``: compile here, on the first decoded token (about a minute), and save.
- ``0``: none of this: transformers' own ``generate``.

``compile_decode`` (an explicit opt-in) compiles here on a miss too. Saved steps are pickles
that torch writes and reads; they live in the user's own cache folder, written by this user's
own processes, as torch's inductor cache does.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
import warnings
import weakref
from functools import cache, partial
from pathlib import Path
from typing import Any, Callable
from unittest.mock import patch

import torch
from torch import nn

from ..io.files import cache_dir
from ..model.forms import wscompress_format
from .decode import cache_argument, compile_config

CACHE_BLOCK = 256  # static caches are a multiple of this long: prompts of other lengths reuse a step
MAX_CACHE = 4096  # longer generations keep transformers' dynamic cache (a static one allocates the whole length)
SOURCES = ("model/forms/*.py", "kernels/__init__.py", "kernels/lut.cpp", "kernels/lowrank.cpp",
           "evaluation/step_cache.py")  # the code a step traces or calls: a change to any makes a new key
FORCE_GQA = "TRANSFORMERS_SDPA_FORCE_GQA"  # transformers' switch: grouped K/V into attention as they are
ENV = ("WSCOMPRESS_Q8", "WSCOMPRESS_KERNELS", "WSCOMPRESS_INT8_PREFILL", "WSCOMPRESS_AMX", "WSCOMPRESS_MARCH")

_loaded: dict[str, Callable] = {}  # key -> step, loaded or compiled in this process


def available() -> bool:
    """Whether this torch can precompile a step (``aot_compile``, torch 2.9 and later)."""
    return hasattr(torch.compiler, "load_compiled_function")


def policy() -> str:
    """``WSCOMPRESS_COMPILE``: ``0`` off, ``1`` compile in this process, else ``auto``."""
    return {"0": "off", "1": "now"}.get(os.environ.get("WSCOMPRESS_COMPILE", ""), "auto")


def folder() -> Path:
    """Where steps are saved: ``WSCOMPRESS_STEP_CACHE``, else ``<cache>/steps``."""
    return Path(os.environ.get("WSCOMPRESS_STEP_CACHE") or cache_dir() / "steps")


def _tensor(t: torch.Tensor) -> list:
    return [list(t.shape), list(t.stride()), str(t.dtype), t.device.type]


def _held(value: Any, depth: int = 0) -> list:
    """The tensors inside a module attribute (a kernel layout is a tuple of tensors, tuples and
    scalars): their shapes and dtypes, which the compiled graph specialises on."""
    if isinstance(value, torch.Tensor):
        return [_tensor(value)]
    if isinstance(value, (tuple, list)) and depth < 3:
        return [held for v in value if (held := _held(v, depth + 1))]
    return []


def model_key(model: nn.Module) -> list:
    """What a step compiled for ``model`` depends on in the model: its class, config and every
    tensor a module holds (parameters, buffers, kernel layouts), with each module's public scalars."""
    config = {k: v for k, v in model.config.to_dict().items() if k not in ("_name_or_path", "transformers_version")}
    parts: list = [type(model).__qualname__, json.dumps(config, sort_keys=True, default=str)]
    for name, module in model.named_modules(remove_duplicate=False):
        part: list = [name, type(module).__qualname__]
        for attr, value in sorted(vars(module).items()):
            if attr in ("_parameters", "_buffers"):
                part += [[n, _tensor(t)] for n, t in value.items() if t is not None]
            elif attr != "_modules" and (held := _held(value)):
                part.append([attr, held])
            elif (not attr.startswith("_") and attr != "name_or_path"
                  and isinstance(value, (bool, int, float, str, type(None)))):
                part.append([attr, value])
        parts.append(part)
    return parts


def call_key(kwargs: dict) -> list:
    """What a step depends on in one call: each argument's shape and dtype, the cache's kind and
    length, other values as they are."""
    parts = []
    for name, value in sorted(kwargs.items()):
        if isinstance(value, torch.Tensor):
            parts.append([name, _tensor(value)])
        elif isinstance(value, (bool, int, float, str, type(None))):
            parts.append([name, value])
        else:
            parts.append([name, type(value).__qualname__, cache_length(value)])
    return parts


def cache_length(cache: Any) -> int | None:
    """A KV cache's length (transformers' method for it has had two names), None for other objects."""
    length = getattr(cache, "get_max_length", None) or getattr(cache, "get_max_cache_shape", None)
    return length() if callable(length) else None


@cache
def _machine() -> list:
    """What every key holds for this process: versions, the kernels' build (torch's folder, the
    CPU's flags), the traced code."""
    import transformers

    from ..kernels import _build_folder

    here = Path(__file__).resolve().parents[1]
    code = hashlib.sha256(b"".join(f.read_bytes() for s in SOURCES for f in sorted(here.glob(s)))).hexdigest()
    return [torch.__version__, transformers.__version__, sys.version, _build_folder(), code]


def step_key(model: nn.Module, kwargs: dict) -> str:
    """The file name of the step for this model and call on this machine."""
    whole = [_machine(), torch.get_num_threads(), torch.is_grad_enabled(), str(torch.get_default_dtype()),
             [os.environ.get(e) for e in ENV], model_key(model), call_key(kwargs)]
    return hashlib.sha256(json.dumps(whole, default=str).encode()).hexdigest()[:32]


def _forward(model: nn.Module, **kwargs) -> torch.Tensor:
    return model(**kwargs).logits


def compile_step(model: nn.Module, kwargs: dict, key: str) -> Callable:
    """Compile the step for ``kwargs``' shapes, save it as ``<key>.step`` (whole or not at all)
    and return it. Guards are dropped: the key says what the step holds for."""
    # no size and alignment checks on the step's inputs either: the key fixed them, and each call
    # would check every one of its tensors (parameters, layouts: ~1 600 on SmolLM2)
    step = torch.compile(_forward, fullgraph=True, dynamic=False,
                         options={"guard_filter_fn": lambda entries: [False] * len(entries),
                                  "size_asserts": False, "alignment_asserts": False})
    # attention takes grouped K/V as they are: with a mask, transformers repeats them for every
    # query head first, a copy of the whole static cache per layer and token. torch's CPU
    # attention takes the groups itself; a CUDA one
    # would fall back to its slow path, but steps here are for CPU only
    with patch.dict(os.environ, {FORCE_GQA: "1"}):
        compiled = step.aot_compile(((model,), kwargs))
    folder().mkdir(parents=True, exist_ok=True, mode=0o700)
    compiled.save_compiled_function(str(folder() / f"{key}.step"))
    return compiled


def load_step(key: str) -> Callable | None:
    """The saved step of this key, or None where there is none (or it no longer loads: a torch
    upgraded in place; the file and its log are removed, so the step is compiled again)."""
    path = folder() / f"{key}.step"
    if not path.exists():
        return None
    try:
        with open(path, "rb") as f:
            return torch.compiler.load_compiled_function(f)
    except Exception as err:  # noqa: BLE001 - an unreadable step is a cache miss, never a failed generate
        warnings.warn(f"wscompress: the compiled decode step {path} does not load ({type(err).__name__}: {err}); "
                      "removed, decoding eagerly", stacklevel=3)
        path.unlink(missing_ok=True)
        path.with_suffix(".log").unlink(missing_ok=True)
        return None


def source_folder(model: nn.Module) -> Path | None:
    """The compressed folder ``model`` was loaded from, where it still describes the model: what a
    background process can load to compile the same step."""
    path = Path(str(getattr(model.config, "_name_or_path", "") or ""))
    if not isinstance(model, wscompress_format.WSCompressForCausalLM) or not (path / "config.json").is_file():
        return None
    try:
        stored = json.loads((path / "config.json").read_text()).get("compression")
    except (OSError, ValueError):
        return None
    return path if stored == json.loads(json.dumps(wscompress_format.describe(model))) else None


def start_background(model: nn.Module, kwargs: dict, key: str) -> bool:
    """Compile this step in a process of its own, once per key: its log, ``<key>.log``, marks the
    attempt, so a step that failed to compile is not tried again by every later process."""
    source = source_folder(model)
    ids = kwargs.get("input_ids")
    length = cache_length(kwargs.get("cache", kwargs.get("past_key_values")))
    if source is None or ids is None or not length or length < 0:
        return False
    folder().mkdir(parents=True, exist_ok=True, mode=0o700)
    try:
        log = open(folder() / f"{key}.log", "x")
    except FileExistsError:  # compiling now, or tried before: its log says how it went
        return False
    with log:
        log.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} compiling the decode step of {source}\n")
        log.flush()
        subprocess.Popen([sys.executable, "-m", "wscompress.cli", "precompile", str(source), "--key", key,
                          "--batch", str(ids.shape[0]), "--max-length", str(length),
                          "--threads", str(torch.get_num_threads()), "--dtype", str(model.dtype).removeprefix("torch."),
                          "--quiet"],
                         stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                         start_new_session=True)  # outlives this process; Ctrl-C here does not stop it
    return True


class CachedStep:
    """``model(**kwargs)`` for the decode steps of one ``generate`` call: the compiled step for
    their key where one is loaded or saved, else eager (see the module's docstring for what a
    miss starts). The first time a model decodes with such a call, its first step runs eagerly:
    layers build their kernel layouts, which the key reads, and its output shows what the
    compiled step's must hold; later ``generate`` calls find the step by the call and the
    model's modules (``_remembered``). ``compile_now``: compile on a miss, here."""

    def __init__(self, model: nn.Module, compile_now: bool):
        self.model, self.compile_now = model, compile_now
        self.step: Callable | None = None

    def __call__(self, **kwargs):
        if self.step is None:
            self.step = _remembered(self.model, kwargs)
        if self.step is None:
            out = self.model(**kwargs)
            self.step = self._find(kwargs, out)
            return out
        return self.step(**kwargs)

    def _find(self, kwargs: dict, out) -> Callable:
        # the step returns the logits alone (a compiled step returning transformers' output
        # object did not load in another process); the output's other fields may only be the
        # cache it was given, set again around each call
        names = {field: next((n for n, v in kwargs.items() if v is value), None) for field, value in out.items()
                 if field != "logits"}
        if None in names.values():  # hidden states or attentions asked for: eager
            return self.model
        key = step_key(self.model, kwargs)
        step = _loaded.get(key) or load_step(key)
        if step is None and self.compile_now:
            try:
                step = compile_step(self.model, kwargs, key)
            except Exception as err:  # noqa: BLE001 - an architecture the compiler cannot take decodes eagerly, as before
                warnings.warn(f"wscompress: compiling the decode step failed ({type(err).__name__}: "
                              f"{str(err).splitlines()[0] if str(err) else ''}); decoding eagerly", stacklevel=3)
        elif step is None and policy() == "auto":
            start_background(self.model, kwargs, key)
        if step is None:
            return self.model
        _loaded[key] = step
        call = partial(_output, type(out), names, step)  # not holding the model: the memo's values must not keep its key alive
        modules, calls = _memo.get(self.model, (None, {}))
        if modules != (current := _modules(self.model)):  # first, or its modules swapped since: remember anew
            modules, calls = _memo[self.model] = current, {}
        calls[_signature(kwargs)] = call
        return partial(call, self.model)


_memo: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> (its modules, {call: step(model, **kwargs)})


def _modules(model: nn.Module) -> tuple[int, ...]:
    """The model's modules by identity: a module swapped in (another structure) changes it."""
    return tuple(map(id, model.modules()))


def _signature(kwargs: dict) -> str:
    return json.dumps([call_key(kwargs), torch.get_num_threads(), torch.is_grad_enabled(),
                       [os.environ.get(e) for e in ENV]], default=str)


def _remembered(model: nn.Module, kwargs: dict) -> Callable | None:
    """The step this model took for such a call before in this process, while its modules are the
    same ones: no eager step and no key (20 ms on SmolLM2) at each ``generate``."""
    modules, calls = _memo.get(model, (None, {}))
    call = calls.get(_signature(kwargs)) if modules == _modules(model) else None
    return None if call is None else partial(call, model)


def _output(kind: type, names: dict[str, str], step: Callable, model: nn.Module, **kwargs):
    return kind(logits=step(model, **kwargs), **{field: kwargs[name] for field, name in names.items()})


def auto_compile_config():
    """The compile config ``prepare_generate`` passes: transformers then asks the model for a
    compiled call (``decode_step``) on CPU too. Marked as automatic: a miss compiles in the background."""
    config = compile_config()
    config._wscompress_auto = True
    return config


_OWN_CACHE = ("past_key_values", "cache", "cache_implementation", "compile_config", "assistant_model",
              "inputs_embeds", "prompt_lookup_num_tokens", "custom_generate", "generation_config")


def prepare_generate(model: nn.Module, args: tuple, kwargs: dict) -> dict:
    """``generate``'s arguments, with a static cache and the automatic compile config where
    decoding qualifies: on CPU, greedy or sampled (one beam), from token ids, with neither a cache
    nor a generation config of the caller's, at most MAX_CACHE positions; unchanged otherwise."""
    if policy() == "off" or not available() or torch.compiler.is_compiling() or model.device.type != "cpu":
        return kwargs
    ids = args[0] if args else kwargs.get("inputs", kwargs.get("input_ids"))
    if (len(args) > 1 or any(kwargs.get(k) is not None for k in _OWN_CACHE) or not isinstance(ids, torch.Tensor)
            or ids.dim() != 2 or ids.is_floating_point()):
        return kwargs
    config = model.generation_config
    if (kwargs.get("num_beams") or config.num_beams or 1) > 1 or config.cache_implementation or config.compile_config:
        return kwargs
    new = kwargs.get("max_new_tokens", config.max_new_tokens)
    total = ids.shape[1] + new if new is not None else kwargs.get("max_length", config.max_length)
    if total is None or total > MAX_CACHE:
        return kwargs
    from transformers import StaticCache

    length = cache_length_for(max(total, ids.shape[1] + 1))
    return {**kwargs, cache_argument(model): StaticCache(config=model.config, max_cache_len=length),
            "compile_config": auto_compile_config()}


def decode_step(model: nn.Module, compile_config) -> Callable | None:
    """The call transformers' ``generate`` makes each decoded token on CPU: a ``CachedStep``;
    None elsewhere (CUDA keeps transformers' own compile)."""
    if policy() == "off" or not available() or model.device.type != "cpu":
        return None
    return CachedStep(model, compile_now=policy() == "now" or not getattr(compile_config, "_wscompress_auto", False))


wscompress_format.KERNELS.update(generate=prepare_generate, decode_step=decode_step)


def cache_length_for(total: int) -> int:
    """The static cache ``generate`` decodes on for ``total`` positions (prompt and new tokens)."""
    return -(-max(total, 1) // CACHE_BLOCK) * CACHE_BLOCK


def precompile(folder_path: str | os.PathLike, batch: int = 1, max_length: int = CACHE_BLOCK,
               threads: int | None = None, dtype: str | None = None) -> tuple[list[str], float]:
    """Compile and save the decode step ``generate()`` takes for a compressed folder on this
    machine (``wscompress precompile``; what a first ``generate()`` starts in the background):
    ``batch`` sequences, at most ``max_length`` positions, ``threads`` (default: torch's).
    Returns the keys saved and the seconds it took."""
    from transformers import StaticCache

    from ..errors import UsageError
    from ..io.checkpoints import load_model
    from ..recipe.schema import ModelConfig

    if not (Path(folder_path) / "config.json").is_file():
        raise UsageError(f"precompile: {folder_path} is not a model folder (no config.json)",
                         "give the folder `wscompress compress` wrote")
    if threads:
        torch.set_num_threads(threads)
    model, _ = load_model(ModelConfig(path=str(folder_path), dtype=dtype or "auto", device="cpu"))
    if not isinstance(model, wscompress_format.WSCompressForCausalLM):
        raise UsageError(f"precompile: {folder_path} is not a compressed folder", "give the folder `wscompress compress` wrote")
    if not available():
        raise UsageError(f"precompile: torch {torch.__version__} cannot save compiled steps", "upgrade torch (2.9 or later)")
    model.eval()
    start, before = time.perf_counter(), set(_loaded)
    prompt = torch.randint(0, model.config.vocab_size, (batch, 4), generator=torch.Generator().manual_seed(0))
    config = compile_config()  # not the automatic one: compile here
    # whatever the environment says, compiling is what was asked for
    with patch.dict(os.environ, {"WSCOMPRESS_COMPILE": "1"}), torch.no_grad():
        # three tokens: the prompt's, an eager step, the compiled one
        model.generate(prompt, max_new_tokens=3, min_new_tokens=3, do_sample=False, compile_config=config,
                       **{cache_argument(model): StaticCache(config=model.config, max_cache_len=cache_length_for(max_length))})
    return sorted(set(_loaded) - before), time.perf_counter() - start
