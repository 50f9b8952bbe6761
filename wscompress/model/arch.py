"""Architecture-agnostic discovery: decoder layers, attention/MLP projections, module matching.

Works by module names and shapes, not by model class, so LLaMA/Mistral/Qwen2/Gemma3 (q/k/v/o,
gate/up/down), GPT-2 (fused ``c_attn``, ``Conv1D`` weights stored transposed) and OPT
(``fc1``/``fc2`` directly in the layer) all come out as the same roles.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D  # GPT-2 style layers store weight as (in, out)

from ..errors import UsageError
from .forms.wscompress_embeddings import PalettizedEmbedding
from .forms.wscompress_format import CompressedLinear, weight_of  # noqa: F401  (weight_of: the (out, in) weight of any linear)

if TYPE_CHECKING:  # for annotations only: the recipe's types do not depend on the model's
    from ..recipe.schema import TargetedStage

LINEAR_TYPES = (nn.Linear, Conv1D)  # dense linears, and the compressed ones (nn.Linear subclasses) too

# leaf name -> role; attention roles apply inside an attention submodule, MLP roles elsewhere
ATTN_ROLES = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "o_proj": "o", "out_proj": "o",
              "c_attn": "qkv", "qkv_proj": "qkv", "query_key_value": "qkv", "Wqkv": "qkv",
              "c_proj": "o", "dense": "o", "query": "q", "key": "k", "value": "v"}
MLP_ROLES = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "fc1": "up", "fc2": "down",
             "c_fc": "up", "c_proj": "down", "w1": "gate", "w3": "up", "w2": "down",
             "dense_h_to_4h": "up", "dense_4h_to_h": "down", "gate_up_proj": "gate_up"}
ATTN_PARTS = re.compile(r"attn|attention", re.I)

# Facts of an architecture that methods need beyond the roles above, read off its model type,
# module names and config switches (see the ``Arch`` properties that use them):
INTERLEAVED_ROPE = frozenset({"cohere", "cohere2", "glm", "glm4", "chatglm"})  # RoPE on pairs (2j, 2j + 1), not halves
QK_NORMS = ("q_norm", "k_norm")  # per-head norms on queries and keys (Qwen3, Gemma3, OLMo2)
FFN_OUTPUT_NORMS = ("post_feedforward_layernorm",)  # the FFN output normalised before the residual add (Gemma2/3)
LAYER_INDEXED = ("scale_attn_by_inverse_layer_idx",)  # config switches by which a layer's computation depends on its index


def is_linear(module: nn.Module) -> bool:
    return isinstance(module, LINEAR_TYPES) or (hasattr(module, "in_features") and hasattr(module, "dense_weight"))


def is_dense_linear(module: nn.Module) -> bool:
    """An nn.Linear or Conv1D holding its weight as it is (not a compressed layer)."""
    return isinstance(module, LINEAR_TYPES) and not isinstance(module, CompressedLinear)


def dims_of(module: nn.Module) -> tuple[int, int]:
    """(in_features, out_features)."""
    if isinstance(module, Conv1D):
        return module.weight.shape[0], module.weight.shape[1]
    return module.in_features, module.out_features


def as_linear(module: nn.Module) -> nn.Linear:
    """An nn.Linear computing the same function (the module itself if it is one, else a copy)."""
    if is_dense_linear(module) and isinstance(module, nn.Linear):
        return module
    w = weight_of(module).detach()
    lin = nn.Linear(w.shape[1], w.shape[0], bias=getattr(module, "bias", None) is not None,
                    device=w.device, dtype=w.dtype)
    with torch.no_grad():
        lin.weight.copy_(w)
        if lin.bias is not None:
            lin.bias.copy_(module.bias)
    return lin


def get_module(root: nn.Module, name: str) -> nn.Module:
    return root.get_submodule(name) if name else root


def set_module(root: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(get_module(root, parent), leaf, module)


def first_names(model: nn.Module, names: list[str]) -> dict[str, str]:
    """name -> the first of ``names`` that reaches the same module object (itself unless an
    earlier stage, e.g. cross_layer, made several layers share the module)."""
    first: dict[int, str] = {}
    return {n: first.setdefault(id(get_module(model, n)), n) for n in names}


def distinct(model: nn.Module, names: list[str]) -> list[str]:
    """``names`` with each module object once (at its first name)."""
    return [n for n, first in first_names(model, names).items() if n == first]


def require_unshared(model: nn.Module, names: list[str], method: str) -> None:
    """Refuse modules shared between layers where a method must treat each layer's own."""
    for n, first in first_names(model, names).items():
        if n != first:
            raise UsageError(f"{method}: {n} is the same module as {first} (an earlier stage, e.g. cross_layer, shares it)",
                             f"run {method} before the sharing stage, or leave those modules out with ignore:")


