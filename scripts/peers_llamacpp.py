"""llama.cpp beside wscompress on the same model, tokens, threads and machine, in one run.

llama.cpp runs through node-llama-cpp (pinned to 3.21.1: its npm package ships a prebuilt CPU
binary, so nothing is built here), installed on first use into ``<out>/node`` with npm. Two
shapes (``--shape``), both llama with SmolLM2's vocabulary (49152) and tied embedding/head:

- ``smollm2`` (default): SmolLM2-135M-Instruct's real weights. llama.cpp's GGUF files are made
  from the builtin model's source GGUF (the Q4_1 file SmolLM2 ships as) with gguf-py's reference
  quantizers: every 2-D weight de-quantized and quantized again to Q4_0, Q8_0 or F16 ("pure": no
  K-quant mix, 1-D tensors in F32).
- ``tinyllama``: TinyLlama-1.1B's shape (hidden 2048, FFN 5632, 22 layers, 32 heads, 4 KV heads
  of 64) with random weights on both sides, where bytes per token, not per-call costs, set the
  speed: GGUF files written by gguf-py with random blocks of the type (the tied table Q8_0 in the
  Q4_0 file, as llama.cpp's quantizer makes it) and the source GGUF's tokenizer keys, and a
  float32 ``LlamaConfig`` model for wscompress.

wscompress's models are built as in ``bench_runtime.py`` (the layouts with random values: the
speed does not depend on them) and decode eagerly and compiled (``StaticDecoder(compile=True)``).
GGUF files are written into ``<out>`` and reused when there.

Every engine decodes 16 tokens greedily after a 32-token prompt at batch 1 and prefills 128
tokens (with its cache and no logits but the last position's, as generate() and llama.cpp
evaluate a prompt), at each thread count; the best of ``--rounds`` rounds (engines one after the other). The table
gives tokens/s, the ratio to llama.cpp's Q4_0 in the same run and decode GB/s (bytes read per
token: wscompress's resident bytes, llama.cpp's file, times tokens/s), with the CPU's model and
vector flags and the CPU backend llama.cpp loaded (read from its process's mapped libraries: its
prebuilt library loads the best variant the CPU runs, sapphirerapids where AMX shows). This is a
benchmark dependency only: neither the package nor its tests need npm or llama.cpp.

``--dry-run`` checks the script in seconds without npm or llama.cpp: the chosen shape at toy size
(2 layers, hidden 128, random weights, vocabulary kept), every GGUF file written, every
wscompress model built and timed once on one thread (the static-cache step not compiled).

With ``WSCOMPRESS_MARCH`` set (e.g. ``haswell``: AVX2 only), wscompress's kernels are built for
that CPU and llama.cpp runs its CPU backend built for the same one, so an AVX-512 machine times
both engines' AVX2 paths.

Writes outputs/peers_llamacpp/results-<shape>[-<march>].{json,md} and prints the table.
Usage: python scripts/peers_llamacpp.py [--shape smollm2|tinyllama] [--threads 1 2] [--rounds 5] [--dry-run]
           [--models dense "configs/kmeans_4bit.yaml layout + int8 tied embedding/head" ...]
"""

from __future__ import annotations

import argparse
import copy
import functools
import hashlib
import json
import os
import subprocess
import time
from pathlib import Path

import numpy as np
import torch

from _common import REPO, cpu_line, markdown, write_results
from bench_runtime import MODELS, RECIPES, build, timings
from wscompress.evaluation.decode import StaticDecoder
from wscompress.io import storage
from wscompress.io.checkpoints import builtin_dir, load_model
from wscompress.recipe.load import load_recipe

NODE_LLAMA_CPP = "node-llama-cpp@3.21.1"
QUANTS = ("Q4_0", "Q8_0", "F16")
PROMPT, DECODE, PREFILL = 32, 16, 128
SHAPES = {  # llama shapes with SmolLM2's vocabulary and tied embedding/head
    "smollm2": {"title": "SmolLM2-135M-Instruct", "hidden": 576, "ffn": 1536, "layers": 30, "heads": 9, "kv_heads": 3,
                "head_dim": 64, "vocab": 49152, "eps": 1e-5, "theta": 100000.0, "context": 8192},
    "tinyllama": {"title": "TinyLlama-1.1B's shape (hidden 2048, FFN 5632, 22 layers, 32 heads, 4 KV heads) with random "
                  "weights, SmolLM2's vocabulary and tied embedding/head", "hidden": 2048, "ffn": 5632, "layers": 22,
                  "heads": 32, "kv_heads": 4, "head_dim": 64, "vocab": 49152, "eps": 1e-5, "theta": 10000.0, "context": 2048}}
