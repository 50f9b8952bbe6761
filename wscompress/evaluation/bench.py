"""Latency and throughput of the original vs the compressed model, in one table with ratios.

Each model is measured in a fresh child process, so its load time is a real load and its peak
memory (CUDA: peak allocation; CPU: peak resident set of the process) is its own. Prefill runs
the whole prompt without a KV cache; decode times ``decode_tokens`` greedy steps on the cache
of a prompt. On CUDA the timings come from CUDA events, on CPU from the wall clock; both after
``warmup`` untimed runs, reported as the median of ``repeats``.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

import torch
from torch import nn

from ..io import storage, ui
from ..io.checkpoints import checkpoint_files, load_model, resolve_path
from ..io.offload import model_device, offload_of
from ..recipe.schema import BenchConfig, ModelConfig
from .decode import StaticDecoder, cache_argument, prompt_forward
from .profile import copy_bandwidth, decode_breakdown
from .report import peak_memory_mb


def weight_files_bytes(cfg: ModelConfig) -> int | None:
    """Bytes of the checkpoint's weight files (None for a hub id not in the local cache)."""
    path, gguf = resolve_path(cfg)
    if gguf:
        return (Path(path) / gguf).stat().st_size
    files = checkpoint_files(path, cfg.revision) or list(Path(path).glob("*.bin"))
    return sum(f.stat().st_size for f in files) if files else None


def _elapsed(device: torch.device, fn: Callable[[], None]) -> float:
    """Seconds one call of ``fn`` takes: CUDA events on a GPU, the wall clock elsewhere."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end) / 1000
    begin = time.perf_counter()
    fn()
    return time.perf_counter() - begin


def _median_seconds(device: torch.device, run: Callable[[object], None], setup: Callable[[], object], cfg: BenchConfig) -> float:
    """Median time of ``run(setup())`` over ``repeats`` after ``warmup`` runs (setup is not timed)."""
    times = []
    for i in range(cfg.warmup + cfg.repeats):
        state = setup()
        seconds = _elapsed(device, lambda s=state: run(s))
        if i >= cfg.warmup:
            times.append(seconds)
    return statistics.median(times)


@torch.no_grad()
def throughput(model: nn.Module, batch: int, seq_len: int, cfg: BenchConfig) -> dict:
    """Prefill and decode tokens/s of ``model`` for one (batch size, prompt length)."""
    device = model_device(model)
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, model.config.vocab_size, (batch, seq_len), generator=gen).to(device)

    def prefill(_):
        prompt_forward(model, x)

    name = cache_argument(model)

    def prompt_cache():
        out = prompt_forward(model, x)
        return getattr(out, name), out.logits[:, -1:].argmax(-1)

    def decode(state):
        past, token = state
        for _ in range(cfg.decode_tokens):
            out = model(input_ids=token, use_cache=True, **{name: past})
            past, token = getattr(out, name), out.logits[:, -1:].argmax(-1)

    row = {"prefill_tok_s": batch * seq_len / _median_seconds(device, prefill, lambda: None, cfg)}
    graph = cfg.cuda_graph and device.type == "cuda"
    if cfg.decode_tokens and (graph or cfg.compile):
        decoder = StaticDecoder(model, x, cfg.decode_tokens, graph=graph, compile=cfg.compile)
        steps = lambda _: [decoder.step() for _ in range(cfg.decode_tokens)]  # noqa: E731
        row["decode_tok_s"] = batch * cfg.decode_tokens / _median_seconds(device, steps, decoder.reset, cfg)
    elif cfg.decode_tokens:
        row["decode_tok_s"] = batch * cfg.decode_tokens / _median_seconds(device, decode, prompt_cache, cfg)
    return row


def measure(model_cfg: ModelConfig, cfg: BenchConfig, quiet: bool = False) -> dict:
    """Load one model and measure it (runs in a child process: see the module docstring)."""
    ui.set_quiet(quiet)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    model, _ = load_model(model_cfg)
    load_s = time.perf_counter() - start
    with offload_of(model).running():  # offloaded layers are read as they run: the timings include that
        shapes = {(b, s): throughput(model, b, s, cfg) for b in ui.track(cfg.batch_sizes, "bench batch sizes")
                  for s in cfg.seq_lens}
        parts = decode_breakdown(model, copy_bandwidth(model_device(model))) if cfg.breakdown and cfg.decode_tokens \
            and not offload_of(model).moves else None
    peak = peak_memory_mb(model_device(model))
    stats, file_bytes = storage.stats(model), weight_files_bytes(model_cfg)
    return {"weights_mb": stats["tensor_bytes"] / 2**20, "bits_per_weight": stats["bits_per_weight"], "params": stats["params"],
            "resident_mb": storage.resident_bytes(model) / 2**20, "kernel": kernel_path(model),
            "file_mb": None if file_bytes is None else file_bytes / 2**20, "load_s": load_s, "peak_memory_mb": peak,
            "device": str(model_device(model)), "offload": model_cfg.offload, "breakdown": parts,
            "shapes": [{"batch": b, "seq_len": s, **r} for (b, s), r in shapes.items()]}


def kernel_path(model: nn.Module) -> str:
    """How the model's compressed layers compute, in words (for the report): each form's own
    account (``compute_path``) with the number of layers it holds for, and the kernels' build."""
    from .. import kernels
    from ..model.forms.wscompress_format import CompressedLayer

    layers = {id(m): m for m in model.modules() if isinstance(m, CompressedLayer)}.values()
    paths = Counter(f"{type(m).__name__}: {m.compute_path()}" for m in layers)
    return "; ".join(f"{path} ({n} layers)" for path, n in paths.items()) + f" [{kernels.status()}]" if paths \
        else "dense matmuls (torch)"


