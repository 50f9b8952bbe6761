"""Record: a compiled decode step's time with dynamo's guards on the whole model against the step
guards StaticDecoder keeps (its arguments and global state), and eager, one process, rounds taking
turns (docs/runtime.md, 2026-11-29).

Usage: python scripts/experiments/decode_guards.py FOLDER THREADS
"""
import sys
import time

import torch

import wscompress
from wscompress.evaluation.decode import StaticDecoder


class Guarded(StaticDecoder):
    def _compiled(self):
        return torch.compile(self._logits, dynamic=False, fullgraph=True)


torch.set_num_threads(int(sys.argv[2]))
model, _ = wscompress.load(sys.argv[1], device="cpu")
prompt = torch.randint(0, 1000, (1, 32))
decoders = {}
for name, cls, kw in (("eager", StaticDecoder, {}), ("compiled, all guards", Guarded, {"compile": True}),
                      ("compiled, step guards", StaticDecoder, {"compile": True})):
    t = time.perf_counter()
    decoders[name] = cls(model.eval(), prompt, 64, **kw)
    print(name, f"built in {time.perf_counter() - t:.1f} s", flush=True)
best = {k: 1e9 for k in decoders}
for _ in range(5):
    for k, dec in decoders.items():
        dec.reset()
        t = time.perf_counter()
        for _ in range(16):
            dec.step()
        best[k] = min(best[k], (time.perf_counter() - t) / 16 * 1e3)
for k, v in best.items():
    print(f"| {k} | {v:.2f} ms | {best['eager'] / v:.2f}x eager |")
