"""Rotated layers: a linear whose input is turned by a random orthogonal transform, with an inner
linear holding the weight turned the same way (incoherence processing, as QuIP# and QuaRot do).
Travels with the folders that use it (``wscompress_format``)."""

from __future__ import annotations

import functools
import math

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from .wscompress_format import CompressedLinear, corrupt, register_layer, weight_of


@functools.lru_cache(maxsize=None)
def hadamard(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The normalised Sylvester-Hadamard matrix of order n (a power of two): symmetric and
    orthogonal, H H = I, every entry ±1/√n (held once per order, dtype and device)."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / math.sqrt(n)).to(dtype=dtype, device=device)


@register_layer
class RotatedLinear(CompressedLinear):
    """y = inner(x Q) with Q = diag(signs) (I ⊗ H): the input's columns times random signs, then
    each run of ``block`` columns times the normalised Hadamard matrix H. ``inner`` holds W Q, so
    the layer computes x Wᵀ exactly until a later stage compresses ``inner``: a row's outliers
    are spread over the block's columns and the weights ``inner`` holds are near-Gaussian, which
    codebooks and grids fit with less error. Q is not stored: only the signs (a byte a column)."""

    CHILDREN = ("inner",)
    UNCOUNTED = ("signs",)  # a byte a column, no weight
    TORCH_PATH = "the input turned by its block Hadamard rotation (torch), then its inner layer"

    def __init__(self, in_features: int, out_features: int, block: int, bias: bool = False, conv1d: bool = False):
        super().__init__()
        self.in_features, self.out_features, self.block, self.conv1d = in_features, out_features, block, conv1d
        self.register_buffer("signs", torch.empty(in_features, dtype=torch.int8))
        self.inner = nn.Linear(in_features, out_features, bias=bias)

    @classmethod
    def check_spec(cls, **spec) -> str | None:
        block, cols = spec["block"], spec["in_features"]
        if block < 1 or block & (block - 1) or cols % block:
            return f"block={block} is not a power of two dividing in_features={cols}"
        return super().check_spec(**spec)

    def check_values(self, where: str) -> None:
        if not self.signs.is_meta and not bool((self.signs.abs() == 1).all()):
            raise corrupt(f"{where}.signs holds values other than -1 and 1")

    @classmethod
    def turning(cls, original: nn.Module, block: int, generator: torch.Generator) -> RotatedLinear:
        """The rotated stand-in for the linear ``original`` (its bias, dtype and device kept), with
        signs drawn from ``generator``; the turned weight is computed in float64."""
        w = weight_of(original).detach()
        bias = getattr(original, "bias", None)
        layer = cls(w.shape[1], w.shape[0], block, bias is not None, conv1d=isinstance(original, Conv1D))
        layer.to(device=w.device, dtype=w.dtype)
        layer.signs = (torch.randint(0, 2, (w.shape[1],), generator=generator) * 2 - 1).to(torch.int8).to(w.device)
        with torch.no_grad():
            layer.inner.weight.copy_(layer.rotate(w.double()))  # (W Q) row by row: each row is turned as x is
            if bias is not None:
                layer.inner.bias.copy_(bias)
        return layer

    @property
    def bias(self) -> torch.Tensor | None:
        return self.inner.bias

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """x Q (over x's last dimension)."""
        return ((x * self.signs.to(x.dtype)).unflatten(-1, (-1, self.block)) @ self._hadamard(x)).flatten(-2)

    def _hadamard(self, x: torch.Tensor) -> torch.Tensor:
        """H in x's dtype and device, kept on the layer by an eager call: a compiled graph reads
        it as a constant instead of tracing ``hadamard``'s cache."""
        h = self.__dict__.get("_h")
        compiling = torch.compiler.is_compiling()
        if h is None or not compiling and (h.dtype != x.dtype or h.device != x.device):
            h = hadamard(self.block, x.dtype, x.device)
            if not compiling:
                self.__dict__["_h"] = h
        return h

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(self.rotate(x))

    def dense_weight(self) -> torch.Tensor:
        """W = (W Q) Qᵀ: each row times I ⊗ H (H is symmetric), then by the signs."""
        w = weight_of(self.inner)  # ``inner`` may be compressed in turn
        return (w.unflatten(-1, (-1, self.block)) @ hadamard(self.block, w.dtype, w.device)).flatten(-2) \
            * self.signs.to(w.dtype)

    def trainable_parameters(self) -> list[nn.Parameter]:
        return []  # the rotation holds nothing to train: its inner layer, if compressed, says what of it trains

    def spec(self) -> dict:
        return {"in_features": self.in_features, "out_features": self.out_features, "block": self.block,
                "bias": self.bias is not None, "conv1d": self.conv1d}
