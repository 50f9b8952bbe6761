"""Multi-head to grouped-query attention: each group of consecutive key/value heads becomes one
head, query head q reads kv head q // (num_heads / groups) as stock transformers' GQA does, and
``num_key_value_heads`` in the config follows, so the result runs with stock code. Works from
MHA or from a model that is already GQA (to fewer groups); groups = 1 is multi-query attention.

``init: mean`` averages the group's heads (Ainslie et al. 2023, who uptrain afterwards).
``init: pca`` (the default) keeps what the group's heads compute on the calibration activations
as well as one head can, and folds the rest into the projections that read them, in the spirit
of SVD-based KV head compression (Yu et al. 2024), exact under RoPE:

- values: the group's outputs v_h, each weighted by what o_proj makes of it
  (M_h = Σ W_o,qᵀ W_o,q over the query heads that read h), are replaced by their top d_h
  principal components v'; each query head's slice of o_proj maps v' back.
- keys: RoPE turns each pair of dimensions (j, j + d_h/2) by an angle that depends on the
  position, so the only maps that can move from keys to queries are a complex factor per pair.
  For each pair, the group's keys z_h (as complex numbers) are replaced by their top complex
  principal component z' (weighted by the energy of the queries that read them) with
  z_h ≈ u_h·z', and each query pair is multiplied by conj(u_h): q·k stays as close as one
  shared key allows, at every position. A per-head norm on the keys (Gemma 3's, Qwen3's
  ``k_norm``) or a RoPE that is not over whole heads in halves leaves no such factor: keys are
  averaged there, and the report says so.
Where the heads of a group are such transforms of each other, the result is exact. The heads
are merged on the original model's statistics (the Gram of each attention input, as
``calibrate`` collects it). With ``refit`` (default) the layers are then taken in order and each
merged o_proj is re-solved by least squares so that the merged attention's output matches the
original attention's on the inputs the already-merged layers feed it: o makes up for what the
merged keys and values lose (``pipeline/refit.py``, ``ridge`` toward the folded o).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator, Literal

import torch
from pydantic import Field
from torch import nn

from ..errors import UsageError
from ..io.data import first_samples
from ..model.arch import Arch, discover, distinct, get_module, replace_everywhere, require_unshared, weight_of
from ..pipeline.refit import LeastSquares, WeightFit, fit_pass
from ..recipe.schema import LayerRefit, StageConfig
from . import register


class GQAConfig(StageConfig, LayerRefit):
    method: Literal["gqa"] = "gqa"
    groups: int = Field(ge=1, description="key/value heads after conversion (1: multi-query attention)")
    init: Literal["pca", "mean"] = Field("pca", description="pca: calibrated, keeps the heads' principal components and "
                                         "folds the rest into q/o (see gqa.py); mean: average the heads (data-free)")

    def projections(self, model: nn.Module, arch: Arch) -> list[dict[str, str]]:
        """Every layer's projections by role, refused where the model cannot take the merge."""
        kv = arch.num_kv_heads
        if not hasattr(model.config, "num_key_value_heads"):
            raise UsageError(f"gqa: {arch.model_type} has no num_key_value_heads in its config, so stock "
                             "transformers could not run a GQA result", "use a LLaMA/Mistral/Qwen2/Gemma-style model")
        if kv % self.groups:
            divisors = [d for d in range(1, kv + 1) if kv % d == 0]
            raise UsageError(f"gqa: groups={self.groups} does not divide the model's {kv} key/value heads",
                             f"use one of {divisors}")
        projections = [arch.projections(i) for i in range(arch.num_layers)]
        for i, roles in enumerate(projections):
            if any(r not in roles for r in "qkvo"):
                raise UsageError(f"gqa: layer {i} has no separate q/k/v/o projections",
                                 "gqa needs q_proj, k_proj, v_proj and o_proj")
        if self.init == "pca":
            require_unshared(model, [roles[r] for roles in projections for r in "qkvo"],
                             "gqa (init: pca; init: mean pools shared projections)")
        return projections

    def check(self, model: nn.Module) -> None:
        self.projections(model, discover(model))