def comparison_rows(results: dict[str, dict]) -> list[dict]:
    """One row per measure, one column per model, plus compressed/original when both exist."""
    measures = [("weights MB", "weights_mb"), ("bits a weight", "bits_per_weight"), ("params", "params"),
                ("resident weights MB", "resident_mb"),
                ("file MB", "file_mb"), ("load s", "load_s"),
                ("peak memory MB", "peak_memory_mb")]
    rows = [{"measure": label, **{m: r[key] for m, r in results.items()}} for label, key in measures]
    first = next(iter(results.values()))
    for i, shape in enumerate(first["shapes"]):
        for key, label in (("prefill_tok_s", "prefill tok/s"), ("decode_tok_s", "decode tok/s")):
            if key in shape:
                rows.append({"measure": f"{label} b{shape['batch']} s{shape['seq_len']}",
                             **{m: r["shapes"][i][key] for m, r in results.items()}})
    if {"original", "compressed"} <= set(results):
        for row in rows:
            a, b = row["original"], row["compressed"]
            row["compressed/original"] = b / a if a and b is not None else None
    return rows


def breakdown_rows(results: dict[str, dict]) -> list[dict]:
    """Where a decoded token's time goes (batch 1), one row per model and part, then the step."""
    rows = []
    for label, r in results.items():
        b = r.get("breakdown")
        if b is None:
            continue
        rows += [{"model": label, "part": p["part"], "ms / token": p["ms"], "share": p["share"], "MB read": p["MB"],
                  "of copy bandwidth": p["of bandwidth"]} for p in b["rows"]]
        rows.append({"model": label, "part": "step", "ms / token": b["ms"], "share": 1.0, "MB read": b["MB"],
                     "of copy bandwidth": b["bound_ms"] / b["ms"]})
    return rows


def compare(models: dict[str, ModelConfig], cfg: BenchConfig) -> dict:
    """Measure each model (label -> its model section) in a fresh interpreter (spawn: fork would
    inherit this process's memory and CUDA state): the comparison table, the kernel paths and
    every measurement."""
    results = {}
    for label, mcfg in models.items():
        ui.log(f"bench: {label} ({mcfg.path})")
        with ProcessPoolExecutor(max_workers=1, mp_context=get_context("spawn")) as pool:
            results[label] = pool.submit(measure, mcfg, cfg, ui.QUIET).result()
    cuda = "cuda" in results["original"]["device"]
    return {"table": comparison_rows(results), "kernels": {label: r["kernel"] for label, r in results.items()},
            "breakdown": breakdown_rows(results), "details": results,
            "timing": ("cuda events" + (", decode steps replayed as CUDA graphs" if cfg.cuda_graph else "")) if cuda else
            f"wall clock, median of {cfg.repeats} after {cfg.warmup} warm-up"
            + (", decode steps compiled (torch.compile)" if cfg.compile else "")}
