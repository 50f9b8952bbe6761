"""Two to four bits per weight on the protocol (configs/protocol.yaml: SmolLM2, 64 x 512 GPTQ-sampled
calibration windows of wiki.train; perplexity on the first 40 windows of wiki.test and of brown,
which no default was tuned on): wscompress's clustering, one-shot and after recovery training,
side by side with what a user would reach for at the same bits.

Rows (each at every --bits where it applies):
- ours: `kmeans` scalar per channel (the default), vector codebooks (2-d, one codebook per 64
  output channels, or per 192 at 4 bits; 4-d, one per matrix at 2 bits; the 2-d per-64 rows at
  3-4 bits and the 4-d rows at 2 bits also on rows normalised by a scale each) with weights kept
  aside (OUTLIERS, or --outliers), and any of them followed by `finetune` (mode: method: the
  codebooks, scales and kept-aside weights train) for --minutes, on the LM loss or, with --kd,
  distilling the dense model's next-token distributions (--norms: the normalisation gains train
  too); each also after `rotate` (the inputs turned by random Hadamard blocks of 64: "rotated, ...").
- RTN: round to nearest on a uniform grid per group of input columns (min/max, asymmetric), a
  float16 scale and an 8-bit zero point per group (as compressed-tensors stores them).
- GPTQ with groups as llm-compressor runs it (`oneshot` + `GPTQModifier`, asymmetric, static
  activation order), in its own virtual environment (it pins another transformers):
      python -m venv .peers && .peers/bin/pip install torch==2.13.0 llmcompressor
      python scripts/bench_lowbit.py --peers .peers/bin/python
  It sees the same calibration windows (scripts/peers_gptq.py runs there and hands back the
  de-quantized weights, which the model here evaluates).
- DKM as it stands: `finetune` mode dkm from the dense model for --minutes.
Bits per weight count everything the decoder linears store: indices, codebooks, outliers, scales
and zero points. Writes outputs/lowbit/results.{json,md} after every row (rows already there are
kept) and prints the table. Our one-shot models are saved in outputs/lowbit/oneshot/ (delete it
after changing the method): a training row starts from its one-shot model there instead of
repeating the pass (7-16 minutes each).

With --layer-cost it instead times the one-shot pass of each of our rows on one decoder layer
shaped like LLaMA-7B's (hidden 4096, FFN 11008, 32 heads; random weights, tied 49152-token
embeddings so SmolLM2's tokenizer feeds it), on --tokens calibration tokens of wiki.train: the
pass is layer by layer, so 32 times that is the cost at 7B (outputs/lowbit/layer_cost.json).

Usage: python scripts/bench_lowbit.py [--rows LABEL ...] [--bits 2 3 4] [--windows 40] [--minutes 30]
                                      [--kd] [--norms] [--lr LR] [--outliers F] [--peers PYTHON] [--threads N]
       python scripts/bench_lowbit.py --layer-cost [--bits 2 3] [--tokens 8192]
       python scripts/bench_lowbit.py --dry-run   (DRY_ROWS at 2 bits on a toy model, 3 s of training: the suite runs it)
"""

from __future__ import annotations

import copy
import json
import re
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file, save_file

from _common import (REPO, compressed_copy, markdown, parse, parser, perplexities, toy_model, toy_sets,
                     write_results)
from wscompress.io import data, storage
from wscompress.io.checkpoints import builtin_dir, load_model
from wscompress.model.arch import discover
from wscompress.recipe.load import load_recipe
from wscompress.recovery.finetune import finetune

CONFIG = REPO / "configs" / "protocol.yaml"
TEXTS = ["builtin:wiki.test", "builtin:brown"]


def vectors(dim: int, b: int, o: float, **layout) -> list[dict]:
    """A vector-codebook stage at b bits a weight: dim weights share one of 2^(dim*b) centroids."""
    return [{"method": "kmeans", "bits": dim * b, "cluster_dim": dim, "outliers": o, **layout}]


