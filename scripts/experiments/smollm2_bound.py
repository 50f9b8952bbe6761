"""Record: what bounds plain ``generate()`` on a SmolLM2-135M folder against llama.cpp's Q4_0, one
thread, in one run (docs/runtime.md, 2026-11-29). Per decoded token: llama.cpp's Q4_0 (the
GGUF peers_llamacpp.py makes from SmolLM2's source), the folder's plain ``generate()`` (no opt-in),
its static-cache step eager and compiled, and its products alone (every compressed linear and
the head called once on a random input, nothing else: what no loop around them can go below).

Usage: python scripts/experiments/smollm2_bound.py FOLDER [--rounds 3]
"""
import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import REPO, cpu_line  # noqa: E402
from peers_llamacpp import DECODE, PREFILL, PROMPT, llama_cpp, node_runner, quantized_gguf  # noqa: E402

import wscompress  # noqa: E402
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


with torch.no_grad():
    generate = {n: best(lambda n=n: model.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False), 1)
                for n in (1, 1 + DECODE)}
    ms["wscompress plain generate()"] = (generate[1 + DECODE] - generate[1]) / DECODE
    ms["wscompress static-cache step, eager"] = best(lambda: steps(eager), DECODE, eager.reset)
    ms["wscompress static-cache step, compiled"] = best(lambda: steps(compiled), DECODE, compiled.reset)
    ms[f"wscompress products alone ({len(linears)} linears + head)"] = best(
        lambda: [m(x) for m, x in zip(linears, inputs)] + [head(hidden)], 1)
base = ms["llama.cpp Q4_0, whole token"]
print(f"SmolLM2-135M, {args.folder}, one thread, best of {args.rounds}; CPU: {cpu_line()}\n")
print("| per decoded token | ms | x llama.cpp Q4_0 (speed) |\n|---|---|---|")
for k, v in ms.items():
    print(f"| {k} | {v:.1f} | {base / v:.2f} |")
