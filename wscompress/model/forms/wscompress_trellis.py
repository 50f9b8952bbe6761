"""Trellis-coded layers (``TrellisLinear``): each weight row a walk through a bit-shift trellis
whose states decode through a computed Gaussian code, QTIP-style. Travels with the folders that
use it (``wscompress_format``)."""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from .wscompress_format import KERNELS, CompressedLinear, corrupt, register_layer

# state_bits the code may have: the decoder reads a state from 3 bytes at any bit offset
MAX_STATE_BITS = 17
# a walk codes a tile of TILE x TILE weights (rows x columns), down each column in turn: its
# error is then searched a block of TILE columns at a time with error feedback between blocks
# (QTIP's tiles), and it starts afresh, so no block's walk is held to where another's ended
TILE = 16
ONE_MAD = (34038481, 76625530)  # QTIP's multiplier and increment
ONE_MAD_STD = math.sqrt(4 * (256 ** 2 - 1) / 12)  # of a sum of four uniform bytes, whose mean is 510


@functools.lru_cache(maxsize=None)
def code(state_bits: int) -> torch.Tensor:
    """The code's values (2^state_bits,) float32, computed from the state s as QTIP's "1MAD"
    does: the sum of the four bytes of the 32-bit a·s + b, near-Gaussian (the sum of four
    near-uniform bytes), centred and scaled to unit variance. A state's neighbours in the trellis
    (those sharing all but k of its bits) decode to unrelated values, as a random code's would;
    nothing is stored, and a kernel computes a value in a multiply, an add and a byte sum. On
    Gaussian weights it matches a code of exact Gaussian quantiles in a random order (0.0192
    against 0.0190 of the variance at 3 bits, 4096 states, 2026-12-02)."""
    x = (ONE_MAD[0] * torch.arange(1 << state_bits, dtype=torch.int64) + ONE_MAD[1]) & 0xFFFFFFFF
    total = sum((x >> (8 * i)) & 0xFF for i in range(4))
    return ((total.double() - 510) / ONE_MAD_STD).float()


def stream_bytes(steps: int, bits: int) -> int:
    """Bytes a walk of ``steps`` states takes: ``bits`` a state (its stream is read circularly)."""
    return steps * bits // 8


