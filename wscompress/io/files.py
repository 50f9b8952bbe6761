"""Files: where wscompress keeps them (``cache_dir``), folders that replace an old one only
when complete (``atomic_dir``), and safetensors written without a second copy in memory
(``save_tensors``).

``safetensors.torch.save_file`` turns every tensor into a ``bytes`` object before writing, so
saving holds the data twice: a layer's 250 MB Gram matrix or a 1 GB shard costs as much again.
``save_tensors`` writes the same format (8-byte header length, JSON header, the tensors' bytes
back to back) straight from each tensor's memory. Reading stays with the ``safetensors`` package.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch

DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
          torch.bool: "BOOL"}


def save_tensors(tensors: dict[str, torch.Tensor], path: str | Path, metadata: dict[str, str] | None = None) -> None:
    """Write ``tensors`` (any device; each is copied to the CPU alone, if at all) as a safetensors file."""
    header: dict[str, dict | dict[str, str]] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for t in tensors.values():
            if t.numel():
                f.write(memoryview(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()))


def cache_dir() -> Path:
    return Path(os.environ.get("WSCOMPRESS_CACHE", Path.home() / ".cache" / "wscompress"))


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
