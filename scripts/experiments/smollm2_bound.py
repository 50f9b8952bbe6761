"""Record: what bounds plain ``generate()`` on a SmolLM2-135M folder against llama.cpp's Q4_0, one
thread, in one run (docs/runtime.md). Per decoded token: llama.cpp's Q4_0 (the GGUF
peers_llamacpp.py makes from SmolLM2's source), the folder's plain ``generate()`` (no opt-in:
through the decode step compiled once for this machine, ``wscompress precompile``, which this
script runs first; and with ``WSCOMPRESS_COMPILE=0``, transformers' eager decoding) and its
products alone (every compressed linear and the head called once on a random input, nothing
else: what no loop around them can go below). Also
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


def generate(compile: str, n: int) -> None:
    os.environ["WSCOMPRESS_COMPILE"] = compile
    model.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False)


RUNS = {  # name -> (what to time, what per decoded token is, from the times by name)
    "default 1": lambda: generate("auto", 1), f"default {1 + DECODE}": lambda: generate("auto", 1 + DECODE),
    "eager 1": lambda: generate("0", 1), f"eager {1 + DECODE}": lambda: generate("0", 1 + DECODE),
    "products": lambda: [m(x) for m, x in zip(linears, inputs)] + [head(hidden)],
}
times: dict[str, list[float]] = {name: [] for name in RUNS}
with torch.no_grad():
    for _ in range(args.rounds + 1):  # interleaved: this machine's slow spells reach every row alike
        for name, run in RUNS.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
t = {name: min(v[1:]) * 1e3 for name, v in times.items()}  # the first round warms up
ms["wscompress plain generate(), the compiled step (default)"] = (t[f"default {1 + DECODE}"] - t["default 1"]) / DECODE
ms["wscompress plain generate(), WSCOMPRESS_COMPILE=0 (transformers' eager)"] = (
    t[f"eager {1 + DECODE}"] - t["eager 1"]) / DECODE
ms[f"wscompress products alone ({len(linears)} linears + head)"] = t["products"]
base = ms["llama.cpp Q4_0, whole token"]
print(f"SmolLM2-135M, {args.folder}, one thread, best of {args.rounds} interleaved rounds; CPU: {cpu_line()}\n")
print("| per decoded token | ms | x llama.cpp Q4_0 (speed) |\n|---|---|---|")
for k, v in ms.items():
    print(f"| {k} | {v:.1f} | {base / v:.2f} |")
print(f"\nThe step was ready in {compile_seconds:.0f} s (compiled once per machine, or loaded); a new process's first generate() "
      f"took {first:.1f} s more than its later ones.")