def to_tiles(m: torch.Tensor) -> torch.Tensor:
    """(out, in) -> (out / TILE, in / TILE, TILE²): each tile's weights in the order of its walk."""
    out, inp = m.shape
    return m.reshape(out // TILE, TILE, inp // TILE, TILE).permute(0, 2, 3, 1).reshape(out // TILE, inp // TILE, -1)


def from_tiles(t: torch.Tensor) -> torch.Tensor:
    """``to_tiles``' inverse."""
    rows, cols, _ = t.shape
    return t.reshape(rows, cols, TILE, TILE).permute(0, 3, 1, 2).reshape(rows * TILE, cols * TILE)


def pack(states: torch.Tensor, bits: int, state_bits: int) -> torch.Tensor:
    """The streams (walks, ``stream_bytes``) uint8 of tail-biting walks ``states`` (walks, T,
    T·bits a multiple of 8): each state's first (top) ``bits`` bits, most significant first.
    State t is then the ``state_bits`` bits from bit t·k on, read circularly: the last states
    end with the first state's bits, as ``maths.trellis.search`` makes them."""
    walks, _ = states.shape
    top = (states.to(torch.int64)[:, :, None] >> torch.arange(state_bits - 1, state_bits - bits - 1, -1,
                                                              device=states.device)) & 1
    stream = top.reshape(walks, -1, 8) << torch.arange(7, -1, -1, device=states.device)
    return stream.sum(-1).to(torch.uint8)


def unpack(stream: torch.Tensor, steps: int, bits: int, state_bits: int) -> torch.Tensor:
    """The walks (walks, steps) int64 that ``pack`` wrote: state t from the three bytes
    holding bits t·k to t·k + L (circularly)."""
    b = torch.cat([stream, stream[:, :3]], 1).to(torch.int32)
    at = torch.arange(steps, device=stream.device) * bits
    byte, offset = at // 8, at % 8
    word = (b[:, byte] << 16) | (b[:, byte + 1] << 8) | b[:, byte + 2]
    return ((word >> (24 - state_bits - offset)) & ((1 << state_bits) - 1)).to(torch.int64)


@register_layer
class TrellisLinear(CompressedLinear):
    """y = x Wᵀ + b with W[i, j] = scale_i · code(state of (i, j)): each tile of ``TILE`` x ``TILE``
    weights is a walk through the trellis of 2^state_bits states (``to_tiles`` says in which
    order), each state keeping all but ``bits`` bits of the one before and the walk ending where it
    began (tail-biting), so a tile costs exactly ``bits`` a weight and a row a float16 scale. Which walk a tile takes is
    a Viterbi search (``maths.trellis``); the code is computed (``code``), not stored. At 2-4 bits this reaches a lower error on near-Gaussian weights
    (after ``rotate``) than scalar or 2-d codebooks of the same bits (docs/lowbit.md)."""

    KERNEL = "trellis"
    TORCH_PATH = "weight decoded per forward (torch)"

    def __init__(self, in_features: int, out_features: int, bits: int, state_bits: int, bias: bool = False,
                 conv1d: bool = False):
        super().__init__()
        self.in_features, self.out_features, self.conv1d = in_features, out_features, conv1d
        self.bits, self.state_bits = bits, state_bits
        self.register_buffer("stream", torch.empty(out_features // TILE, in_features // TILE,
                                                   stream_bytes(TILE * TILE, bits), dtype=torch.uint8))
        self.register_buffer("scale_bits", torch.empty(out_features, dtype=torch.int16))  # float16's bits
        self.register_buffer("dtype_probe", torch.empty(0), persistent=False)  # the dtype it computes in
        self.register_parameter("trained_scale", None)  # the scales in float32 while fine-tuning trains them
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    @classmethod
    def check_spec(cls, **spec) -> str | None:
        if not 1 <= spec["bits"] <= 4 or not spec["bits"] < spec["state_bits"] <= MAX_STATE_BITS:
            return f"bits={spec['bits']}, state_bits={spec['state_bits']}: need 1 <= bits <= 4 and bits < state_bits " \
                   f"<= {MAX_STATE_BITS}"
        if spec["in_features"] % TILE or spec["out_features"] % TILE:
            return f"{spec['out_features']} x {spec['in_features']} is not made of {TILE} x {TILE} tiles"
        return super().check_spec(**spec)

    def check_values(self, where: str) -> None:
        if not self.scale_bits.is_meta and not bool(self.scale.isfinite().all()):
            raise corrupt(f"{where}.scale_bits holds a scale that is not finite")

    @classmethod
    def from_states(cls, states: torch.Tensor, scale: torch.Tensor, bits: int, state_bits: int,
                    bias: torch.Tensor | None, conv1d: bool = False, dtype: torch.dtype = torch.float32) -> TrellisLinear:
        """The layer for the states ``states`` (out, in) of each weight and row scales ``scale``
        (out,), computing in ``dtype``."""
        out, inp = states.shape
        layer = cls(inp, out, bits, state_bits, bias is not None, conv1d).to(states.device)
        tiles = to_tiles(states)
        layer.stream = pack(tiles.flatten(0, 1), bits, state_bits).view(*tiles.shape[:2], -1)
        layer.scale_bits = scale.to(torch.float16).view(torch.int16)
        layer.dtype_probe = layer.dtype_probe.to(dtype)
        if bias is not None:
            layer.bias = nn.Parameter(bias.detach().clone())
        return layer

    @property
    def scale(self) -> torch.Tensor:
        """The row scales: as stored (float16), or as fine-tuning is training them (float32)."""
        return self.scale_bits.view(torch.float16) if self.trained_scale is None else self.trained_scale

    @torch.no_grad()
    def train_values(self, train: bool = True) -> list[nn.Parameter]:
        """Make the row scales a float32 parameter that fine-tuning trains (``train``), or store them
        again as float16 (not ``train``: how a layer is built, loaded and saved); the walks stay."""
        if train and self.trained_scale is None:
            self.trained_scale = nn.Parameter(self.scale.float())
        elif not train and self.trained_scale is not None:
            self.scale_bits = self.trained_scale.detach().to(torch.float16).view(torch.int16)
            self.trained_scale = None
        return self.trainable_parameters()

    def states(self) -> torch.Tensor:
        """The state of each weight, (out, in) int64."""
        walks = unpack(self.stream.flatten(0, 1), TILE * TILE, self.bits, self.state_bits)
        return from_tiles(walks.view(*self.stream.shape[:2], -1))

    def settle(self, dtype: torch.dtype | None) -> None:
        if dtype is not None:
            self.dtype_probe = self.dtype_probe.to(dtype)

    def dense_weight(self) -> torch.Tensor:
        values = code(self.state_bits).to(self.stream.device)[self.states()]
        return (values * self.scale.float()[:, None]).to(self.dtype_probe.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fast = KERNELS.get(self.KERNEL)
        y = None if fast is None or self.trained_scale is not None else \
            fast(x, self.stream, self.scale, self.bits, self.state_bits, self.bias)
        if y is not None:
            return y
        return F.linear(x, self.dense_weight().to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))

    def trainable_parameters(self) -> list[nn.Parameter]:
        """The row scales while ``train_values`` made them a parameter, and the bias: the walks stay
        as searched."""
        return [p for p in (self.trained_scale, self.bias) if p is not None]

    def parameter_count(self) -> int:
        return self.out_features * self.in_features + (self.out_features if self.bias is not None else 0)

    def storage_bits(self) -> int:
        """Bits its streams and scales take on disk."""
        return 8 * (self.stream.numel() + 2 * self.out_features)

    def spec(self) -> dict:
        return {"in_features": self.in_features, "out_features": self.out_features, "bits": self.bits,
                "state_bits": self.state_bits, "bias": self.bias is not None, "conv1d": self.conv1d}
