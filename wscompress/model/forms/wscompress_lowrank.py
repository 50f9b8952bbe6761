"""Low-rank layers: a basis and coefficients (SVD, SVD-LLM), a basis shared by a group of layers
(Basis Sharing), and a shared base plus a layer's own low-rank delta (soft sharing). Travels with
the folders that use it (``wscompress_format``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.pytorch_utils import Conv1D

from .wscompress_format import KERNELS, CompressedLinear, register_layer, weight_of


@register_layer
class LowRankLinear(CompressedLinear):
    """y = coeff(basis(x)): a (rank, in) basis then (out, rank) coefficients (+ the original bias)."""

    CHILDREN = ("basis", "coeff")
    KERNEL = "low_rank"
    TORCH_PATH = "two matmuls (torch)"

    def __init__(self, in_features: int, out_features: int, rank: int, bias: bool = False, conv1d: bool = False):
        super().__init__()
        self.in_features, self.out_features, self.rank = in_features, out_features, rank
        self.conv1d = conv1d
        self.basis = nn.Linear(in_features, rank, bias=False)
        self.coeff = nn.Linear(rank, out_features, bias=bias)

    @property
    def bias(self) -> torch.Tensor | None:
        return self.coeff.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        basis, coeff = self.basis, self.coeff
        fast = KERNELS.get(self.KERNEL)
        if fast is not None and type(basis) is nn.Linear and type(coeff) is nn.Linear:  # not palettized in turn
            y = fast(x, basis.weight, coeff.weight, coeff.bias)
            if y is not None:  # decoding on CPU: one fused call
                return y
        return coeff(basis(x))

    def dense_weight(self) -> torch.Tensor:
        return weight_of(self.coeff) @ weight_of(self.basis)  # either factor may be palettized in turn

    def spec(self) -> dict:
        return {"in_features": self.in_features, "out_features": self.out_features, "rank": self.rank,
                "bias": self.bias is not None, "conv1d": self.conv1d}

    @classmethod
    def replacing(cls, original: nn.Module, coeff: torch.Tensor, basis: nn.Linear | torch.Tensor) -> LowRankLinear:
        """The low-rank stand-in for ``original`` (its bias, dtype and device kept): coefficients
        (out, rank) and a basis given as a (rank, in) tensor or as an existing module to share."""
        w = weight_of(original)
        bias = getattr(original, "bias", None)
        new = cls(w.shape[1], w.shape[0], coeff.shape[1], bias=bias is not None, conv1d=isinstance(original, Conv1D))
        new.to(device=w.device, dtype=w.dtype)
        with torch.no_grad():
            if isinstance(basis, nn.Linear):
                new.basis = basis
            else:
                new.basis.weight.copy_(basis)
            new.coeff.weight.copy_(coeff)
            if bias is not None:
                new.coeff.bias.copy_(bias)
        return new


@register_layer
class SharedBasisLinear(LowRankLinear):
    """coeff(basis(x)) whose ``basis`` module is shared with the other layers of its group;
    saving stores it once and loading re-ties it."""


@register_layer
class LowRankDeltaLinear(CompressedLinear):
    """y = x (W_c + A B)^T + b: ``base`` (W_c) is an nn.Linear shared by a window of layers;
    A (out, rank), B (rank, in) and the bias are this layer's own."""

    CHILDREN = ("base",)
    TORCH_PATH = "the shared base's matmul plus two of its low-rank delta (torch)"

    def __init__(self, in_features: int, out_features: int, rank: int, bias: bool = False, conv1d: bool = False):
        super().__init__()
        self.in_features, self.out_features, self.rank, self.conv1d = in_features, out_features, rank, conv1d
        self.base = nn.Linear(in_features, out_features, bias=False)
        self.a = nn.Parameter(torch.empty(out_features, rank))
        self.b = nn.Parameter(torch.empty(rank, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + F.linear(F.linear(x, self.b), self.a, self.bias)

    def dense_weight(self) -> torch.Tensor:
        return self.base.weight + self.a @ self.b

    def spec(self) -> dict:
        return {"in_features": self.in_features, "out_features": self.out_features, "rank": self.rank,
                "bias": self.bias is not None, "conv1d": self.conv1d}

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [self.a, self.b]  # the shared base stays fixed: only the deltas are trained

    def penalty(self) -> torch.Tensor:
        """||A B||_F^2, computed as sum((A^T A) * (B B^T)) without forming A B."""
        return ((self.a.T @ self.a) * (self.b @ self.b.T)).sum()