TINY = {"hidden": 128, "ffn": 256, "layers": 2, "heads": 4, "kv_heads": 2, "head_dim": 32}  # --dry-run's toy size of a shape

# Times one GGUF file with llama.cpp: argv = model, threads, rounds, prompt ids, prefill ids (JSON);
# prints {"decode": s, "prefill": s, "file_mb": MB}, each the best of the rounds.
NODE_SCRIPT = r"""
import {getLlama} from "node-llama-cpp";
import fs from "node:fs";
const [modelPath, threads, rounds, promptJson, prefillJson] = process.argv.slice(2);
const prompt = JSON.parse(promptJson), prefill = JSON.parse(prefillJson), n = Number(threads);
const llama = await getLlama({gpu: false, build: "never", maxThreads: n, logLevel: "error"});
const model = await llama.loadModel({modelPath, gpuLayers: 0});
const context = await model.createContext({contextSize: 512, batchSize: 512, threads: {ideal: n, min: n}});
const sequence = context.getSequence();
let decode = Infinity, fill = Infinity;
for (let r = 0; r <= Number(rounds); r++) {  // round 0 warms up
  await sequence.clearHistory();
  let start = performance.now();
  await sequence.evaluateWithoutGeneratingNewTokens(prefill);
  const p = (performance.now() - start) / 1000;
  await sequence.clearHistory();
  await sequence.evaluateWithoutGeneratingNewTokens(prompt.slice(0, -1));
  let count = 0;
  start = performance.now();
  for await (const token of sequence.evaluate(prompt.slice(-1), {temperature: 0})) {  // a forward pass per token
    if (++count >= DECODE) break;
  }
  const d = (performance.now() - start) / 1000;
  if (r) { decode = Math.min(decode, d); fill = Math.min(fill, p); }
}
// the CPU backend llama.cpp chose for this CPU (its prebuilt library loads the best of its variants)
const loaded = fs.readFileSync("/proc/self/maps", "utf8").match(/libggml-cpu-([\w-]+)\.so/);
console.log(JSON.stringify({decode, prefill: fill, file_mb: fs.statSync(modelPath).size / 2 ** 20,
                            backend: loaded ? loaded[1] : "unknown"}));
await context.dispose(); await model.dispose(); await llama.dispose();
""".replace("DECODE", str(DECODE))


def quantized_gguf(source: Path, qtype: str, out: Path) -> Path:
    """``source`` with every 2-D weight re-quantized to ``qtype`` by gguf-py's reference quantizers."""
    import gguf

    target = out / f"{source.stem.rsplit('.', 1)[0]}.{qtype}.gguf"
    if target.is_file():
        return target
    kind = gguf.GGMLQuantizationType[qtype]
    reader = gguf.GGUFReader(source)
    arch = reader.fields["general.architecture"].contents()
    tmp = target.with_suffix(".tmp")
    writer = gguf.GGUFWriter(tmp, arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.file_type"):
            continue
        writer.add_key_value(key, field.contents(), field.types[0], sub_type=field.types[-1] if len(field.types) > 1 else None)
    writer.add_file_type({"Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0, "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
                          "F16": gguf.LlamaFileType.MOSTLY_F16}[qtype])
    for tensor in reader.tensors:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        if values.ndim < 2:
            writer.add_tensor(tensor.name, values)
        elif qtype == "F16":
            writer.add_tensor(tensor.name, values.astype(np.float16))
        else:
            writer.add_tensor(tensor.name, gguf.quants.quantize(values, kind), raw_dtype=kind)
    return _finish(writer, tmp, target)


def _finish(writer, tmp: Path, target: Path) -> Path:
    """Write out ``writer``'s file at ``tmp`` and move it to ``target`` whole."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.rename(target)
    return target


@functools.cache
def source_keys(source: Path) -> dict:
    """``source``'s keys (but GGUF's own) as {key: (value, type, array item type)}: parsed once, the
    tokenizer's 100 000 strings take seconds."""
    import gguf

    return {key: (field.contents(), field.types[0], field.types[-1] if len(field.types) > 1 else None)
            for key, field in gguf.GGUFReader(source).fields.items() if not key.startswith("GGUF.")}


