"""Peak memory of calibrate + compress against model size and depth (issue 17).

Random LLaMA-shaped models are built from configs (no download) and saved once as float32
safetensors under the cache (with SmolLM2's tokenizer, whose 49152 ids the models' vocabulary
covers). For each (model, method, offload) `wscompress calibrate` and then `wscompress compress`
run in fresh processes (calibration 8 x 256 tokens of wiki.train.txt); their reports give the
seconds and the peak resident memory (peak CUDA memory on a GPU). The table puts each peak next
to the model's weight bytes: with the model in memory the peak should stay near the weights,
with ``offload: disk`` below them, and the part beyond the weights should not grow with depth.

Writes outputs/bench-scale/results.{json,md} and prints the table.
Usage: python scripts/bench_scale.py [--sizes 135m 0.5b 1.1b] [--methods svd basis_sharing kmeans]
                                     [--offload none disk] [--layers 11 22]
       python scripts/bench_scale.py --dry-run   (svd on a toy model, in memory and from disk: the suite runs it)
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import yaml

from _common import markdown, parser, step, toy_model, write_results

SHAPES = {  # LLaMA-shaped: hidden, FFN, layers, query / key-value heads
    "135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                 num_key_value_heads=3, tie_word_embeddings=True),
    "0.5b": dict(hidden_size=1536, intermediate_size=4096, num_hidden_layers=16, num_attention_heads=12,
                 num_key_value_heads=4, tie_word_embeddings=False),
    "1.1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                 num_key_value_heads=4, tie_word_embeddings=False),
}
STAGES = {"svd": {"method": "svd", "ratio": 0.2}, "basis_sharing": {"method": "basis_sharing", "ratio": 0.2},
          "kmeans": {"method": "kmeans", "bits": 4}}


def build(size: str, layers: int | None) -> Path:
    """The model folder (built and saved on first use)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from wscompress.io.checkpoints import builtin_dir
    from wscompress.io.files import cache_dir

    shape = {**SHAPES[size], **({"num_hidden_layers": layers} if layers else {})}
    folder = cache_dir() / "bench-scale" / f"{size}-{shape['num_hidden_layers']}l"
    if (folder / "config.json").is_file():
        return folder
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, max_position_embeddings=2048, **shape)
    model = LlamaForCausalLM(config).float()
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(builtin_dir("smollm2-135m-instruct")).save_pretrained(tmp)
    tmp.rename(folder)
    return folder


def digest(folder: Path) -> str:
    """Short sha1 of the written weight files, so offloaded and in-memory outputs can be compared."""
    h = hashlib.sha1()
    for f in sorted(folder.glob("*.safetensors")):
        with f.open("rb") as fh:
            while chunk := fh.read(1 << 24):
                h.update(chunk)
    return h.hexdigest()[:10]


def main() -> None:
    ap = parser(__doc__, out="bench-scale")
    ap.add_argument("--sizes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--methods", nargs="+", default=list(STAGES), choices=list(STAGES))
    ap.add_argument("--offload", nargs="+", default=["none", "disk"], choices=["none", "cpu", "disk"])
    ap.add_argument("--layers", type=int, nargs="+", default=[None], help="override the depth (e.g. 11 22)")
    ap.add_argument("--dry-run", action="store_true", help="svd (uniform ranks, no refit) on a toy model, in memory "
                    "and from disk, calibrated on a short text: checks the script in a minute")
    args = ap.parse_args()
    stages = STAGES
    if args.dry_run:  # svd without its calibrated allocation and refit: seconds, not the quality, are checked
        args.sizes, args.layers, args.methods, args.offload = ["toy"], [None], ["svd"], ["none", "disk"]
        stages = {"svd": {**STAGES["svd"], "allocation": "uniform", "refit": False}}
    rows = []
    for size in args.sizes:
        for layers in args.layers:
            folder = toy_model(args.out / "toy") if size == "toy" else build(size, layers)
            text = str(folder / "calibration.txt") if size == "toy" else "builtin:wiki.train"
            weights = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
            for method in args.methods:
                for offload in args.offload:
                    out = args.out / f"{folder.name}-{method}-{offload}"
                    shutil.rmtree(out, ignore_errors=True)
                    out.mkdir(parents=True)
                    recipe = out / "recipe.yaml"
                    recipe.write_text(yaml.safe_dump({
                        "model": {"path": str(folder), "offload": offload},
                        "calibration": {"dataset": text,
                                        "num_samples": 8, "seq_len": 256, "batch_size": 4},
                        "compress": [stages[method]], "output": {"dir": str(out), "max_shard_size": "512MB"}}))
                    calib, comp = step("calibrate", recipe, out), step("compress", recipe, out)
                    peak = max(calib["peak_memory_mb"], comp["peak_memory_mb"]) * 2**20
                    rows.append({"model": folder.name, "weights GB": round(weights / 1e9, 2), "method": method,
                                 "offload": offload, "calibrate s": calib["seconds"],
                                 "calibrate peak GB": round(calib["peak_memory_mb"] * 2**20 / 1e9, 2),
                                 "compress s": comp["stages"][0]["seconds"],
                                 "compress peak GB": round(comp["peak_memory_mb"] * 2**20 / 1e9, 2),
                                 "peak / weights": round(peak / weights, 2),
                                 "peak - weights GB": round((peak - weights) / 1e9, 2),
                                 "output sha1": digest(out / "model")})
                    print(rows[-1], flush=True)
                    shutil.rmtree(out / "model", ignore_errors=True)  # GBs each: the reports stay
    write_results(args.out, {"rows": rows}, markdown(rows))
    print(markdown(rows))


if __name__ == "__main__":
    main()
