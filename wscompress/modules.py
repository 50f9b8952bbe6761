"""Base class and registry of the compressed layers that methods swap into a model.

A compressed layer is a drop-in for ``nn.Linear`` (or ``nn.Embedding``) that stores its weight
in another form. It can describe itself (``spec()``: the JSON-able constructor arguments, so
``storage.load`` can rebuild the structure before loading tensors) and turn back into a dense
module (``to_dense()``) for export to stock transformers.
"""

from __future__ import annotations

import torch
from torch import nn

from .arch import Conv1D

MODULE_TYPES: dict[str, type[nn.Module]] = {}


def register_module(cls: type[nn.Module]) -> type[nn.Module]:
    MODULE_TYPES[cls.__name__] = cls
    return cls


class CompressedLinear(nn.Module):
    """y = x W^T + b with W stored compressed. Subclasses implement dense_weight and spec.

    ``conv1d`` records that the layer replaced a GPT-2 ``Conv1D`` (weight stored (in, out)), so
    ``to_dense`` gives one back: stock GPT-2 checkpoints expect that layout."""

    in_features: int
    out_features: int
    conv1d: bool = False

    def dense_weight(self) -> torch.Tensor:
        """The weight as an (out_features, in_features) tensor."""
        raise NotImplementedError

    def spec(self) -> dict:
        """Constructor keyword arguments that rebuild this module's structure (not its values)."""
        raise NotImplementedError

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