def random_gguf(source: Path, shape: dict, qtype: str, out: Path) -> Path:
    """A llama GGUF of ``shape`` with random weights, 2-D ones in ``qtype`` (the tied table Q8_0 in a
    Q4_0 file, as llama.cpp's quantizer makes it; norms F32 ones), with ``source``'s tokenizer and
    general keys: llama.cpp's side of a model whose weights are not there (speed does not depend on them)."""
    import gguf

    s, kind = shape, gguf.GGMLQuantizationType[qtype]
    tag = hashlib.sha1(json.dumps(s, sort_keys=True).encode()).hexdigest()[:8]  # any other key (theta, ...) too
    target = out / f"random-llama-{s['layers']}x{s['hidden']}-ffn{s['ffn']}-{s['heads']}h{s['kv_heads']}kv-{tag}.{qtype}.gguf"
    if target.is_file():
        return target
    keys = source_keys(source)
    assert len(keys["tokenizer.ggml.tokens"][0]) == s["vocab"], "the tokenizer must fit the shape"
    tmp = target.with_suffix(".tmp")
    writer = gguf.GGUFWriter(tmp, "llama", use_temp_file=True)  # tensors spill to disk as added (2 GB of F16 at 1.1B)
    for key, (value, vtype, sub_type) in keys.items():  # the shape keys (llama.*) and the file's type and name are set below
        if key.startswith("llama.") or key in ("general.architecture", "general.file_type", "general.name",
                                               "general.size_label"):
            continue
        writer.add_key_value(key, value, vtype, sub_type=sub_type)
    writer.add_name(target.stem)
    writer.add_file_type({"Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0, "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
                          "F16": gguf.LlamaFileType.MOSTLY_F16}[qtype])
    writer.add_vocab_size(s["vocab"])
    writer.add_context_length(s["context"])
    writer.add_embedding_length(s["hidden"])
    writer.add_block_count(s["layers"])
    writer.add_feed_forward_length(s["ffn"])
    writer.add_head_count(s["heads"])
    writer.add_head_count_kv(s["kv_heads"])
    writer.add_rope_dimension_count(s["head_dim"])
    writer.add_layer_norm_rms_eps(s["eps"])
    writer.add_rope_freq_base(s["theta"])
    rng = np.random.default_rng(0)

    def weight(name: str, rows: int, cols: int, kind: gguf.GGMLQuantizationType) -> None:
        if kind == gguf.GGMLQuantizationType.F16:
            writer.add_tensor(name, (rng.standard_normal((rows, cols), np.float32) * 0.02).astype(np.float16))
            return
        block, size = gguf.GGML_QUANT_SIZES[kind]  # a block: float16 scale, then the block's packed values
        raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
        scale = 0.02 / {gguf.GGMLQuantizationType.Q4_0: 8, gguf.GGMLQuantizationType.Q8_0: 128}[kind]
        raw[..., :2] = np.frombuffer(np.float16(scale).tobytes(), np.uint8)  # finite: weights within +-0.02, no NaN
        writer.add_tensor(name, raw.reshape(rows, -1), raw_dtype=kind)  # byte shape: gguf-py derives the logical one

    h, q, kv = s["hidden"], s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]
    weight("token_embd.weight", s["vocab"], h, kind if qtype == "F16" else gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("output_norm.weight", np.ones(h, np.float32))  # no output.weight: tied to token_embd
    for i in range(s["layers"]):
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{i}.{norm}.weight", np.ones(h, np.float32))
        for name, (rows, cols) in {"attn_q": (q, h), "attn_k": (kv, h), "attn_v": (kv, h), "attn_output": (h, q),
                                   "ffn_gate": (s["ffn"], h), "ffn_up": (s["ffn"], h), "ffn_down": (h, s["ffn"])}.items():
            weight(f"blk.{i}.{name}.weight", rows, cols, kind)  # (out, in): GGUF lists the shape reversed
    return _finish(writer, tmp, target)


@torch.no_grad()
def random_model(shape: dict):
    """A float32 transformers llama of ``shape`` (tied embedding/head) with random weights, made
    without transformers' initialization: one pass over the weights (4.4 GB at 1.1B parameters)."""
    from transformers import AutoModelForCausalLM, LlamaConfig
    from transformers.initialization import no_init_weights

    s = shape
    config = LlamaConfig(vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["ffn"],
                         num_hidden_layers=s["layers"], num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"],
                         head_dim=s["head_dim"], rms_norm_eps=s["eps"], rope_theta=s["theta"],
                         max_position_embeddings=s["context"], tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    with no_init_weights():  # uninitialized storage, filled once below
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.tie_weights()  # skipped with the initialization
    gen = torch.Generator().manual_seed(0)
    for p in model.parameters():  # finite values (uninitialized memory may hold NaN or denormals, which are slow)
        p.fill_(1.0) if p.ndim == 1 else p.normal_(0, 0.02, generator=gen)
    return model.eval()


def node_runner(out: Path, march: str = "native") -> Path:
    """node-llama-cpp installed into ``out/node`` (once) and the timing script beside it. For
    another ``march`` than this CPU's (``WSCOMPRESS_MARCH``, which wscompress's kernels are then
    built for), a copy in ``out/node-<march>`` of hard links to that install, holding only
    llama.cpp's CPU backend built for that CPU (it otherwise loads the best one this CPU runs),
    so that both engines run the same instruction set."""
    folder = out / "node"
    if not (folder / "node_modules" / "node-llama-cpp").is_dir():
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "package.json").write_text(json.dumps({"name": "peers", "private": True, "type": "module"}))
        subprocess.run(["npm", "install", "--no-audit", "--no-fund", NODE_LLAMA_CPP], cwd=folder, check=True)
    if march != "native":
        base, folder = folder, out / f"node-{march}"
        if not (folder / "node_modules").is_dir():
            folder.mkdir(parents=True, exist_ok=True)
            subprocess.run(["cp", "-al", str(base / "node_modules"), str(folder)], check=True)  # links, no copies
            (folder / "package.json").write_text((base / "package.json").read_text())
            variants = list(folder.glob("node_modules/@node-llama-cpp/linux-x64/bins/*/libggml-cpu-*.so"))
            if not any(v.name == f"libggml-cpu-{march}.so" for v in variants):
                raise SystemExit(f"llama.cpp has no CPU backend built for {march!r}: "
                                 f"{sorted(v.name for v in variants)}")
            for v in variants:
                if v.name != f"libggml-cpu-{march}.so":
                    v.unlink()  # a link in the copy: the install itself keeps every variant
    (folder / "time.mjs").write_text(NODE_SCRIPT)
    return folder / "time.mjs"


def llama_cpp(script: Path, gguf_file: Path, threads: int, rounds: int, prompt: list[int], prefill: list[int]) -> dict:
    done = subprocess.run(["node", str(script), str(gguf_file), str(threads), str(rounds), json.dumps(prompt),
                           json.dumps(prefill)], cwd=script.parent, capture_output=True, text=True, timeout=1800)
    if done.returncode:
        raise SystemExit(f"node-llama-cpp failed on {gguf_file.name}: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


@torch.no_grad()
def wscompress_times(model, rounds: int, prompt: torch.Tensor, decoder: StaticDecoder) -> dict:
    """Best eager decode and prefill, and best compiled decode, over ``rounds`` (after one warm-up)."""
    best = {"decode": float("inf"), "prefill": float("inf"), "compiled": float("inf")}
    for r in range(rounds + 1):
        t = timings(model, 1, PREFILL, DECODE)
        decoder.reset()
        start = time.perf_counter()
        for _ in range(DECODE):
            decoder.step()
        t["compiled"] = time.perf_counter() - start
        if r:
            best = {k: min(best[k], t[k]) for k in best}
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    default = ["dense", RECIPES["configs/kmeans_4bit.yaml"], *(f"{r} layout + int8 tied embedding/head" for r in RECIPES),
               "configs/kmeans_4bit.yaml layout + float16 tied embedding/head"]
    ap.add_argument("--models", nargs="+", default=default, choices=list(MODELS))
    ap.add_argument("--quants", nargs="+", default=list(QUANTS), choices=QUANTS)
    ap.add_argument("--shape", default="smollm2", choices=list(SHAPES),
                    help="smollm2: its real weights; tinyllama: TinyLlama-1.1B's shape, random weights")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dry-run", action="store_true", help="the shape at toy size, wscompress timed once on one "
                    "thread, no npm or llama.cpp: checks the script in seconds")
    ap.add_argument("--out", type=Path, default=REPO / "outputs" / "peers_llamacpp")
    args = ap.parse_args()
    if args.dry_run:
        args.threads, args.rounds = [1], 1
    shape = {**SHAPES[args.shape], **(TINY if args.dry_run else {})}
    real = args.shape == "smollm2" and not args.dry_run  # SmolLM2's own weights; otherwise random ones of the shape
    args.out.mkdir(parents=True, exist_ok=True)
    source = next(builtin_dir("smollm2-135m-instruct").glob("*.gguf"))
    ggufs = {q: quantized_gguf(source, q, args.out) if real else random_gguf(source, shape, q, args.out)
             for q in args.quants}
    march = os.environ.get("WSCOMPRESS_MARCH", "native")  # the kernels' CPU: llama.cpp runs the same
    script = None if args.dry_run else node_runner(args.out, march)

    recipe = load_recipe(data={"model": {"path": "builtin:smollm2-135m-instruct", "device": "cpu"}})
    original, tok = load_model(recipe.model)  # the tokenizer serves every shape (SmolLM2's vocabulary)
    if not real:
        original = None
    gen = torch.Generator().manual_seed(1)
    prompt_ids = torch.randint(1000, 20000, (1, PROMPT), generator=gen)
    prefill_ids = torch.randint(1000, 20000, (PREFILL,), generator=gen).tolist()
    models = {}
    for label in args.models:  # random models made one by one, not copied: one 4.4 GB original less held at 1.1B
        model = copy.deepcopy(original) if real else random_model(shape)
        build(model, tok, recipe, MODELS[label])
        models[label] = model.eval()
    del original

    # compiled once (the dry run keeps the static-cache step eager: compiling takes about a minute a model)
    decoders = {label: StaticDecoder(m, prompt_ids, DECODE, compile=not args.dry_run) for label, m in models.items()}
    rows, backends = [], set()
    for threads in args.threads:
        torch.set_num_threads(threads)
        results = {}
        for q, path in ggufs.items() if script else ():
            r = llama_cpp(script, path, threads, args.rounds, prompt_ids[0].tolist(), prefill_ids)
            results[f"llama.cpp {q}"] = {"MB": r["file_mb"], "decode": r["decode"], "prefill": r["prefill"]}
            backends.add(r["backend"])
        for label, model in models.items():
            r = wscompress_times(model, args.rounds, prompt_ids, decoders[label])
            results[f"wscompress {label}"] = {"MB": storage.resident_bytes(model) / 2**20, "decode": r["decode"],
                                             "compiled": r["compiled"], "prefill": r["prefill"]}
        base = results.get("llama.cpp Q4_0")
        for label, r in results.items():
            fastest = min(r["decode"], r.get("compiled", float("inf")))
            row = {"threads": threads, "engine, model": label, "weight MB": round(r["MB"], 1),
                   "decode tok/s": round(DECODE / r["decode"], 1), "prefill tok/s": round(PREFILL / r["prefill"], 1),
                   "decode GB/s": round(r["MB"] * 2**20 / 1e9 * DECODE / fastest, 1)}  # every weight byte read per token
            if "compiled" in r:
                row["compiled decode tok/s"] = round(DECODE / r["compiled"], 1)
            if base:
                row["decode x Q4_0"] = round(base["decode"] / fastest, 2)
                row["prefill x Q4_0"] = round(base["prefill"] / r["prefill"], 2)
            rows.append(row)
            print(row, flush=True)
    cpu = cpu_line() + ("" if march == "native" else f"; both engines built for -march={march} "
                                                     f"(WSCOMPRESS_MARCH, llama.cpp's {march} CPU backend)")
    if backends:  # read from the node process's mapped libraries: the variant llama.cpp chose (or was pinned to)
        cpu += f"; llama.cpp loaded its {', '.join(sorted(backends))} CPU backend"
    cols = ["threads", "engine, model", "weight MB", "decode tok/s", "compiled decode tok/s", "decode GB/s",
            "decode x Q4_0", "prefill tok/s", "prefill x Q4_0"]
    made = f"made from {source.name}" if real else f"with random weights and {source.name}'s tokenizer"
    title = shape["title"] if not args.dry_run else (f"Dry run (no llama.cpp) at toy size ({shape['layers']} layers, "
                                                     f"hidden {shape['hidden']}) of {shape['title']}")
    md = (f"{title}, batch 1: {DECODE} tokens decoded greedily after a {PROMPT}-token prompt, prefill of "
          f"{PREFILL} tokens; best of {args.rounds} rounds, engines one after the other; llama.cpp through {NODE_LLAMA_CPP} "
          f"(prebuilt CPU binary), GGUF {made} by gguf-py; CPU: {cpu}. `decode x Q4_0` and "
          "`decode GB/s` (weight bytes, wscompress's resident ones and llama.cpp's file, times decode tokens/s) take "
          "wscompress's faster path (eager or compiled).\n\n" + markdown(rows, cols))
    write_results(args.out, {"shape": args.shape, "dry_run": args.dry_run, "rows": rows, "cpu": cpu}, md,
                  stem=f"results-{args.shape}" + ("" if march == "native" else f"-{march}"))
    print(md)


if __name__ == "__main__":
    main()
