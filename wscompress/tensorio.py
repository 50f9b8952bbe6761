"""Writing safetensors files without a second copy in memory.

``safetensors.torch.save_file`` turns every tensor into a ``bytes`` object before writing, so
saving holds the data twice: a layer's 250 MB Gram matrix or a 1 GB shard costs as much again.
``save`` writes the same format (8-byte header length, JSON header, the tensors' bytes back to
back) straight from each tensor's memory. Reading stays with the ``safetensors`` package.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
          torch.bool: "BOOL"}


def save(tensors: dict[str, torch.Tensor], path: str | Path, metadata: dict[str, str] | None = None) -> None:
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
