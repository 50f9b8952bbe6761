"""k-means refit, the evidence behind its default (docs/clustering.md, "Refit, measured"):

1. families: tiny random models of every supported architecture, 3 bits, refit off and on;
   relative error of the logits on held-out random tokens.
2. ridge: SmolLM2's first --layers layers at 3 bits, calibrated on wiki.train.txt; relative
   error of the last hidden states on held-out brown.txt (not wiki.test) for no refit and
   each --ridges value, at each --samples calibration size.

Prints both tables and writes outputs/bench_kmeans_refit/results.{json,md}.
Usage: python scripts/experiments/bench_kmeans_refit.py [--parts families ridge] [--layers 6] [--samples 8 32]
       [--ridges 0.001 0.01 0.1]
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: the benchmarks' shared helpers
from _common import REPO, markdown, parser, write_results  # noqa: E402

import wscompress  # noqa: E402
from wscompress.io import data  # noqa: E402
from wscompress.io.checkpoints import load_model  # noqa: E402
from wscompress.methods.merge_drop import drop_layers  # noqa: E402
from wscompress.recipe.schema import ModelConfig  # noqa: E402

sys.path.insert(0, str(REPO / "tests"))
from conftest import make_tokenizer, tiny_model  # noqa: E402  (the tests' tiny configs of each family)

FAMILIES = ["llama", "llama_mha", "gpt2", "opt", "mistral", "qwen2", "gemma3"]


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def families() -> list[dict]:
    tok, calib = make_tokenizer(), {"dataset": "pydoc", "num_samples": 8, "seq_len": 64, "batch_size": 4}
    x = torch.randint(0, 512, (4, 64), generator=torch.Generator().manual_seed(1))
    rows = []
    for kind in FAMILIES:
        base = tiny_model(kind)
        with torch.no_grad():
            want = base(x).logits
        row = {"family": kind}
        for refit in (False, True):
            model = copy.deepcopy(base)
            wscompress.compress(model, [{"method": "kmeans", "bits": 3, "refit": refit}], tok, calib)
            with torch.no_grad():
                row[f"refit: {str(refit).lower()}"] = round(relative(model(x).logits, want), 4)
        rows.append(row)
        print(row, flush=True)
    return rows


def ridge(layers: int, samples: list[int], ridges: list[float]) -> list[dict]:
    model, tok = load_model(ModelConfig(path="builtin:smollm2-135m-instruct"))
    drop_layers(model, list(range(layers)))
    held_out = data.tokenize(tok, "builtin:brown", max_tokens=8 * 256)[: 8 * 256].view(4, 2, 256)
    with torch.no_grad():
        want = [model.model(input_ids=x).last_hidden_state for x in held_out]
    rows = []
    for n in samples:
        calib = {"dataset": "builtin:wiki.train", "num_samples": n, "seq_len": 256, "seed": 0}
        row = {"calibration": f"{n} x 256"}
        for label, stage in [("no refit", {"refit": False})] + [(f"ridge {r:g}", {"ridge": r}) for r in ridges]:
            short = copy.deepcopy(model)
            wscompress.compress(short, [{"method": "kmeans", "bits": 3, **stage}], tok, calib)
            with torch.no_grad():
                errors = [relative(short.model(input_ids=x).last_hidden_state, w) for x, w in zip(held_out, want)]
            row[label] = round(sum(errors) / len(errors), 4)
        rows.append(row)
        print(row, flush=True)
    return rows


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--parts", nargs="+", default=["families", "ridge"], choices=["families", "ridge"])
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--samples", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--ridges", type=float, nargs="+", default=[0.001, 0.01, 0.1])
    args = ap.parse_args()
    results = {}
    if "families" in args.parts:
        results["families"] = families()
    if "ridge" in args.parts:
        results["ridge"] = ridge(args.layers, args.samples, args.ridges)
    md = "\n\n".join(f"{part}\n\n{markdown(rows)}" for part, rows in results.items())
    write_results(REPO / "outputs" / "bench_kmeans_refit", results, md)
    print(md)


if __name__ == "__main__":
    main()
