"""Weight clustering (palettization, as in Deep Compression): every weight, or every d-long
sub-vector of a row, is replaced by the nearest of K = 2^bits centroids; a layer stores
bit-packed indices plus the codebook (optionally Huffman-coded on disk).

By default the clustering is told what matters (``sensitivity: activation``): each weight's
squared error counts with the energy of its input (the diagonal of the layer's input Gram
matrix from calibration), the indices are chosen with error feedback so that the layer's
output error, not the weights', is minimised (``error_feedback``; see ``clustering.assign``),
a small fraction of the most sensitive weights is kept aside in fp16 (``outliers``: the
dense-and-sparse split of SqueezeLLM) and codebooks are stored in fp16. With ``refit`` (the
default) the decoder layers are palettized in one layer-by-layer pass on the inputs the
compressed model itself produces, each module for the weight that best reproduces the original
layer there (``_Palettize``), instead of on the original model's statistics. With
``sensitivity: none``, ``error_feedback: false`` and ``refit: false`` it needs no calibration
data at all (the fast path). The k-means algorithms themselves are in ``wscompress/clustering.py``.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Mapping
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field, model_validator
from torch import nn

from .. import kernels, ui
from ..arch import LINEAR_TYPES, Conv1D, dims_of, discover, distinct, match_modules, replace_everywhere, weight_of
from ..clustering import Init, assign, cluster
from ..compensate import Target, fit_pass
from ..data import first_samples
from ..errors import UsageError
from ..linalg import add_gram, add_product, solve_coefficients, symmetrize
from ..modules import CompressedLinear, register_module
from ..packing import (
    BLOCK,
    HuffmanStream,
    entropy,
    huffman_decode,
    huffman_encode,
    pack,
    packed_nbytes,
    unpack,
)
from ..offload import offload_of
from ..recipe import StageConfig
from ..stats import SharedGrams
from . import register

CodebookDtype = Literal["float16", "bfloat16", "float32"]


class KMeansConfig(StageConfig):
    """Palettize linear layers (default: every linear of the decoder layers)."""

    method: Literal["kmeans"] = "kmeans"
    bits: int = Field(4, ge=1, le=8, description="index bits: K = 2^bits centroids per codebook")
    granularity: Literal["per_tensor", "per_channel", "grouped"] = "per_channel"
    group_size: int | None = Field(None, gt=0, description="output channels sharing a codebook (granularity: grouped)")
    cluster_dim: int = Field(1, ge=1, description="length of the sub-vectors clustered together (1: scalar)")
    init: Init = "kmeans++"
    n_init: int | None = Field(None, ge=1, description="k-means restarts, the lowest error wins (default: 3 for "
                               "scalar per_tensor, where they run on the histogram; 1 otherwise)")
    iterations: int = Field(300, gt=0, description="maximum Lloyd iterations (stops earlier when converged)")
    entropy_coding: bool = Field(False, description="store indices Huffman-coded on disk")
    sensitivity: Literal["activation", "none"] = Field("activation", description="weigh each weight's error by its "
                                                       "input's energy (calibration Gram diagonal), or not")
    error_feedback: bool = Field(True, description="choose indices column by column, pushing each column's error "
                                                   "onto the next ones through the inverse Gram matrix (GPTQ)")
    damp: float = Field(0.01, gt=0, description="error feedback: Gram dampening, relative to its mean diagonal")
    refit: bool = Field(True, description="palettize layer by layer on the inputs the compressed model itself feeds "
                                          "each module, fitted to refit_target (error compensation, see compensate.py)")
    refit_target: Target = Field("layer", description="refit: what each module's output is fitted to: the original "
                                 "layer's, fed the same layer input (layer), the original module on its compressed "
                                 "inputs (function, GPTQ's sequential mode) or the original model's (model)")
    refit_samples: int | None = Field(None, gt=0, description="refit: the first N calibration sequences (default: all)")
    ridge: float = Field(0.1, ge=0, description="refit: ridge toward the original weight in the best weight on the "
                                                "compressed inputs, relative to the mean diagonal of their Gram matrix "
                                                "(stronger than the low-rank refit's: a whole weight matrix, not k "
                                                "coefficients a row, overfits a small calibration set)")
    outliers: float = Field(0.0025, ge=0, lt=0.5, description="fraction of the most sensitive weights kept aside "
                                                              "in a sparse fp16 tensor instead of the codebook")
    codebook_dtype: CodebookDtype = Field("float16", description="dtype the codebooks (and outliers) are stored in")
    seed: int = 0

    @property
    def needs_statistics(self) -> bool:
        return self.sensitivity != "none" or self.error_feedback or self.refit

    @model_validator(mode="after")
    def _group_size(self) -> KMeansConfig:
        if (self.granularity == "grouped") != (self.group_size is not None):
            raise ValueError("group_size is required with granularity: grouped and only allowed with it")
        return self


# ----------------------------------------------------------------------------- the layer

def dequantize(codebook: torch.Tensor, indices: torch.Tensor, group_size: int) -> torch.Tensor:
    """Weight (out, cols * d) from codebooks (groups, K, d) and indices (out, cols): row r
    reads codebook r // group_size (differentiable in the codebook)."""
    _, k, d = codebook.shape
    offset = (torch.arange(indices.shape[0], device=indices.device) // group_size * k)[:, None]
    return codebook.reshape(-1, d)[indices + offset].reshape(indices.shape[0], -1)


@register_module
class PalettizedLinear(CompressedLinear):
    """A linear layer stored as packed cluster indices + codebook(s).

    Memory holds ``indices`` (``bits`` bits per index, bit-packed uint8) and ``codebook``
    (groups, K, cluster_dim): output channels ``g*group_size ... (g+1)*group_size - 1`` use
    codebook g, and index (r, j) picks the centroid for weights W[r, j*d : (j+1)*d]. Weights
    kept aside (``outliers`` of them) replace their codebook value: ``outlier_index`` holds their
    flat positions, ``outlier_value`` their values. Codebooks and outliers are stored in
    ``codebook_dtype`` (computed in the model's dtype). On CPU the look-up-table kernel
    (``wscompress.kernels``) computes from the indices directly; elsewhere, and while the codebook
    trains, the dense weight is materialised on each forward. With ``stream_bytes`` set, the file stores the indices Huffman-coded instead
    (``huffman_*`` buffers) and loading decodes them.
    """

    def __init__(self, in_features: int, out_features: int, bits: int, group_size: int | None = None,
                 cluster_dim: int = 1, bias: bool = False, stream_bytes: int | None = None, conv1d: bool = False,
                 codebook_dtype: CodebookDtype = "float32", outliers: int = 0):
        super().__init__()
        self.in_features, self.out_features, self.bits, self.conv1d = in_features, out_features, bits, conv1d
        self.group_size = group_size or out_features
        self.cluster_dim, self.stream_bytes = cluster_dim, stream_bytes
        self.codebook_dtype, self.outliers = codebook_dtype, outliers
        k, n = 2 ** bits, self.num_indices
        self.codebook = nn.Parameter(torch.empty(out_features // self.group_size, k, cluster_dim))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        if outliers:
            self.register_buffer("outlier_index", torch.empty(outliers, dtype=torch.int32))
            self.register_buffer("outlier_value", torch.empty(outliers))
        self.register_buffer("indices", torch.empty(packed_nbytes(n, bits), dtype=torch.uint8),
                             persistent=stream_bytes is None)
        if stream_bytes is not None:
            self.register_buffer("huffman_stream", torch.empty(stream_bytes, dtype=torch.uint8))
            self.register_buffer("huffman_lengths", torch.empty(k, dtype=torch.uint8))
            self.register_buffer("huffman_blocks", torch.empty(math.ceil(n / BLOCK), dtype=torch.int32))

    @property
    def num_indices(self) -> int:
        return self.out_features * self.in_features // self.cluster_dim

    @classmethod
    def from_clusters(cls, codebook: torch.Tensor, indices: torch.Tensor, bias: torch.Tensor | None,
                      entropy_coding: bool = False, conv1d: bool = False, codebook_dtype: CodebookDtype = "float32",
                      outliers: tuple[torch.Tensor, torch.Tensor] | None = None) -> PalettizedLinear:
        """Build from codebook (groups, K, d), indices (out, in / d) and optionally the
        weights kept aside as (flat positions, values); values are rounded to ``codebook_dtype``."""
        groups, k, d = codebook.shape
        out, cols = indices.shape
        stream = huffman_encode(indices.cpu().numpy(), k) if entropy_coding else None
        layer = cls(cols * d, out, int(math.log2(k)), out // groups, d, bias is not None,
                    None if stream is None else len(stream.data), conv1d, codebook_dtype,
                    0 if outliers is None else outliers[0].numel())
        stored = getattr(torch, codebook_dtype)
        layer.codebook = nn.Parameter(codebook.detach().to(stored).to(codebook.dtype).clone())  # its own storage
        layer.indices = pack(indices, layer.bits)
        if outliers is not None:
            layer.outlier_index = outliers[0].to(torch.int32)
            layer.outlier_value = outliers[1].detach().to(stored).to(codebook.dtype)
        if bias is not None:
            layer.bias = nn.Parameter(bias.detach().clone())
        if stream is not None:
            layer.huffman_stream = torch.from_numpy(stream.data).to(codebook.device)
            layer.huffman_lengths = torch.from_numpy(stream.lengths).to(codebook.device)
            layer.huffman_blocks = torch.from_numpy(stream.block_bits).to(codebook.device)
        return layer

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        for name in ("codebook", "outlier_value"):  # stored in codebook_dtype, whatever the model computes in
            if prefix + name in destination:
                destination[prefix + name] = destination[prefix + name].detach().to(getattr(torch, self.codebook_dtype))

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        for name in ("codebook", "outlier_value"):  # back to the dtype the layer computes in
            if prefix + name in state_dict:
                state_dict[prefix + name] = state_dict[prefix + name].to(self.codebook.dtype)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        if self.stream_bytes is not None and prefix + "huffman_stream" in state_dict:
            self.indices = pack(torch.from_numpy(huffman_decode(self.huffman())), self.bits).to(self.codebook.device)

    def huffman(self) -> HuffmanStream:
        return HuffmanStream(self.huffman_stream.cpu().numpy(), self.huffman_lengths.cpu().numpy(),
                             self.huffman_blocks.cpu().numpy(), self.num_indices)

    def index_matrix(self) -> torch.Tensor:
        """Cluster indices as an (out, in / cluster_dim) int64 tensor."""
        return unpack(self.indices, self.bits, self.num_indices).view(self.out_features, -1)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` (any shape) of the dense weight, decoding only those rows (an embedding
        lookup in a palettized table): (*ids.shape, in_features). A decode step's few ids are
        decoded as they come, with no data-dependent shapes (so the step can be captured as a
        CUDA graph); longer inputs decode each distinct row once."""
        flat = ids.reshape(-1)
        if flat.numel() <= kernels.DECODE_ROWS:
            w = self._codebook_rows(flat)
            if self.outliers:  # every kept-aside weight written to row i where it is in row ids[i], else to a spare column
                pos = self.outlier_index.long()
                at = torch.where(pos // self.in_features == flat[:, None], pos % self.in_features, self.in_features)
                w = F.pad(w, (0, 1)).scatter_(1, at, self.outlier_value.to(w.dtype).expand_as(at))[:, :-1]
            return w.view(*ids.shape, self.in_features)
        uniq, where = torch.unique(flat, return_inverse=True)
        w = self._codebook_rows(uniq)
        if self.outliers:  # the weights kept aside in these rows
            pos = self.outlier_index.long()
            row, col = pos // self.in_features, pos % self.in_features
            at = torch.searchsorted(uniq, row).clamp_max(len(uniq) - 1)
            hit = uniq[at] == row
            w[at[hit], col[hit]] = self.outlier_value[hit].to(w.dtype)
        return w[where].view(*ids.shape, self.in_features)

    def _codebook_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` (1-D) as the codebook gives them, outliers not applied."""
        cols = self.in_features // self.cluster_dim
        packed = self.indices.view(self.out_features, -1)[ids]  # a row's indices fill whole bytes (cols % 8 == 0)
        idx = unpack(packed.reshape(-1), self.bits, len(ids) * cols).view(len(ids), cols)
        return self.codebook[ids // self.group_size].gather(1, idx[..., None].expand(-1, -1, self.cluster_dim)).flatten(1)

    def dense_weight(self) -> torch.Tensor:
        w = dequantize(self.codebook, self.index_matrix(), self.group_size)
        if not self.outliers:
            return w
        return w.flatten().index_put((self.outlier_index.long(),), self.outlier_value.to(w.dtype)).view_as(w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lut_forward(x)
        if y is None:  # the reference path: materialise the weight
            return F.linear(x, self.dense_weight().to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))
        return y if self.bias is None else y + self.bias

    def kernel_layout(self) -> tuple[torch.Tensor, int, kernels.SparseRows | None, torch.Tensor] | None:
        """(indices as the LUT kernel reads them, their width, the outliers' corrections by row,
        the tables), prepared once and kept while indices, codebook and outliers stay the same:
        the stored bytes themselves at 4 and 8 bits, re-packed as nibbles (1-3 bits) or bytes
        (5-7 bits) otherwise; tables of fewer than 16 entries padded to 16 for nibbles (once, not
        per call: on a GPU each call's pad was one more kernel launch). None: scalar codebooks only."""
        if self.cluster_dim != 1 or self.in_features % 2:
            return None
        key = [(t.data_ptr(), t._version) for t in (self.indices, self.codebook)]
        if self.outliers:  # their corrections depend on the codebook (which fine-tuning trains) too
            key += [(t.data_ptr(), t._version) for t in (self.outlier_index, self.outlier_value)]
        if getattr(self, "_layout_key", None) != key:
            idx = self.index_matrix()
            width = 4 if self.bits <= 4 else 8
            layout = self.indices if self.bits in (4, 8) else pack(idx, 4) if width == 4 else idx.to(torch.uint8).flatten()
            sparse = None
            if self.outliers:  # the exact weights kept aside: their difference to the codebook value
                pos = self.outlier_index.long()
                delta = self.outlier_value - self.codebook[pos // self.in_features // self.group_size, idx.flatten()[pos], 0]
                sparse = kernels.SparseRows.from_positions(pos, delta.detach(), (self.out_features, self.in_features))
            tables = self.codebook[..., 0]
            if width == 4 and tables.shape[1] < 16:
                tables = F.pad(tables, (0, 16 - tables.shape[1]))
            self._layout, self._layout_key = (layout, width, sparse, tables.detach().contiguous()), key
        return self._layout

    def lut_forward(self, x: torch.Tensor) -> torch.Tensor | None:
        """x @ Wᵀ by the look-up-table kernel (wscompress.kernels), never forming W; None where it does not apply."""
        if torch.is_grad_enabled() and (x.requires_grad or self.codebook.requires_grad):
            return None  # the codebook trains: autograd needs the torch path (and the layout would go stale each step)
        layout = self.kernel_layout()
        if layout is None:
            return None
        indices, width, sparse, tables = layout
        return kernels.palettized_linear(x, indices, width, tables, self.group_size, self.out_features, sparse)

    def trainable_parameters(self) -> list[nn.Parameter]:
        """Fine-tuning a palettized layer trains its centroids (Deep Compression)."""
        return [self.codebook]

    def storage_bits(self) -> int:
        """Bits this layer's indices, codebook and outliers take on disk (what ``save`` writes)."""
        index_bytes = (self.huffman_stream.numel() + self.huffman_lengths.numel() + 4 * self.huffman_blocks.numel()
                       if self.stream_bytes is not None else self.indices.numel())
        value_bytes = getattr(torch, self.codebook_dtype).itemsize
        return 8 * (index_bytes + (self.codebook.numel() + self.outliers) * value_bytes + 4 * self.outliers)

    def spec(self) -> dict:
        return {"in_features": self.in_features, "out_features": self.out_features, "bits": self.bits,
                "group_size": self.group_size, "cluster_dim": self.cluster_dim, "bias": self.bias is not None,
                "stream_bytes": self.stream_bytes, "conv1d": self.conv1d, "codebook_dtype": self.codebook_dtype,
                "outliers": self.outliers}


@register_module
class PalettizedEmbedding(nn.Module):
    """An embedding whose (vocab, hidden) table is a ``PalettizedLinear`` (``table``): a lookup
    decodes only the rows it reads. With tied embeddings the LM head *is* that table module,
    so the matrix is stored once and the head's matmul runs the LUT kernel."""

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int | None = None, scale: float = 1.0):
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.padding_idx, self.scale = num_embeddings, embedding_dim, padding_idx, scale
        self.register_module("table", None)  # set by ``around`` or, on loading, by the manifest

    @classmethod
    def around(cls, table: PalettizedLinear, embedding: nn.Embedding) -> PalettizedEmbedding:
        new = cls(table.out_features, table.in_features, embedding.padding_idx, float(getattr(embedding, "embed_scale", 1.0)))
        new.table = table
        return new

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = self.table.rows(ids)
        return out if self.scale == 1.0 else out * self.scale  # e.g. Gemma's sqrt(H) embedding scale

    @property
    def weight(self) -> torch.Tensor:
        """The dense table, for code that reads ``get_input_embeddings().weight`` (dtype, device, values)."""
        return self.table.dense_weight()

    def spec(self) -> dict:
        return {"num_embeddings": self.num_embeddings, "embedding_dim": self.embedding_dim,
                "padding_idx": self.padding_idx, "scale": self.scale}

    def to_dense(self) -> nn.Embedding:
        w = self.table.dense_weight().detach()
        emb = nn.Embedding(self.num_embeddings, self.embedding_dim, padding_idx=self.padding_idx, device=w.device,
                           dtype=w.dtype)
        with torch.no_grad():
            emb.weight.copy_(w)
        return emb


# ----------------------------------------------------------------------------- the stage

def default_targets(model: nn.Module) -> list[str]:
    """Every linear inside the decoder layers (embeddings and lm_head only when targeted)."""
    return [rf"^{re.escape(discover(model).layers_path)}\."]


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0 and d <= 64)


def group_size_of(cfg: KMeansConfig, out_features: int) -> int:
    return {"per_tensor": out_features, "per_channel": 1}.get(cfg.granularity, cfg.group_size)


def check_layer(name: str, out_features: int, in_features: int, cfg) -> None:
    """Refuse shapes the options cannot tile (before anything is modified)."""
    if in_features % cfg.cluster_dim:
        raise UsageError(f"{name}: cluster_dim={cfg.cluster_dim} does not divide its row length {in_features}",
                         f"use a cluster_dim dividing {in_features} (e.g. {_divisors(in_features)}) or ignore this layer")
    gs = group_size_of(cfg, out_features)
    if out_features % gs:
        raise UsageError(f"{name}: group_size={gs} does not divide its {out_features} output channels",
                         f"use a group_size dividing {out_features} (e.g. {_divisors(out_features)}) or ignore this layer")


def target_layers(model: nn.Module, cfg: StageConfig) -> dict[str, nn.Module]:
    """Matched dense linears (a module shared by layers once)."""
    layers = match_modules(model, cfg.targets or default_targets(model), cfg.ignore, kind=LINEAR_TYPES)
    return {n: layers[n] for n in distinct(model, list(layers))}


def tied_to_embeddings(model: nn.Module, module: nn.Module) -> nn.Embedding | None:
    """The input embedding whose weight ``module`` (the LM head) shares, if it does."""
    emb = model.get_input_embeddings()
    return emb if isinstance(emb, nn.Embedding) and getattr(module, "weight", None) is emb.weight else None


def layer_report(name: str, weight: torch.Tensor, layer: PalettizedLinear) -> dict:
    """Reconstruction error, bits per weight and compression ratios of one palettized layer."""
    w = weight.detach().float()
    err = (layer.dense_weight().detach().float() - w)
    n, k = w.numel(), 2 ** layer.bits
    codebook_entries = layer.codebook.numel()
    idx = layer.index_matrix()
    codebook_of_row = (torch.arange(idx.shape[0], device=idx.device) // layer.group_size)[:, None]
    row = {"layer": name, "shape": list(w.shape), "mse": err.pow(2).mean().item(),
           "rel_error": (err.norm() / w.norm().clamp_min(1e-30)).item(),
           "clusters_used": (torch.bincount((idx + codebook_of_row * k).reshape(-1), minlength=layer.codebook.shape[0] * k) > 0)
                            .sum().item() / layer.codebook.shape[0],  # mean per codebook
           "bits_per_weight": layer.storage_bits() / n,
           # Deep Compression's formula with 32-bit weights and centroids, for any granularity
           "ratio_formula": 32 * n / (32 * codebook_entries + layer.num_indices * layer.bits)}
    if layer.stream_bytes is not None:
        counts = torch.bincount(idx.reshape(-1), minlength=k).cpu().numpy()
        row["entropy_bits"] = entropy(counts)
        row["huffman_bits"] = layer.huffman().bits / layer.num_indices
    return row


def palettize(module: nn.Module, cfg: KMeansConfig, gram: torch.Tensor | None = None,
              weight: torch.Tensor | None = None) -> PalettizedLinear:
    """Cluster one linear's weight (or ``weight`` in its place, (out, in)) into a PalettizedLinear
    (on the weight's device); ``gram`` (its inputs' XᵀX) enables the sensitivity weighting and
    error feedback the config asks for."""
    w = weight_of(module).detach() if weight is None else weight
    out, inp = w.shape
    gs, d = group_size_of(cfg, out), cfg.cluster_dim
    energy = gram.diagonal().float().clamp_min(0).to(w.device) if gram is not None and cfg.sensitivity != "none" else \
        torch.ones(inp, device=w.device)
    aside = torch.zeros(out, inp, dtype=torch.bool, device=w.device)
    count = round(cfg.outliers * w.numel())
    if count:  # the weights whose error would cost most: large and on energetic inputs
        aside.view(-1)[(w.float().abs() * energy.sqrt()).flatten().topk(count).indices] = True
    weights = (energy * ~aside).view(out, inp // d, d).mean(-1)  # an aside weight pulls no centroid
    codebook, idx = cluster(w.reshape(out // gs, gs * inp // d, d), cfg.bits, cfg.init, cfg.iterations, cfg.n_init,
                            cfg.seed, weights.reshape(out // gs, -1))
    codebook = codebook.to(getattr(torch, cfg.codebook_dtype)).to(w.dtype)  # feedback sees the stored values
    if cfg.error_feedback and gram is not None:
        idx, values = assign(w, codebook, gs, gram, aside if count else None, cfg.damp)
    else:
        idx, values = idx.reshape(out, inp // d), w[aside]
    outliers = (aside.flatten().nonzero()[:, 0], values) if count else None
    return PalettizedLinear.from_clusters(codebook, idx, getattr(module, "bias", None), cfg.entropy_coding,
                                          isinstance(module, Conv1D), cfg.codebook_dtype, outliers)


def summarize(rows: list[dict], bits: int) -> dict:
    """Totals over layers: weighted bits per weight, error, ratios, entropy."""
    n = np.array([math.prod(r["shape"]) for r in rows], dtype=np.float64)
    mean = lambda key: float((np.array([r[key] for r in rows]) * n).sum() / n.sum())
    out = {"layers": len(rows), "weights": int(n.sum()), "bits": bits, "bits_per_weight": mean("bits_per_weight"),
           "ratio_formula": float(32 * n.sum() / (n / np.array([r["ratio_formula"] for r in rows]) * 32).sum()),
           "ratio_storage": 32 / mean("bits_per_weight"), "mse": mean("mse"),
           "max_rel_error": max(r["rel_error"] for r in rows)}
    if rows and "entropy_bits" in rows[0]:  # per index, averaged over all indices
        out["entropy_bits"], out["huffman_bits"] = mean("entropy_bits"), mean("huffman_bits")
    return out


class _Palettize:
    """A stage of ``compensate.fit_pass`` (``refit``): the modules reading one input, palettized
    once the pass has summed G = X'ᵀX' of what the compressed model feeds them (and, where the
    target reads another input X, H = XᵀX'). Each is clustered, with G as its statistics, for
    the weight that best reproduces its target on those inputs, W̃ = argmin ‖X'·W̃ᵀ − X·Wᵀ‖²
    + λ‖W̃ − W‖² = (W·H + λ·W)(G + λ·I)⁻¹: o then makes up for q/k/v's error, down for the
    attention's and gate/up's; W itself where the target reads X' too (the layer's first
    modules)."""

    def __init__(self, modules: dict[str, nn.Module], weights: dict[str, torch.Tensor], same: bool, _dtype: torch.dtype,
                 cfg: KMeansConfig, rows: list[dict]):
        self.modules, self.weights, self.same, self.cfg, self.rows = modules, weights, same, cfg, rows
        self.gram: torch.Tensor | None = None
        self.cross: torch.Tensor | None = None

    def add(self, x: torch.Tensor, x_ref: torch.Tensor | None) -> None:
        self.gram = add_gram(self.gram, x)
        if not self.same:
            self.cross = add_product(self.cross, x_ref, x)

    def finish(self) -> tuple[dict[str, nn.Module], dict[str, torch.Tensor]]:
        gram = symmetrize(self.gram)
        new = {}
        for name, module in self.modules.items():
            w = self.weights[name]
            best = w if self.cross is None else \
                solve_coefficients(gram, w.double() @ self.cross.to(w.device), self.cfg.ridge, w).to(w.dtype)
            new[name] = palettize(module, self.cfg, gram, best)
            self.rows.append(layer_report(name, w, new[name]))
        return new, {}


@register(KMeansConfig)
def apply(model: nn.Module, cfg: KMeansConfig, ctx) -> dict:
    """Palettize every target linear, one decoder layer at a time; returns totals and one row per layer."""
    arch = discover(model)
    offload = offload_of(model)
    layers = target_layers(model, cfg)
    for name, module in layers.items():
        check_layer(name, *reversed(dims_of(module)), cfg)
        if tied_to_embeddings(model, module) is not None and cfg.bits != 8 and dims_of(module)[0] // cfg.cluster_dim % 8:
            raise UsageError(f"{name} is tied to the input embeddings, whose lookups decode whole rows: a row's "
                             f"{dims_of(module)[0] // cfg.cluster_dim} indices of {cfg.bits} bits do not fill whole bytes",
                             "use bits: 8, a cluster_dim leaving a multiple of 8 indices a row, or ignore it")
    by_layer: dict[int | None, list[str]] = {}
    for name in layers:  # a module shared by several layers: under the first (see target_layers)
        by_layer.setdefault(arch.layer_of(name), []).append(name)
    grams: Mapping[str, torch.Tensor] = {}
    inside = arch.layers_path + "."
    start = time.perf_counter()
    rows: list[dict] = []
    if cfg.refit and set(by_layer) - {None}:  # the decoder layers' modules, in one pass over the calibration data
        fit_pass(model, arch, first_samples(ctx.calibration(), cfg.refit_samples), lambda i: {n: layers[n] for n in by_layer.get(i, [])},
                 lambda *args: _Palettize(*args, cfg=cfg, rows=rows), cfg.refit_target, ctx.dtype(model))
        by_layer = {None: by_layer[None]} if None in by_layer else {}
    elif cfg.needs_statistics:  # calibration covers the decoder layers: a module used by several, on all its uses
        chosen = {id(m) for m in layers.values()}
        every = [n for n, m in model.named_modules(remove_duplicate=False) if n.startswith(inside) and id(m) in chosen]
        if every:
            grams = SharedGrams(model, every, ctx.stats(model, every))
    for i, names in ui.track(list(by_layer.items()), f"kmeans {cfg.bits}-bit"):
        with offload.onload([] if i is None else [i]):
            for name in names:
                module = layers[name]
                layer = palettize(module, cfg, grams.get(name))
                rows.append(layer_report(name, weight_of(module), layer))
                emb = tied_to_embeddings(model, module)
                replace_everywhere(model, module, layer)
                if emb is not None:  # a tied head: the embedding reads the same palettized table, stored once
                    replace_everywhere(model, emb, PalettizedEmbedding.around(layer, emb))
    without = [n for i, names in by_layer.items() for n in names if cfg.needs_statistics and n not in grams]
    return {**summarize(rows, cfg.bits), "cluster_seconds": round(time.perf_counter() - start, 2),
            "sensitivity": cfg.sensitivity, "error_feedback": cfg.error_feedback, "outliers": cfg.outliers,
            "refit": cfg.refit, "without_statistics": without, "per_layer": rows}
