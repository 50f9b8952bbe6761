"""Record: the tied embedding/head in 8 bits (bench_runtime.HEAD_8BIT, overridden by a JSON of
stage options) on a compressed folder whose head is float16 (a shipped k-means recipe's): the
head turned back into a float32 table, palettized, then the protocol's perplexity (40 windows of
512 tokens of wiki.test and brown). Behind docs/clustering.md's +0.25 % / +0.16 % (2026-11-29).

Usage: python scripts/experiments/head8_compressed.py FOLDER ['{"sensitivity": "activation"}']
"""
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_runtime import HEAD_8BIT  # noqa: E402

import wscompress  # noqa: E402
from wscompress.evaluation.perplexity import evaluate_text  # noqa: E402

torch.set_num_threads(2)
model, tokenizer = wscompress.load(sys.argv[1], device="cpu")
head = model.get_output_embeddings().to_dense()  # the float16 table, as float32
embedding = torch.nn.Embedding(*head.weight.shape[::-1])
embedding.weight = head.weight  # tied, as the recipe's model was before its half stage
model.set_output_embeddings(head)
model.set_input_embeddings(embedding)
wscompress.compress(model.eval(), [{**HEAD_8BIT, **json.loads(sys.argv[2] if len(sys.argv) > 2 else "{}")}],
                    tokenizer=tokenizer)
with torch.no_grad():
    print({t: round(evaluate_text(model, tokenizer, t, 512, max_windows=40)["ppl"], 4)
           for t in ("builtin:wiki.test", "builtin:brown")})
