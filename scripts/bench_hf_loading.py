"""The compressed folder outside wscompress, on the real SmolLM2-135M-Instruct: for each compressed
form, the size of the folder `from_pretrained` reads next to its dense export, the time of the
three loads (`wscompress.load`; `AutoModelForCausalLM.from_pretrained` after `import wscompress`;
`from_pretrained(..., trust_remote_code=True)` in a fresh Python where wscompress cannot be
imported), and the largest logit difference of each load to the model that was saved.

The stages use the fast options (no refit, uniform ranks, k-means without calibration): the
structure and the bytes are those of the defaults, the quality is not (docs/*.md has quality).

Writes outputs/bench-hf-loading/results.{json,md} and prints the table.
Usage: python scripts/bench_hf_loading.py [--forms svd kmeans ...] [--out outputs/bench-hf-loading]
       python scripts/bench_hf_loading.py --dry-run   (every form of a toy model: the suite runs it)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

import wscompress
from _common import REPO, markdown, parser, toy_model, write_results
from wscompress.io import storage

sys.path.insert(0, str(REPO / "tests"))
from test_transformers import WITHOUT_WSCOMPRESS  # noqa: E402  (the no-wscompress load the tests run)

FAST_KMEANS = {"sensitivity": "none", "error_feedback": False, "refit": False}
FORMS = {
    "svd 20 %": [{"method": "svd", "ratio": 0.2, "allocation": "uniform", "refit": False}],
    "basis_sharing 20 %, group 2": [{"method": "basis_sharing", "ratio": 0.2, "allocation": "uniform", "refit": False}],
    "kmeans 4-bit per channel": [{"method": "kmeans", "bits": 4, **FAST_KMEANS}],
    "kmeans 4-bit, Huffman indices": [{"method": "kmeans", "bits": 4, "entropy_coding": True, **FAST_KMEANS}],
    "kmeans 3-bit, tied table and head": [{"method": "kmeans", "bits": 3, "targets": ["lm_head", "layers"], **FAST_KMEANS}],
    "basis_sharing 20 % then kmeans 4-bit": [{"method": "basis_sharing", "ratio": 0.2, "allocation": "uniform", "refit": False},
                                             {"method": "kmeans", "bits": 4, **FAST_KMEANS}],
    "cross_layer FFN, groups of 2": [{"method": "cross_layer", "what": "ffn", "group_size": 2, "init": "mean", "refit": False}],
}


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def main() -> None:
    ap = parser(__doc__, out="bench-hf-loading")
    ap.add_argument("--forms", nargs="*", default=list(FORMS), help="which rows (default: all)")
    ap.add_argument("--dry-run", action="store_true", help="every form of a toy model calibrated on a short text: "
                    "checks the script in a minute")
    args = ap.parse_args()
    from transformers import AutoConfig, AutoModelForCausalLM

    from wscompress.io.checkpoints import builtin_dir

    source = toy_model(args.out / "toy") if args.dry_run else builtin_dir("smollm2-135m-instruct")
    vocab = AutoConfig.from_pretrained(source).vocab_size
    ids = torch.randint(0, vocab, (1, 64), generator=torch.Generator().manual_seed(0))
    text = str(source / "calibration.txt") if args.dry_run else "builtin:wiki.train"
    calibration = {"dataset": text, "num_samples": 8, "seq_len": 256, "batch_size": 4}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        base, _ = wscompress.load(source, device="cpu")
        rows.append({"model": "original", "params": storage.stats(base)["params"],
                     "folder MB": round(storage.file_size(source) / 2**20, 1)})
        del base
        folders, saved = {}, {}
        for name in args.forms:
            model, tok = wscompress.load(source, device="cpu")
            wscompress.compress(model, FORMS[name], tok, calibration)
            folder = tmp / f"form{len(folders)}"
            storage.save(model, tok, folder)
            storage.export_dense(model, tok, tmp / f"{folder.name}-dense")
            with torch.no_grad():
                saved[name] = model(ids).logits
            folders[name] = folder
        save_file({"ids": ids}, tmp / "ids.safetensors")
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"HF_MODULES_CACHE": str(tmp / "modules")}
        start = time.perf_counter()
        done = subprocess.run([sys.executable, "-c", WITHOUT_WSCOMPRESS, json.dumps({n: str(f) for n, f in folders.items()}),
                               str(tmp / "ids.safetensors"), str(tmp / "remote.safetensors")], env=env, cwd=tmp,
                              capture_output=True, text=True, stdin=subprocess.DEVNULL)
        if done.returncode:
            raise SystemExit(done.stderr[-3000:])
        remote, remote_s = load_file(tmp / "remote.safetensors"), time.perf_counter() - start
        for name, folder in folders.items():
            (ours, _), ours_s = timed(lambda: wscompress.load(folder, device="cpu"))
            stock, stock_s = timed(lambda: AutoModelForCausalLM.from_pretrained(folder))
            with torch.no_grad():
                diffs = [(got - saved[name]).abs().max().item() for got in (ours(ids).logits, stock(ids).logits, remote[name])]
            rows.append({"model": name, "params": storage.stats(ours)["params"],
                         "folder MB": round(storage.file_size(folder) / 2**20, 1),
                         "dense export MB": round(storage.file_size(tmp / f"{folder.name}-dense") / 2**20, 1),
                         "wscompress.load s": round(ours_s, 2), "from_pretrained s": round(stock_s, 2),
                         "max |Δ logit| (load / from_pretrained / without wscompress)": " / ".join(f"{d:.1e}" for d in diffs)})
    md = (markdown(rows) + f"\n\nwithout wscompress: one fresh Python loaded all {len(folders)} folders with "
          f"trust_remote_code=True and ran them in {remote_s:.1f} s (interpreter and transformers start-up included)")
    write_results(args.out, {"rows": rows, "remote_s": remote_s}, md)
    print(md)


if __name__ == "__main__":
    main()