def replace_everywhere(model: nn.Module, old: nn.Module, new: nn.Module) -> None:
    """Swap ``old`` for ``new`` under every name that reaches it (shared layers stay shared)."""
    for name, m in list(model.named_modules(remove_duplicate=False)):
        if m is old:
            set_module(model, name, new)


def replace_linear(model: nn.Module, old: nn.Module, new: CompressedLinear) -> None:
    """Swap the linear ``old`` for its compressed form ``new`` everywhere; where ``old`` is a head
    tied to the input embedding, the embedding looks its rows up in ``new``, so the table stays
    one, stored once (``PalettizedEmbedding``; ``new`` must have ``rows``)."""
    emb = tied_to_embeddings(model, old)
    replace_everywhere(model, old, new)
    if emb is not None:
        replace_everywhere(model, emb, PalettizedEmbedding.around(new, emb))


@dataclass
class Arch:
    """What a compression method needs to know about a causal LM."""

    model: nn.Module
    layers_path: str  # dotted path of the ModuleList of decoder layers

    @property
    def layers(self) -> nn.ModuleList:
        return get_module(self.model, self.layers_path)

    @property
    def config(self):
        return self.model.config

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def layer_name(self, i: int) -> str:
        return f"{self.layers_path}.{i}"

    def layer_of(self, name: str) -> int | None:
        """Index of the decoder layer a module name lies in (None: outside the layers)."""
        head, dot, rest = name.partition(self.layers_path + ".")
        return int(rest.split(".")[0]) if dot and not head else None

    def projections(self, i: int) -> dict[str, str]:
        """role -> full module name of layer i's linear projections."""
        out = {}
        for local, module in self.layers[i].named_modules():
            if not local or not is_linear(module):
                continue
            leaf = local.rpartition(".")[2]
            role = (ATTN_ROLES if ATTN_PARTS.search(local.rpartition(".")[0]) else MLP_ROLES).get(leaf)
            if role is not None:
                out[role] = f"{self.layer_name(i)}.{local}"
        return out

    def roles(self) -> list[str]:
        return list(self.projections(0))

    def submodule_name(self, i: int, kind: str) -> str | None:
        """Full name of layer i's attention ('attn') or MLP ('mlp') block, if it has one."""
        pattern = ATTN_PARTS if kind == "attn" else re.compile(r"^(mlp|ffn|feed_forward|block_sparse_moe)$")
        for local, _ in self.layers[i].named_children():
            if pattern.search(local) and not local.endswith("norm"):
                return f"{self.layer_name(i)}.{local}"
        return None

    @cached_property
    def embedding_name(self) -> str:
        emb = self.model.get_input_embeddings()
        return next(n for n, m in self.model.named_modules() if m is emb)

    @property
    def num_heads(self) -> int:
        c = self.config
        return getattr(c, "num_attention_heads", None) or c.n_head

    @property
    def num_kv_heads(self) -> int:
        return getattr(self.config, "num_key_value_heads", None) or self.num_heads

    @property
    def head_dim(self) -> int:
        c = self.config
        return getattr(c, "head_dim", None) or c.hidden_size // self.num_heads

    @property
    def is_gqa(self) -> bool:
        return self.num_kv_heads < self.num_heads

    @property
    def model_type(self) -> str:
        """The architecture's own type (a compressed model's: its base model's)."""
        return getattr(self.config, "base_model_type", None) or self.config.model_type

    @property
    def rope_in_halves(self) -> bool:
        """Whether RoPE rotates each head's dimension j with j + head_dim/2 over the whole head."""
        return self.model_type not in INTERLEAVED_ROPE and (getattr(self.config, "partial_rotary_factor", None) or 1.0) == 1.0

    @property
    def qk_norm(self) -> bool:
        """Whether queries and keys are normalised per head before RoPE."""
        attn = self.submodule_name(0, "attn")
        return attn is not None and any(hasattr(get_module(self.model, attn), n) for n in QK_NORMS)

    @property
    def ffn_output_norm(self) -> bool:
        """Whether the FFN output is normalised before it is added to the residual stream."""
        return any(name.rpartition(".")[2] in FFN_OUTPUT_NORMS for name, _ in self.layers[0].named_modules())

    @property
    def layer_indexed(self) -> bool:
        """Whether a layer computes differently by its index (re-indexing layers would change it)."""
        return any(getattr(self.config, key, False) for key in LAYER_INDEXED)