# label -> (bits, outliers) -> the stages (None: not at these bits). Outliers kept aside by the
# vector rows unless --outliers says otherwise (0.1 % cost 0.048 bits per weight: fp16 value +
# int32 position); the budgets of the targets leave room for 0.5 % at 2 bits, 0.4 % at 3
OUTLIERS = {2: 0.0025, 3: 0.0015, 4: 0.001}
OURS: dict[str, Callable[[int, float], list[dict] | None]] = {
    "kmeans per channel (default)": lambda b, o: [{"method": "kmeans", "bits": b}],
    "kmeans 2-d vectors, a codebook per 64 channels": lambda b, o: vectors(2, b, o, granularity="grouped", group_size=64),
    "kmeans 4-d vectors, a codebook per matrix": lambda b, o: vectors(4, b, o, granularity="per_tensor") if b == 2 else None,
    # 4 bits: a third of the per-64 codebook cost (0.06 instead of 0.19 bits per weight) goes to outliers;
    # 192 divides every SmolLM2 projection (k/v have 192 rows)
    "kmeans 2-d vectors, a codebook per 192 channels": lambda b, o: vectors(2, b, o, granularity="grouped", group_size=192)
    if b == 4 else None,
    # 3-4 bits: rows normalised by their RMS share a codebook (16 bits a channel, paid for by fewer outliers:
    # --outliers 0.0007 at 4 bits, 0.0035 at 3)
    "kmeans 2-d vectors, a codebook per 64 channels and a scale per channel":
        lambda b, o: vectors(2, b, o, granularity="grouped", group_size=64, row_scale=True) if b in (3, 4) else None,
    # 2 bits: the 4-d codebook of a whole matrix on rows normalised by their RMS (0.023 bits a weight more)
    "kmeans 4-d vectors, a codebook per matrix and a scale per channel":
        lambda b, o: vectors(4, b, o, granularity="per_tensor", row_scale=True) if b == 2 else None,
}
# incoherence first (issue 78): every decoder linear's input turned by random Hadamard blocks of 64
# (methods/rotate.py), then the same layouts on the turned weights
ROTATE = {"method": "rotate", "block": 64}
OURS.update({f"rotated, {label}": lambda b, o, of=stages_of: None if (s := of(b, o)) is None else [ROTATE, *s]
             for label, stages_of in list(OURS.items())})
LR = 1e-4  # of the recovery rows; another one is named in the row's label
# groups per bits (input columns sharing a scale); SmolLM2's 576 columns rule out the common 128
RTN_GROUPS = {2: [32, 64], 3: [32, 64], 4: [64]}
GPTQ_GROUPS = {2: [32, 64], 3: [64], 4: [64]}
# the dry run's rows: the default one-shot and trained, rotated, a peer and DKM
DRY_ROWS = ["kmeans per channel (default)", "kmeans per channel (default) +", "rotated, kmeans per channel", "RTN g64",
            "DKM"]


def stored_bits(report: list[dict]) -> float:
    """Bits a weight of the quantizing stage (the last), with the rotations' signs, if a ``rotate``
    stage made any, counted over the same weights."""
    signs = sum(r.get("sign_bytes", 0) for r in report)
    return report[-1]["bits_per_weight"] + 8 * signs / report[-1]["weights"]


def rtn_(model: torch.nn.Module, bits: int, group: int) -> float:
    """Round every decoder linear's weight to nearest, in place, on a uniform asymmetric grid per
    ``group`` input columns; returns the bits per weight as stored (b + (16 + 8) / group)."""
    arch = discover(model)
    top = 2 ** bits - 1
    with torch.no_grad():
        for i in range(arch.num_layers):
            for name in arch.projections(i).values():
                w = model.get_submodule(name).weight
                g = w.view(w.shape[0], -1, group)
                lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
                scale = ((hi - lo) / top).clamp_min(1e-8).half().float()
                zero = (-lo / scale).round().clamp(0, 255)
                q = ((g / scale).round() + zero).clamp(0, top)
                w.copy_(((q - zero) * scale).view_as(w))
    return bits + 24 / group


def gptq_(model: torch.nn.Module, peers: str, bits: int, group: int, batches: list[torch.Tensor]) -> float:
    """GPTQ (llm-compressor, in the ``peers`` interpreter) on the same calibration windows; the
    de-quantized weights replace the model's. Bits per weight as compressed-tensors stores them."""
    with tempfile.TemporaryDirectory() as tmp:
        calib, out = Path(tmp) / "calibration.safetensors", Path(tmp) / "weights.safetensors"
        save_file({"input_ids": torch.cat(batches)}, calib)
        subprocess.run([peers, str(REPO / "scripts" / "peers_gptq.py"), str(builtin_dir("smollm2-135m-instruct")),
                        str(calib), str(out), "--bits", str(bits), "--group", str(group)], check=True)
        weights = load_file(out)
    with torch.no_grad():
        for name, w in weights.items():
            model.get_submodule(name).weight.copy_(w)
    return bits + 24 / group


