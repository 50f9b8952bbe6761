"""Where a decoded token's time goes. At batch 1 every weight is read once per token, so a
compressed model decodes faster than the dense one only as far as each part of the step runs
near the memory's speed. ``decode_breakdown`` times one greedy step on a static KV cache part by
part (forward hooks: each part's own time, its children's taken out): the linears by storage
layout, attention (its linears taken out), norms, the embedding and the head, and what is left
(the framework: Python, dispatch and the small ops between modules). Each part is reported with
the weight bytes it reads per token and the fraction of the measured copy bandwidth that
reaches, so a slow part shows whether it is bound by memory, by its kernel or by overhead.
"""

from __future__ import annotations

import time
from collections import defaultdict

import torch
from torch import nn

from ..io.storage import resident_bytes
from ..model.forms.wscompress_format import CompressedLinear
from ..model.forms.wscompress_lowrank import LowRankLinear
from ..model.forms.wscompress_palettized import PalettizedLinear

STEPS = 8  # decode steps timed (after as many warm-up steps)
REST = "rest (framework: Python, dispatch, ops between modules)"


def copy_bandwidth(device: torch.device, mb: int = 512) -> float:
    """Bytes per second a large tensor copy moves (read + write) with the current threads: the
    memory speed a decode step can reach at best."""
    src, dst = torch.ones(mb * 2**18, device=device), torch.empty(mb * 2**18, device=device)
    best = float("inf")
    for _ in range(5):
        start = _now(device)
        dst.copy_(src)
        best = min(best, _now(device) - start)
    return 2 * src.numel() * 4 / best


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def layout(module: nn.Module) -> str:
    """A linear's storage layout in words (the key its time is reported under)."""
    if isinstance(module, PalettizedLinear):
        groups = module.out_features // module.group_size
        words = [f"palettized {module.bits}-bit", "scalar" if module.cluster_dim == 1 else f"{module.cluster_dim}-d vectors",
                 "a codebook per matrix" if groups == 1 else "a codebook per channel" if module.group_size == 1
                 else f"a codebook per {module.group_size} channels"]
        return ", ".join(words + ["row scales"] * module.scaled + ["outliers"] * bool(module.outliers))
    if isinstance(module, LowRankLinear):
        return "low rank" + (" (palettized factors)" if isinstance(module.coeff, PalettizedLinear) else "")
    if isinstance(module, CompressedLinear):
        return type(module).__name__
    return "dense"


def parts(model: nn.Module) -> dict[nn.Module, tuple[str, int]]:
    """module -> (part, weight bytes it reads per decoded token) for every module timed."""
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    inside = {id(m) for m in embedding.modules()} - {id(head)}  # a palettized table is read by lookups, not forward
    out: dict[nn.Module, tuple[str, int]] = {}
    for module in model.modules():
        name = type(module).__name__
        if module is head:
            out[module] = ("head", resident_bytes(module))
        elif module is embedding:  # a lookup reads one row per token
            rows = getattr(module, "num_embeddings", 1)
            out[module] = ("embedding", resident_bytes(module) // max(rows, 1))
        elif id(module) in inside:
            continue
        elif isinstance(module, nn.Linear):
            out[module] = (f"linears: {layout(module)}", resident_bytes(module))
        elif name.endswith("Attention"):
            out[module] = ("attention (linears apart)", 0)
        elif name.endswith(("RMSNorm", "LayerNorm")) or isinstance(module, nn.LayerNorm):
            out[module] = ("norms", resident_bytes(module))
    for module in list(out):  # a low-rank layer's factors are timed as the layer: one part
        if isinstance(module, LowRankLinear):
            for inner in (module.basis, module.coeff):
                out.pop(inner, None)
    return out


@torch.no_grad()
def decode_breakdown(model: nn.Module, bandwidth: float, prompt: int = 32, steps: int = STEPS) -> dict:
    """Per decoded token at batch 1 (greedy steps on a static cache after ``prompt`` tokens):
    ``rows`` of {part, ms, share, MB, of bandwidth} and the step's ``ms`` without hooks."""
    from .decode import StaticDecoder

    device = next(model.parameters()).device
    ids = torch.randint(0, model.config.vocab_size, (1, prompt), generator=torch.Generator().manual_seed(0)).to(device)
    decoder = StaticDecoder(model, ids, 2 * steps)

    def timed() -> float:
        decoder.reset()
        for _ in range(steps):  # warm-up: layouts built, caches hot
            decoder.step()
        spent.clear()
        start = _now(device)
        for _ in range(steps):
            decoder.step()
        return (_now(device) - start) / steps

    spent: dict[str, float] = defaultdict(float)  # part -> seconds over the timed steps
    plain = min(timed() for _ in range(3))
    where = parts(model)
    stack: list[list] = []  # [part, start, children's time]
    calls: dict[str, int] = defaultdict(int)  # hooked calls made inside each part's own time (their cost lands there)

    def pre(module, *_):
        stack.append([where[module][0], _now(device), 0.0])

    def post(module, *_):
        part, start, children = stack.pop()
        elapsed = _now(device) - start
        spent[part] += elapsed - children
        calls[stack[-1][0] if stack else REST] += 1
        if stack:
            stack[-1][2] += elapsed

    hooks = [h for m in where for h in (m.register_forward_pre_hook(pre), m.register_forward_hook(post))]
    try:
        calls.clear()
        hooked = timed()
    finally:
        for h in hooks:
            h.remove()
    # the hooks' own cost (the hooked step's excess over the plain one, spread evenly over the hooked
    # calls) is taken out of the part each call ran inside, so the parts add up to the plain step
    per_call = max(hooked - plain, 0.0) * steps / max(sum(calls.values()), 1)
    per_token = {part: max(s - per_call * calls[part], 0.0) / steps for part, s in spent.items()}
    read: dict[str, int] = defaultdict(int)
    for part, nbytes in where.values():
        read[part] += nbytes
    per_token[REST] = max(plain - sum(per_token.values()), 0.0)
    rows = []
    for part in sorted(per_token, key=per_token.get, reverse=True):
        seconds, nbytes = per_token[part], read.get(part, 0)
        rows.append({"part": part, "ms": seconds * 1e3, "share": seconds / plain, "MB": nbytes / 2**20,
                     "of bandwidth": nbytes / seconds / bandwidth if nbytes and seconds > 0 else None})
    total_bytes = sum(read.values())
    return {"rows": rows, "ms": plain * 1e3, "hooked_ms": hooked * 1e3, "MB": total_bytes / 2**20,
            "bound_ms": total_bytes / bandwidth * 1e3, "bandwidth_GBs": bandwidth / 1e9}


def markdown(breakdown: dict) -> str:
    """The breakdown as a Markdown table with its totals."""
    lines = ["| part | ms / token | share | MB read / token | of copy bandwidth |", "|---|---|---|---|---|"]
    for r in breakdown["rows"]:
        frac = "" if r["of bandwidth"] is None else f"{r['of bandwidth']:.0%}"
        lines.append(f"| {r['part']} | {r['ms']:.2f} | {r['share']:.0%} | {r['MB']:.1f} | {frac} |")
    lines.append(f"| **step** | **{breakdown['ms']:.2f}** | | **{breakdown['MB']:.1f}** | "
                 f"**{breakdown['bound_ms'] / breakdown['ms']:.0%}** (bound {breakdown['bound_ms']:.2f} ms at "
                 f"{breakdown['bandwidth_GBs']:.1f} GB/s) |")
    return "\n".join(lines)