def discover(model: nn.Module) -> Arch:
    """Find the decoder layers: the longest ModuleList of identical blocks holding linears."""
    best = None
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0:
            kinds = {type(m) for m in module}
            has_linear = any(is_linear(m) for m in module[0].modules())
            if len(kinds) == 1 and has_linear and (best is None or len(module) > best[1]):
                best = (name, len(module))
    if best is None:
        raise UsageError(f"{type(model).__name__}: no stack of decoder layers found",
                         "wscompress supports decoder-only transformers (LLaMA, GPT-2, OPT, Mistral, Qwen2, Gemma3, ...)")
    return Arch(model, best[0])


def match_modules(model: nn.Module, targets: list[str], ignore: list[str] = (),
                  kind: type | tuple = LINEAR_TYPES, what: str = "targets") -> dict[str, nn.Module]:
    """Modules of type ``kind`` whose names match any target regex (re.search) and no ignore regex
    (linears: dense ones only, a compressed layer is not compressed again as a whole).

    A target that matches nothing is a user error: a typo should not silently compress nothing.
    A module shared between layers matches under each of its names.
    """
    candidates = {n: m for n, m in model.named_modules(remove_duplicate=False)
                  if n and isinstance(m, kind) and not isinstance(m, CompressedLinear)}
    out: dict[str, nn.Module] = {}
    for pattern in targets:
        try:
            rx = re.compile(pattern)
        except re.error as err:
            raise UsageError(f"{what}: {pattern!r} is not a valid regex: {err}") from None
        hits = [n for n in candidates if rx.search(n)]
        if not hits:
            sample = ", ".join(list(candidates)[:4])
            raise UsageError(f"{what}: pattern {pattern!r} matches no module",
                             f"patterns are regexes searched in module names such as {sample}")
        out.update((n, candidates[n]) for n in hits)
    ignores = [re.compile(p) for p in ignore]
    return {n: m for n, m in out.items() if not any(rx.search(n) for rx in ignores)}


# ----------------------------------------------------------------------------- what a stage targets
# (``cfg``: a stage's options with ``targets``, ``ignore`` and ``method``, recipe.schema.TargetedStage)

def default_targets(model: nn.Module) -> list[str]:
    """Every linear inside the decoder layers (embeddings and lm_head only when targeted)."""
    return [rf"^{re.escape(discover(model).layers_path)}\."]


def target_layers(model: nn.Module, cfg: TargetedStage) -> dict[str, nn.Module]:
    """Matched dense linears (a module shared by layers once)."""
    layers = match_modules(model, cfg.targets or default_targets(model), cfg.ignore, kind=LINEAR_TYPES)
    return {n: layers[n] for n in distinct(model, list(layers))}


def tied_to_embeddings(model: nn.Module, module: nn.Module) -> nn.Embedding | None:
    """The input embedding whose weight ``module`` (the LM head) shares, if it does."""
    emb = model.get_input_embeddings()
    return emb if isinstance(emb, nn.Embedding) and getattr(module, "weight", None) is emb.weight else None


def decoder_projections(model: nn.Module, arch: Arch, cfg: TargetedStage) -> dict[str, tuple[int, str]]:
    """name -> (layer index, role) of the decoder-layer projections a stage compresses: all of
    them by default, those matching ``targets`` (and not ``ignore``) otherwise."""
    found = {name: (i, role) for i in range(arch.num_layers) for role, name in arch.projections(i).items()}
    chosen = match_modules(model, cfg.targets or ["."], cfg.ignore, what=f"{cfg.method}.targets")
    return {n: v for n, v in found.items() if n in chosen}
