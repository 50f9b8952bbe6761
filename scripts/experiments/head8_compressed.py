"""Record: the tied embedding/head in 8 bits on a compressed folder whose head is float16 (a shipped
k-means recipe's): the head turned back into a float32 table, stored by one stage, then the
protocol's perplexity (40 windows of 512 tokens of wiki.test and brown). Behind docs/runtime.md's
and docs/clustering.md's 8-bit head figures (2026-11-29).

STAGE: a JSON stage for the head, `int8` (default: int8 blocks of 32, Q8_0), `kmeans` (the
palettized 8-bit head, ``bench_runtime.HEAD_8BIT``; a JSON object updates its options) or `half`.

--off-grid: first move every table value by a normal draw whose deviation is its int8 block's step.
SmolLM2's table is Q8_0 values already (int8 blocks of 32 store it exactly), so this stands in for
a model whose table lies on no 8-bit grid: a value's place between two steps is then uniform, and
the rounding costs what it costs on any table (a smaller move would round back to the old grid).
Compare its `int8` figures with its `half` ones (the same moved table in float16).

Usage: python scripts/experiments/head8_compressed.py FOLDER [int8|half|kmeans|'{"group_size": 4}'] [--off-grid]
"""
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_runtime import HEAD_8BIT  # noqa: E402

import wscompress  # noqa: E402
from wscompress.evaluation.perplexity import evaluate_text  # noqa: E402
from wscompress.model.forms.wscompress_narrow import INT8_BLOCK  # noqa: E402

args = [a for a in sys.argv[1:] if a != "--off-grid"]
choice = args[1] if len(args) > 1 else "int8"
stage = {"int8": {"method": "int8"}, "half": {"method": "half"}, "kmeans": HEAD_8BIT}.get(choice) or {**HEAD_8BIT, **json.loads(choice)}
torch.set_num_threads(2)
model, tokenizer = wscompress.load(args[0], device="cpu")
head = model.get_output_embeddings().to_dense()  # the float16 table, as float32
if "--off-grid" in sys.argv:
    with torch.no_grad():
        blocks = head.weight.view(head.weight.shape[0], -1, INT8_BLOCK)
        step = blocks.abs().amax(-1, keepdim=True) / 127
        gen = torch.Generator().manual_seed(0)
        blocks += torch.randn(blocks.shape, generator=gen) * step
embedding = torch.nn.Embedding(*head.weight.shape[::-1])
embedding.weight = head.weight  # tied, as the recipe's model was before its half stage
model.set_output_embeddings(head)
model.set_input_embeddings(embedding)
wscompress.compress(model.eval(), [stage], tokenizer=tokenizer)
with torch.no_grad():
    print(choice, "off-grid" if "--off-grid" in sys.argv else "", type(model.get_output_embeddings()).__name__,
          {t: round(evaluate_text(model, tokenizer, t, 512, max_windows=40)["ppl"], 4)
           for t in ("builtin:wiki.test", "builtin:brown")})