def layer_cost(args, recipe, tok, out: Path) -> None:
    """Seconds of each of our one-shot rows on one LLaMA-7B-shaped decoder layer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=1, num_attention_heads=32,
                         num_key_value_heads=32, vocab_size=len(tok), tie_word_embeddings=True)
    torch.manual_seed(0)
    layer = LlamaForCausalLM(config).eval()
    run = recipe.model_copy()
    run.calibration = recipe.calibration.model_copy(update={"num_samples": args.tokens // 512})
    rows = []
    for b in args.bits:
        for label, stages_of in OURS.items():
            if (stages := stages_of(b, OUTLIERS[b])) is None or args.rows and not any(label.startswith(r) for r in args.rows):
                continue
            _, report, seconds = compressed_copy(layer, tok, run, stages)
            rows.append({"method": label, "bits": b, "bits_per_weight": round(stored_bits(report), 3),
                         "tokens": args.tokens, "s per 7B layer": round(seconds, 1), "min at 7B (32 layers)": round(32 * seconds / 60, 1)})
            print(rows[-1], flush=True)
    write_results(out, {"threads": torch.get_num_threads(), "rows": rows}, markdown(rows), stem="layer_cost")
    print(markdown(rows))


def main() -> None:
    ap = parser(__doc__, out="lowbit", threads=None)
    ap.add_argument("--rows", nargs="+", default=None, help="labels (or their first words; a training row only with "
                    "its '+') of the rows to run")
    ap.add_argument("--bits", type=int, nargs="+", default=[2, 3, 4])
    ap.add_argument("--windows", type=int, default=40)
    ap.add_argument("--minutes", type=float, default=30.0, help="training budget of the recovery and DKM rows")
    ap.add_argument("--lr", type=float, default=LR, help="learning rate of the recovery rows (codebooks)")
    ap.add_argument("--kd", action="store_true", help="recovery rows distil from the dense model (KL on the "
                    "next-token distributions) instead of training on the LM loss")
    ap.add_argument("--norms", action="store_true", help="recovery rows train the normalisation gains too")
    ap.add_argument("--outliers", type=float, default=None, help="fraction of weights the vector rows keep aside "
                    "(default: OUTLIERS, per bits); named in the row's label")
    ap.add_argument("--peers", default=None, help="a Python with llmcompressor (GPTQ rows; skipped without)")
    ap.add_argument("--layer-cost", action="store_true", help="time our one-shot rows on one LLaMA-7B-shaped layer")
    ap.add_argument("--tokens", type=int, default=8192, help="--layer-cost: calibration tokens (windows of 512)")
    ap.add_argument("--dry-run", action="store_true", help="DRY_ROWS at 2 bits on a toy model, 3 seconds of training, "
                    "one window a text: checks the script in a minute")
    args = parse(ap)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    sets = toy_sets(toy_model(out / "toy")) if args.dry_run else []
    if args.dry_run:
        args.rows, args.bits, args.windows, args.minutes = DRY_ROWS, [2], 1, 0.05
    recipe = load_recipe(CONFIG, [f"output.dir={out}", *sets])
    original, tok = load_model(recipe.model)
    if args.layer_cost:
        return layer_cost(args, recipe, tok, out)
    cal = recipe.calibration
    batches = data.calibration_batches(tok, cal.dataset, cal.num_samples, cal.seq_len, cal.batch_size, cal.seed,
                                       cal.bos, cal.sampling)

    def scores(model) -> dict[str, float]:
        return perplexities(model, tok, TEXTS, args.windows, recipe.eval.bos)

    def train(model, mode: str, bits: int | None = None) -> tuple[torch.nn.Module, dict]:
        kd = args.kd and mode == "method"
        ft = load_recipe(data={
            "finetune": {"mode": mode, "dataset": cal.dataset, "seq_len": 256, "batch_size": 4, "steps": 100_000,
                         "max_minutes": args.minutes, "lr": args.lr, "warmup_steps": 10, "eval_windows": 4,
                         **({"dkm": {"bits": bits}} if mode == "dkm" else {}),
                         **({"distill": {"kl": 1.0}} if kd else {}),
                         **({"norms": True} if args.norms and mode == "method" else {})},
            "eval": {"perplexity": [TEXTS[0]]}, "output": {"dir": str(out / "ft")}})
        return finetune(model, tok, ft, teacher=original if kd else None)

    def one_shot(stages: list[dict]) -> tuple[torch.nn.Module, dict]:
        model, report, seconds = compressed_copy(original, tok, recipe, stages)
        return model, {"bits_per_weight": round(stored_bits(report), 3), "compress_s": round(seconds, 1)}

    def cached(label: str, b: int, stages: list[dict]) -> tuple[torch.nn.Module, dict]:
        path = out / "oneshot" / (f"{b}-" + re.sub(r"[^\w.]+", "-", label))
        if (path / "row.json").is_file():
            return storage.load(path)[0], json.loads((path / "row.json").read_text())
        model, row = one_shot(stages)
        storage.save(model, tok, path)
        (path / "row.json").write_text(json.dumps(row))
        return model, row

    def peer(quantize: Callable[[torch.nn.Module], float]) -> tuple[torch.nn.Module, dict]:
        model = copy.deepcopy(original)
        start = time.perf_counter()
        bpw = quantize(model)
        return model, {"bits_per_weight": round(bpw, 3), "compress_s": round(time.perf_counter() - start, 1)}

    def trained(stages: list[dict]) -> str:
        """A training row's label suffix: what trains (earlier rows in results.json: codebooks alone)."""
        what = "codebooks, scales and outliers" if any(s.get("row_scale") for s in stages) else "codebooks and outliers"
        return (f" + {args.minutes:g} min training ({what}{' + norms' if args.norms else ''}"
                f"{', KD' if args.kd else ''}{'' if args.lr == LR else f', lr {args.lr:g}'})")

    runs: list[tuple[str, int, Callable[[], tuple[torch.nn.Module, dict]], bool]] = []  # (label, bits, make, train)
    for b in args.bits:
        share = OUTLIERS[b] if args.outliers is None else args.outliers
        for label, stages_of in OURS.items():
            if label != "kmeans per channel (default)" and share != OUTLIERS[b]:  # that row keeps kmeans' default
                label += f", {100 * share:g} % outliers"
            if (stages := stages_of(b, share)) is not None:
                runs += [(label + trained(stages) * train, b, lambda label=label, b=b, s=stages: cached(label, b, s), train)
                         for train in (False, True)]
        runs += [(f"RTN g{g}", b, lambda b=b, g=g: peer(lambda m: rtn_(m, b, g)), False) for g in RTN_GROUPS.get(b, [64])]
        if args.peers:
            runs += [(f"GPTQ g{g} (llm-compressor)", b, lambda b=b, g=g: peer(lambda m: gptq_(m, args.peers, b, g, batches)),
                      False) for g in GPTQ_GROUPS.get(b, [64])]
        runs.append((f"DKM as it stands ({args.minutes:g} min from dense)", b, lambda: (copy.deepcopy(original), {}), False))

    done = out / "results.json"
    rows = json.loads(done.read_text())["rows"] if done.is_file() else [{"method": "dense", **scores(original)}]
    dense = rows[0]
    cols = ["method", "bits", "bits_per_weight", "wiki.test", "wiki.test x", "brown", "brown x", "compress_s", "train_s", "steps"]

    def table() -> str:
        return (f"{Path(recipe.model.path).name}, protocol calibration, {args.windows} windows of 512 tokens per text, "
                f"{torch.get_num_threads()} threads\n\n" + markdown(rows, cols))

    def wanted(label: str) -> bool:  # a training row only where asked for ("+" in the given words)
        return args.rows is None or any(label.startswith(r) and ("+" in r or " + " not in label) for r in args.rows)

    for label, b, make, training in runs:
        if not wanted(label) or any(r["method"] == label and r.get("bits") == b for r in rows):
            continue
        start = time.perf_counter()
        model, row = make()
        if label.startswith("DKM"):
            model, report = train(model, "dkm", b)
            row = {"bits_per_weight": round(report["dkm"]["bits_per_weight"], 3), "train_s": round(time.perf_counter() - start),
                   "steps": report["steps"]}
        elif training:
            model, report = train(model, "method")
            row = {**row, "train_s": report["history"][-1]["seconds"], "steps": report["steps"]}
        ppl = scores(model)
        rows.append({"method": label, "bits": b, **row, **ppl, **{f"{t} x": round(ppl[t] / dense[t], 3) for t in ppl}})
        print(rows[-1], flush=True)
        write_results(out, {"rows": rows}, table())  # after every row: an interrupted run keeps what it measured
        del model
    write_results(out, {"rows": rows}, table())
    print(table())


if __name__ == "__main__":
    main()
