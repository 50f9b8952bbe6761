"""Record: what bounds plain ``generate()`` on a SmolLM2-135M folder against llama.cpp's Q4_0, one
thread, in one run (docs/runtime.md). Per decoded token: llama.cpp's Q4_0 (the GGUF
peers_llamacpp.py makes from SmolLM2's source), the folder's plain ``generate()`` (no opt-in:
through the decode step compiled once for this machine, ``wscompress precompile``, which this
script runs first; and with ``WSCOMPRESS_COMPILE=0``, transformers' eager decoding), its
static-cache step eager and compiled, and its products alone (every compressed linear and the
head called once on a random input, nothing else: what no loop around them can go below). Also
the seconds a new process's first ``generate()`` takes beyond a later one's (loading the step).

Usage: python scripts/experiments/smollm2_bound.py FOLDER [--rounds 3]
"""
import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import REPO, cpu_line  # noqa: E402
from peers_llamacpp import DECODE, PREFILL, PROMPT, llama_cpp, node_runner, quantized_gguf  # noqa: E402

import wscompress  # noqa: E402
from wscompress.evaluation import step_cache  # noqa: E402
from wscompress.evaluation.decode import StaticDecoder  # noqa: E402
from wscompress.io.checkpoints import builtin_dir  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("folder", type=Path)
ap.add_argument("--rounds", type=int, default=3)
args = ap.parse_args()
torch.set_num_threads(1)
out = REPO / "outputs" / "peers_llamacpp"
gguf = quantized_gguf(next(builtin_dir("smollm2-135m-instruct").glob("*.gguf")), "Q4_0", out)
prompt = torch.randint(1000, 20000, (1, PROMPT), generator=torch.Generator().manual_seed(1))
ms = {"llama.cpp Q4_0, whole token": llama_cpp(node_runner(out), gguf, 1, args.rounds, prompt[0].tolist(),
                                               list(range(1000, 1000 + PREFILL)))["decode"] / DECODE * 1e3}

FIRST = """import sys, time, torch
torch.set_num_threads(1)
import wscompress
model, _ = wscompress.load(sys.argv[1], device="cpu")
prompt = torch.randint(1000, 20000, (1, int(sys.argv[2])), generator=torch.Generator().manual_seed(1))
times = []
for _ in range(3):
    start = time.perf_counter()
    model.generate(prompt, max_new_tokens=int(sys.argv[3]), min_new_tokens=int(sys.argv[3]), do_sample=False)
    times.append(time.perf_counter() - start)
print(times[0] - min(times[1:]))
"""
_, compile_seconds = step_cache.precompile(args.folder, 1, PROMPT + 1 + DECODE, threads=1)
first = float(subprocess.run([sys.executable, "-c", FIRST, str(args.folder), str(PROMPT), str(1 + DECODE)],
                             capture_output=True, text=True, check=True, env={**os.environ, "WSCOMPRESS_COMPILE": "auto"}
                             ).stdout.split()[-1])
model, _ = wscompress.load(args.folder, device="cpu")
model.eval()
linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not model.get_output_embeddings()]
inputs = [torch.randn(1, 1, m.in_features) for m in linears]
head, hidden = model.get_output_embeddings(), torch.randn(1, 1, model.config.hidden_size)
eager, compiled = StaticDecoder(model, prompt, DECODE), StaticDecoder(model, prompt, DECODE, compile=True)


def best(f, per: int, setup=lambda: None) -> float:
    """Best of the rounds, ms per ``per`` units, after one warm-up (``setup`` before each, untimed)."""
    times = []
    for _ in range(args.rounds + 1):
        setup()
        start = time.perf_counter()
        f()
        times.append((time.perf_counter() - start) / per * 1e3)
    return min(times[1:])


def steps(decoder: StaticDecoder) -> None:
    for _ in range(DECODE):
        decoder.step()


def plain_generate(compile: str) -> float:
    """ms a decoded token of plain generate(), WSCOMPRESS_COMPILE as given."""
    os.environ["WSCOMPRESS_COMPILE"] = compile
    times = {n: best(lambda n=n: model.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False), 1)
             for n in (1, 1 + DECODE)}
    return (times[1 + DECODE] - times[1]) / DECODE


with torch.no_grad():
    ms["wscompress plain generate(), the compiled step (default)"] = plain_generate("auto")
    ms["wscompress plain generate(), WSCOMPRESS_COMPILE=0 (transformers' eager)"] = plain_generate("0")
    ms["wscompress static-cache step, eager"] = best(lambda: steps(eager), DECODE, eager.reset)
    ms["wscompress static-cache step, compiled"] = best(lambda: steps(compiled), DECODE, compiled.reset)
    ms[f"wscompress products alone ({len(linears)} linears + head)"] = best(
        lambda: [m(x) for m, x in zip(linears, inputs)] + [head(hidden)], 1)
base = ms["llama.cpp Q4_0, whole token"]
print(f"SmolLM2-135M, {args.folder}, one thread, best of {args.rounds}; CPU: {cpu_line()}\n")
print("| per decoded token | ms | x llama.cpp Q4_0 (speed) |\n|---|---|---|")
for k, v in ms.items():
    print(f"| {k} | {v:.1f} | {base / v:.2f} |")
print(f"\nThe step compiled in {compile_seconds:.0f} s (once per machine); a new process's first generate() "
      f"took {first:.1f} s more than its later ones.")
