"""A record (2026-11-29, issue 64): where the opt-in integer prefill's perplexity goes, each
rounding emulated alone in float on the first 16 windows of wiki.test (docs/runtime.md).

- ``FOLDER`` (a palettized folder, e.g. configs/kmeans_4bit.yaml's one-shot output): the tables
  rounded to 8 bits a group with float activations, the activations split in two 8-bit parts a
  row with exact tables, both as shipped (``kernels._integer_product``), and neither.
- ``--dense``: SmolLM2's dense decoder linears fed one 8-bit part a row (per-token scales), the
  rounding the two-part split replaced.

Usage: python scripts/experiments/int8_prefill_error.py FOLDER | --dense
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F
from torch import nn

import wscompress
from wscompress import kernels
from wscompress.evaluation.perplexity import evaluate_text

TEXT, WINDOWS = "builtin:wiki.test", 16


def two_parts(x: torch.Tensor) -> torch.Tensor:
    s = x.abs().amax(-1, keepdim=True).clamp_min(1e-30) / 127
    hi = (x / s).round()
    return hi * s + ((x - hi * s) * (254 / s)).round() * s / 254


def one_part(x: torch.Tensor) -> torch.Tensor:
    s = x.abs().amax(-1, keepdim=True).clamp_min(1e-30) / 127
    return (x / s).round() * s


def tables_8bit(module, x, indices, width, tables, group_size, out, sparse):
    t = tables.detach().float()
    unit = t.reshape(t.shape[0], t.shape[1], -1).abs().amax((1, 2)).clamp_min(1e-30) / 127
    t8 = ((t / unit.view(-1, *[1] * (t.dim() - 1))).round() * unit.view(-1, *[1] * (t.dim() - 1))).contiguous()
    return F.linear(x, module.lut_dense(indices, t8, width, group_size, out, x.shape[1], *sparse))


def activations_two_parts(module, x, indices, width, tables, group_size, out, sparse):
    w = module.lut_dense(indices, tables.detach().float().contiguous(), width, group_size, out, x.shape[1], *sparse)
    return F.linear(two_parts(x), w)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("folder", nargs="?")
    ap.add_argument("--dense", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(2)
    if args.dense:
        model, tok = wscompress.load("builtin:smollm2-135m-instruct", device="cpu")
        print("float:", evaluate_text(model, tok, TEXT, 512, max_windows=WINDOWS)["ppl"])
        for m in (m for n, m in model.named_modules() if isinstance(m, nn.Linear) and ".layers." in n):
            m.forward = (lambda m: lambda x: F.linear(one_part(x), m.weight, m.bias))(m)
        print("one 8-bit part a row:", evaluate_text(model, tok, TEXT, 512, max_windows=WINDOWS)["ppl"])
        return
    model, tok = wscompress.load(args.folder, device="cpu")
    shipped = kernels._integer_product
    os.environ["WSCOMPRESS_INT8_PREFILL"] = "1"
    for label, product in (("tables in 8 bits", tables_8bit), ("activations in two parts", activations_two_parts),
                           ("both (shipped)", shipped)):
        kernels._integer_product = product
        print(f"{label}:", evaluate_text(model, tok, TEXT, 512, max_windows=WINDOWS)["ppl"], flush=True)
    os.environ["WSCOMPRESS_INT8_PREFILL"] = "0"
    print("float:", evaluate_text(model, tok, TEXT, 512, max_windows=WINDOWS)["ppl"])


if __name__ == "__main__":
    main()
