"""What storing the tied embedding/head in float16 (``method: half``) or in 8 bits costs in
perplexity: a folder's protocol perplexity (40 windows of 512 tokens of wiki.test and brown)
with its float32 head, then with the same head rounded to float16 in place (what the stage
stores), then (``--8bit``) with the head palettized as ``bench_runtime.HEAD_8BIT`` (a 256-entry
float16 codebook per 64 rows, plain k-means).

Usage: python scripts/experiments/bench_half_head.py FOLDER [--threads 2] [--8bit]
(FOLDER: a model folder whose head is still dense float32: one a recipe without the half stage
wrote, e.g. configs/kmeans_4bit.yaml with that stage deleted, or the builtin model's folder,
``~/.cache/wscompress/smollm2-135m-instruct``)
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: the benchmarks' shared helpers
from _common import parse, parser  # noqa: E402

import wscompress  # noqa: E402
from wscompress.evaluation.perplexity import evaluate_text  # noqa: E402

TEXTS = ["builtin:wiki.test", "builtin:brown"]


@torch.no_grad()
def main() -> None:
    ap = parser(__doc__, threads=2)
    ap.add_argument("folder", type=Path)
    ap.add_argument("--8bit", dest="eight", action="store_true", help="also the head in 8 bits (HEAD_8BIT)")
    args = parse(ap)
    model, tokenizer = wscompress.load(args.folder, device="cpu")
    model.eval()
    head = model.get_output_embeddings().weight
    if not isinstance(head, torch.nn.Parameter) or head.dtype != torch.float32:
        raise SystemExit(f"{args.folder}: its head is not a dense float32 table (already compressed?)")
    rows = {}
    for label in ("float32 head", "float16 head"):
        if label == "float16 head":
            head.copy_(head.half().float())
        rows[label] = [evaluate_text(model, tokenizer, text, 512, max_windows=40)["ppl"] for text in TEXTS]
    if args.eight:
        from bench_runtime import HEAD_8BIT

        model, tokenizer = wscompress.load(args.folder, device="cpu")  # the float32 head again
        wscompress.compress(model.eval(), [HEAD_8BIT], tokenizer=tokenizer)
        rows["8-bit head"] = [evaluate_text(model, tokenizer, text, 512, max_windows=40)["ppl"] for text in TEXTS]
    print("| head | " + " | ".join(t.split(":")[-1] for t in TEXTS) + " |\n|---|" + "---|" * len(TEXTS))
    for label, ppl in rows.items():
        change = [f"{p:.4f} ({100 * (p / base - 1):+.3f} %)" for p, base in zip(ppl, rows["float32 head"])]
        print(f"| {label} | " + " | ".join(change) + " |")


if __name__ == "__main__":
    main()
