"""Dense layers stored in fewer bits than float32: float16 (``HalfLinear``) and int8 blocks
(``Int8Linear``, llama.cpp's Q8_0), both ``NarrowLinear``s. Travels with the folders that use it
(``wscompress_format``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .wscompress_format import KERNELS, CompressedLinear, register_layer

NARROW_SLICE_BYTES = 8 << 20  # a NarrowLinear's torch path on CPU converts this much of its weight at a time
INT8_BLOCK = 32  # an Int8Linear's weights per scale (llama.cpp's Q8_0 block)


class NarrowLinear(CompressedLinear):
    """A dense linear stored in fewer bits than float32 (``HalfLinear``, ``Int8Linear``), computed as
    its stored values in the model's dtype. Meant for what every decoded token reads whole, such as
    a tied embedding/head (a fifth of a small model's weights): decoding on CPU multiplies the
    stored values into float32 sums (the form's ``KERNEL`` in ``KERNELS``); elsewhere the weight is
    converted a slice of rows at a time. Its tensors are stored as integers (float16 ones as their
    int16 bits), so ``model.to(dtype)`` leaves them as they are; ``dtype_probe`` (empty, not
    saved) follows ``.to(dtype)`` instead and tells the dtype the layer returns rows and dense
    weights in. A form gives ``from_weight``, ``stored`` and ``decode``."""

    TORCH_PATH = "weight converted a slice of rows at a time (torch)"

    def __init__(self, in_features: int, out_features: int, bias: bool = False, conv1d: bool = False):
        super().__init__()
        self.in_features, self.out_features, self.conv1d = in_features, out_features, conv1d
        self.register_buffer("dtype_probe", torch.empty(0), persistent=False)
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def stored(self) -> tuple[torch.Tensor, ...]:
        """The stored tensors, as the form's kernel takes them after the input."""
        raise NotImplementedError

    def decode(self, rows: slice | torch.Tensor) -> torch.Tensor:
        """Rows of the weight (a slice, or ids of any shape) in a dtype that holds them exactly."""
        raise NotImplementedError

    def _finish(self, weight: torch.Tensor, bias: torch.Tensor | None) -> NarrowLinear:
        """``from_weight``'s last step: on ``weight``'s device, returning its dtype, with ``bias``."""
        self.to(weight.device)
        self.dtype_probe = self.dtype_probe.to(weight.dtype)
        if bias is not None:
            self.bias = nn.Parameter(bias.detach().clone())
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fast = KERNELS.get(self.KERNEL)
        y = None if fast is None else fast(x, *self.stored(), self.bias)
        if y is not None:
            return y
        # the torch path (prefill, training, GPUs): the weight converted for this call, on CPU a slice of
        # rows at a time that stays in the caches (a head's whole 113 MB float32 copy cost more than its product)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        step = self.out_features if x.device.type != "cpu" else max(1, NARROW_SLICE_BYTES // (4 * self.in_features))
        parts = [F.linear(x, self.decode(slice(r, r + step)).to(x.dtype), None if bias is None else bias[r: r + step])
                 for r in range(0, self.out_features, step)]
        return parts[0] if len(parts) == 1 else torch.cat(parts, -1)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` (any shape) of the weight (an embedding lookup in this table): (*ids.shape, in_features)."""
        return self.decode(ids).to(self.dtype_probe.dtype)

    def settle(self, dtype: torch.dtype | None) -> None:
        if dtype is not None:  # the dtype it returns rows and dense weights in (its stored tensors stay as stored)
            self.dtype_probe = self.dtype_probe.to(dtype)

    def dense_weight(self) -> torch.Tensor:
        return self.decode(slice(None)).to(self.dtype_probe.dtype)

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [] if self.bias is None else [self.bias]  # the weight stays as stored

    def spec(self) -> dict:
        return {"in_features": self.in_features, "out_features": self.out_features, "bias": self.bias is not None,
                "conv1d": self.conv1d}


@register_layer
class HalfLinear(NarrowLinear):
    """A dense linear stored in float16 (``bits16``: its int16 bits): half the bytes of float32, at
    a relative rounding of at most 2^-11 a weight; decoding on CPU: ``KERNELS["half"]``."""

    KERNEL = "half"

    def __init__(self, in_features: int, out_features: int, bias: bool = False, conv1d: bool = False):
        super().__init__(in_features, out_features, bias, conv1d)
        self.register_buffer("bits16", torch.empty(out_features, in_features, dtype=torch.int16))

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None, conv1d: bool = False) -> HalfLinear:
        """The layer for a dense (out, in) ``weight`` (rounded to float16) and ``bias``, in their dtype and device."""
        layer = cls(weight.shape[1], weight.shape[0], bias is not None, conv1d)
        layer.bits16 = weight.detach().to(torch.float16).contiguous().view(torch.int16)
        return layer._finish(weight, bias)

    @property
    def weight16(self) -> torch.Tensor:
        return self.bits16.view(torch.float16)

    def stored(self) -> tuple[torch.Tensor, ...]:
        return (self.weight16,)

    def decode(self, rows: slice | torch.Tensor) -> torch.Tensor:
        return self.weight16[rows]


@register_layer
class Int8Linear(NarrowLinear):
    """A dense linear stored as llama.cpp's Q8_0 stores one: each run of ``INT8_BLOCK`` (32) weights
    of a row as int8 values ``q`` times one float16 scale (``scale_bits``: its int16 bits), the
    run's largest magnitude / 127. 8.5 bits a weight, the rounding at most 1/254 of that largest
    magnitude; decoding on CPU: ``KERNELS["int8"]`` (float32 sums)."""

    KERNEL = "int8"

    def __init__(self, in_features: int, out_features: int, bias: bool = False, conv1d: bool = False):
        super().__init__(in_features, out_features, bias, conv1d)
        self.register_buffer("q", torch.empty(out_features, in_features, dtype=torch.int8))
        self.register_buffer("scale_bits", torch.empty(out_features, in_features // INT8_BLOCK, dtype=torch.int16))

    @classmethod
    def check_spec(cls, **spec) -> str | None:
        if spec["in_features"] % INT8_BLOCK:
            return f"in_features={spec['in_features']} is not a multiple of its {INT8_BLOCK}-weight blocks"
        return super().check_spec(**spec)

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None, conv1d: bool = False) -> Int8Linear:
        """The layer for a dense (out, in) ``weight`` (in a multiple of ``INT8_BLOCK``) and ``bias``, in their dtype and device."""
        out, inp = weight.shape
        blocks = weight.detach().float().reshape(out, inp // INT8_BLOCK, INT8_BLOCK)
        scale = (blocks.abs().amax(-1) / 127).to(torch.float16)  # as stored: the values are rounded against it
        s = scale.float()[..., None]
        layer = cls(inp, out, bias is not None, conv1d)
        layer.q = torch.where(s > 0, blocks / s, 0).round().clamp(-127, 127).to(torch.int8).reshape(out, inp)
        layer.scale_bits = scale.view(torch.int16)
        return layer._finish(weight, bias)

    @property
    def scale16(self) -> torch.Tensor:
        return self.scale_bits.view(torch.float16)

    def stored(self) -> tuple[torch.Tensor, ...]:
        return self.q, self.scale16

    def parameter_count(self) -> int:  # its weights, not also their scales
        return self.out_features * self.in_features + (self.out_features if self.bias is not None else 0)

    def decode(self, rows: slice | torch.Tensor) -> torch.Tensor:
        q = self.q[rows].float()  # exact in float32: 8 significant bits times 11
        return (q.unflatten(-1, (-1, INT8_BLOCK)) * self.scale16[rows].float()[..., None]).flatten(-2)