def linear(weight: torch.Tensor, bias: torch.Tensor | None, like: torch.Tensor) -> nn.Linear:
    """An nn.Linear holding ``weight`` and ``bias`` in ``like``'s dtype and device."""
    lin = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device=like.device, dtype=like.dtype)
    with torch.no_grad():
        lin.weight.copy_(weight)
        if bias is not None:
            lin.bias.copy_(bias)
    return lin


@torch.no_grad()
def pool_heads(module: nn.Module, heads: int, groups: int) -> nn.Linear:
    """An nn.Linear whose output heads are the means of ``heads // groups`` consecutive heads."""
    w = weight_of(module).detach()
    out = w.shape[0] // heads * groups
    bias = getattr(module, "bias", None)
    mean_bias = None if bias is None else bias.reshape(groups, heads // groups, -1).float().mean(1).reshape(out)
    return linear(w.reshape(groups, heads // groups, -1, w.shape[1]).float().mean(1).reshape(out, -1), mean_bias, w)


def _double(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach().double()


@torch.no_grad()
def merge_values(wv: torch.Tensor, bv: torch.Tensor | None, wo: torch.Tensor, gram: torch.Tensor, heads: int,
                 groups: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, float]:
    """(v weight, v bias, o weight, share of the weighted energy kept) for ``groups`` value heads
    from the kv heads of ``wv`` (kv·d, D), read by the ``heads`` query heads of ``wo`` (D', heads·d)."""
    wv, bv, wo, gram = _double(wv), _double(bv), _double(wo), gram.double()
    d = wo.shape[1] // heads
    kv = wv.shape[0] // d
    g, r = kv // groups, heads // kv
    wo_q = wo.view(wo.shape[0], kv, r, d)
    m = torch.einsum("ohri,ohrj->hij", wo_q, wo_q)  # per kv head: what o_proj makes of an error in it
    m = m + 1e-9 * m.diagonal(dim1=1, dim2=2).mean() * torch.eye(d, dtype=m.dtype, device=m.device)
    lower = torch.linalg.cholesky(m)  # M_h = L Lᵀ: ‖Lᵀ δ‖ measures an error δ in v_h
    s = (lower.mT @ wv.view(kv, d, -1)).reshape(groups, g * d, -1)  # the weighted heads, stacked per group
    vals, vecs = torch.linalg.eigh(s @ gram @ s.mT)
    top = vecs[..., -d:]  # (groups, g·d, d): the group's top d principal directions
    new_v = (top.mT @ s).reshape(groups * d, -1)
    new_b = None if bv is None else (top.mT @ (lower.mT @ bv.view(kv, d, 1)).reshape(groups, g * d, 1)).reshape(-1)
    back = torch.linalg.solve_triangular(lower.mT, top.reshape(kv, d, d), upper=True)  # v_h ≈ L⁻ᵀ Ũ_h v'
    new_o = torch.einsum("ohri,hij->ohrj", wo_q, back).reshape(wo.shape)
    kept = (vals[..., -d:].sum() / vals.sum().clamp_min(1e-300)).item()
    return new_v, new_b, new_o, kept


def _pairs(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows (heads·d, D) as complex (heads, d/2, D): dimension j + i·(j + d/2), RoPE's pairs."""
    a, b = w.view(heads, 2, -1, w.shape[-1]).unbind(1)
    return torch.complex(a, b)


def _rows(z: torch.Tensor) -> torch.Tensor:
    """The inverse of ``_pairs``: complex (heads, d/2, ...) back to real rows (heads·d, ...)."""
    return torch.stack([z.real, z.imag], 1).reshape(-1, *z.shape[2:])


@torch.no_grad()
def merge_keys(wk: torch.Tensor, bk: torch.Tensor | None, wq: torch.Tensor, bq: torch.Tensor | None,
               gram: torch.Tensor, heads: int, groups: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor,
                                                                     torch.Tensor | None, float]:
    """(k weight, k bias, q weight, q bias, share of the weighted energy kept) for ``groups`` key
    heads from those of ``wk`` (kv·d, D), read by the ``heads`` query heads of ``wq`` (heads·d, D)."""
    wk, bk, wq, bq, gram = _double(wk), _double(bk), _double(wq), _double(bq), gram.double()
    d = wq.shape[0] // heads
    kv = wk.shape[0] // d
    g, r = kv // groups, heads // kv
    zq, zk = _pairs(wq, heads), _pairs(wk, kv)  # (heads, d/2, D), (kv, d/2, D)
    energy = ((wq @ gram) * wq).sum(-1).view(heads, 2, -1).sum(1)  # E|q_pair|² per query head and pair
    scale = energy.view(kv, r, -1).sum(1).clamp_min(1e-30).sqrt().view(groups, g, -1).permute(0, 2, 1)  # (groups, d/2, g)
    zg = zk.view(groups, g, d // 2, -1)
    cov = torch.einsum("ghpd,gkpd->gphk", torch.complex(zg.real @ gram, zg.imag @ gram), zg.conj())
    vals, vecs = torch.linalg.eigh(scale[..., :, None] * cov * scale[..., None, :])
    top = vecs[..., -1]  # (groups, d/2, g): per pair, the weighted heads' top complex direction
    mix = top.conj() * scale  # z' = Σ_h conj(ũ_h)·√s_h·z_h
    new_k = _rows(torch.einsum("gph,ghpd->gpd", mix, zg))
    new_bk = None if bk is None else _rows(torch.einsum("gph,ghp->gp", mix, _pairs(bk[:, None], kv)[..., 0].view(groups, g, -1)))
    u = (top / scale).permute(0, 2, 1).reshape(kv, d // 2)  # z_h ≈ u_h·z'
    factor = u.conj().repeat_interleave(r, 0)  # per query head: the factor its pairs take
    new_q = _rows(factor[..., None] * zq)
    new_bq = None if bq is None else _rows(factor * _pairs(bq[:, None], heads)[..., 0])
    kept = (vals[..., -1].sum() / vals.sum(-1).sum().clamp_min(1e-300)).item()
    return new_k, new_bk, new_q, new_bq, kept


def _keys_by_pca(arch: Arch) -> str | None:
    """Why keys cannot take the RoPE-exact merge here (None: they can)."""
    if arch.qk_norm:
        return "a per-head norm on queries and keys"
    if not arch.rope_in_halves:
        return "RoPE on other pairs than whole heads in halves"
    return None


def _bias(module: nn.Module) -> torch.Tensor | None:
    return getattr(module, "bias", None)


@torch.no_grad()
def merged_projections(model: nn.Module, arch: Arch, i: int, gram: torch.Tensor, groups: int,
                       keys: bool) -> tuple[dict[str, nn.Module], float, float]:
    """Layer ``i``'s projections for ``groups`` kv heads by name, by ``merge_values`` (and
    ``merge_keys``, else mean keys), ``gram`` the Gram of its input, and the shares of the value
    and key energy kept (NaN: keys averaged). The model is not changed."""
    roles = arch.projections(i)
    q, k, v, o = (get_module(model, roles[r]) for r in "qkvo")
    heads, kv = arch.num_heads, arch.num_kv_heads
    gram = gram.to(weight_of(k).device)
    new_v, new_bv, new_o, kept_v = merge_values(weight_of(v), _bias(v), weight_of(o), gram, heads, groups)
    new = {roles["v"]: linear(new_v, new_bv, weight_of(v)), roles["o"]: linear(new_o, _bias(o), weight_of(o))}
    kept_k = float("nan")
    if keys:
        new_k, new_bk, new_q, new_bq, kept_k = merge_keys(weight_of(k), _bias(k), weight_of(q), _bias(q), gram, heads, groups)
        new[roles["k"]], new[roles["q"]] = linear(new_k, new_bk, weight_of(k)), linear(new_q, new_bq, weight_of(q))
    else:
        new[roles["k"]] = pool_heads(k, kv, groups)
    return new, kept_v, kept_k


def set_kv_heads(model: nn.Module, arch: Arch, i: int, groups: int) -> None:
    """Layer ``i``'s attention reads ``groups`` kv heads (the attributes its forward uses)."""
    attn = get_module(model, arch.submodule_name(i, "attn"))
    if hasattr(attn, "num_key_value_groups"):  # read by the attention kernel: heads per kv head
        attn.num_key_value_groups = arch.num_heads // groups
    if hasattr(attn, "num_key_value_heads"):
        attn.num_key_value_heads = groups


def refit_o(model: nn.Module, arch: Arch, projections: list[dict[str, str]], build: Callable[[int], dict[str, nn.Module]],
            cfg: GQAConfig, ctx) -> None:
    """Swap the merged projections in layer by layer (``build``; ``pipeline.refit.fit_pass``)
    and re-solve each merged o_proj for the original o_proj's target on what the merged
    attention feeds it, toward the folded o."""
    o_names = {roles["o"] for roles in projections}

    def stage(modules: dict[str, nn.Module], weights: dict[str, torch.Tensor], same: bool, _dtype) -> WeightFit | None:
        (name, o), *more = modules.items()
        if more or name not in o_names:
            return None
        return WeightFit(weights[name], same, LeastSquares(weight_of(o), cfg.ridge), lambda fit: fit.write(o))

    @contextmanager
    def original_heads(i: int) -> Iterator[None]:  # the original attention reads all its kv heads
        set_kv_heads(model, arch, i, arch.num_kv_heads)
        try:
            yield
        finally:
            set_kv_heads(model, arch, i, cfg.groups)

    fit_pass(model, arch, first_samples(ctx.calibration(), cfg.refit_samples), build, stage, cfg.refit_target,
             ctx.dtype(model), as_original=original_heads, label="gqa (o_proj refit)")


@register(GQAConfig, whole_model=True)
def apply(model, cfg: GQAConfig, ctx) -> dict:
    arch = discover(model)
    heads, kv = arch.num_heads, arch.num_kv_heads
    projections = cfg.projections(model, arch)
    report = {"kv_heads_before": kv, "kv_heads_after": cfg.groups, "query_heads": heads, "init": cfg.init}
    if cfg.init == "mean":
        pooled = distinct(model, [roles[r] for roles in projections for r in ("k", "v")])
        for name in pooled:
            module = get_module(model, name)  # shared across layers (cross_layer): pooled once, stays shared
            replace_everywhere(model, module, pool_heads(module, kv, cfg.groups))
        for i in range(arch.num_layers):
            set_kv_heads(model, arch, i, cfg.groups)
    else:
        pooled = [roles[r] for roles in projections for r in "qkvo"]
        # The heads are merged on the original model's statistics: merging them on what the
        # already-merged layers feed them fits the drifted keys and values, not the original's
        # (protocol, 3 -> 1 kv heads, wiki.test / brown: without refit 98.89 / 175.11 against
        # 120.35 / 190.73; with it 56.19 / 120.11 against 55.68 / 121.61, for a Gram less a layer).
        stats = ctx.stats(model, [roles["k"] for roles in projections])
        why_not, kept = _keys_by_pca(arch), []

        def build(i: int) -> dict[str, nn.Module]:
            new, *energy = merged_projections(model, arch, i, stats.of(projections[i]["k"]), cfg.groups, why_not is None)
            kept.append(energy)
            set_kv_heads(model, arch, i, cfg.groups)  # the merged attention reads fewer kv heads
            return new

        if not cfg.refit:
            for i in range(arch.num_layers):
                for name, module in build(i).items():
                    replace_everywhere(model, get_module(model, name), module)
        else:  # layer by layer, each o_proj refit on what the merged layers before feed it
            refit_o(model, arch, projections, build, cfg, ctx)
        report |= {"refit": cfg.refit, "value_energy_kept": round(sum(v for v, _ in kept) / len(kept), 4),
                   "key_energy_kept": "keys averaged: " + why_not if why_not else round(sum(k for _, k in kept) / len(kept), 4)}
    model.config.num_key_value_heads = cfg.groups
    return report | {"trains": pooled}  # the changed projections (Ainslie et al. uptrain after pooling)
