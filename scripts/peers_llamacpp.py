"""llama.cpp beside wscompress on the same model, tokens, threads and machine, in one run.

llama.cpp runs through node-llama-cpp (pinned to 3.21.1: its npm package ships a prebuilt CPU
binary, so nothing is built here), installed on first use into ``<out>/node`` with npm. Its
GGUF files are made from the builtin model's source GGUF (the Q4_1 file SmolLM2 ships as) with
gguf-py's reference quantizers: every 2-D weight de-quantized and quantized again to Q4_0, Q8_0
or F16 ("pure": no K-quant mix, 1-D tensors in F32), written into ``<out>``. wscompress's models
are built as in ``bench_runtime.py`` (the layouts with random values: the speed does not depend
on them) and decode eagerly and compiled (``StaticDecoder(compile=True)``).

Every engine decodes 16 tokens greedily after a 32-token prompt at batch 1 and prefills 128
tokens, at each thread count; the best of ``--rounds`` rounds (engines one after the other). The table
gives tokens/s and the ratio to llama.cpp's Q4_0 in the same run, with the CPU's vector flags.
This is a benchmark dependency only: neither the package nor its tests need npm or llama.cpp.

Writes outputs/peers_llamacpp/results.{json,md} and prints the table.
Usage: python scripts/peers_llamacpp.py [--threads 1 2] [--rounds 5] [--models dense "configs/kmeans_4bit.yaml layout + tied embedding/head" ...]
"""

from __future__ import annotations

import argparse
import copy
import json
import subprocess
import time
from pathlib import Path

import numpy as np
import torch

from bench_runtime import MODELS, RECIPES, build, markdown, timings
from wscompress.evaluation.decode import StaticDecoder
from wscompress.io import storage
from wscompress.io.checkpoints import builtin_dir, load_model
from wscompress.io.hardware import cpu_flags
from wscompress.recipe.load import load_recipe

REPO = Path(__file__).resolve().parents[1]
NODE_LLAMA_CPP = "node-llama-cpp@3.21.1"
QUANTS = ("Q4_0", "Q8_0", "F16")
PROMPT, DECODE, PREFILL = 32, 16, 128

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
console.log(JSON.stringify({decode, prefill: fill, file_mb: fs.statSync(modelPath).size / 2 ** 20}));
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
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.rename(target)
    return target


def node_runner(out: Path) -> Path:
    """node-llama-cpp installed into ``out/node`` (once) and the timing script beside it."""
    folder = out / "node"
    if not (folder / "node_modules" / "node-llama-cpp").is_dir():
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "package.json").write_text(json.dumps({"name": "peers", "private": True, "type": "module"}))
        subprocess.run(["npm", "install", "--no-audit", "--no-fund", NODE_LLAMA_CPP], cwd=folder, check=True)
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
    default = ["dense", RECIPES["configs/kmeans_4bit.yaml"], *(f"{r} layout + float16 tied embedding/head" for r in RECIPES),
               "configs/kmeans_4bit.yaml layout + 8-bit tied embedding/head"]
    ap.add_argument("--models", nargs="+", default=default, choices=list(MODELS))
    ap.add_argument("--quants", nargs="+", default=list(QUANTS), choices=QUANTS)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=Path, default=REPO / "outputs" / "peers_llamacpp")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    source = next(builtin_dir("smollm2-135m-instruct").glob("*.gguf"))
    ggufs = {q: quantized_gguf(source, q, args.out) for q in args.quants}
    script = node_runner(args.out)

    recipe = load_recipe(data={"model": {"path": "builtin:smollm2-135m-instruct", "device": "cpu"}})
    original, tok = load_model(recipe.model)
    gen = torch.Generator().manual_seed(1)
    prompt_ids = torch.randint(1000, 20000, (1, PROMPT), generator=gen)
    prefill_ids = torch.randint(1000, 20000, (PREFILL,), generator=gen).tolist()
    models = {}
    for label in args.models:
        model = copy.deepcopy(original)
        build(model, tok, recipe, MODELS[label])
        models[label] = model.eval()
    del original

    decoders = {label: StaticDecoder(m, prompt_ids, DECODE, compile=True) for label, m in models.items()}  # compiled once
    rows = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        results = {}
        for q, path in ggufs.items():
            r = llama_cpp(script, path, threads, args.rounds, prompt_ids[0].tolist(), prefill_ids)
            results[f"llama.cpp {q}"] = {"MB": r["file_mb"], "decode": r["decode"], "prefill": r["prefill"]}
        for label, model in models.items():
            r = wscompress_times(model, args.rounds, prompt_ids, decoders[label])
            results[f"wscompress {label}"] = {"MB": storage.resident_bytes(model) / 2**20, "decode": r["decode"],
                                             "compiled": r["compiled"], "prefill": r["prefill"]}
        base = results.get("llama.cpp Q4_0")
        for label, r in results.items():
            row = {"threads": threads, "engine, model": label, "weight MB": round(r["MB"], 1),
                   "decode tok/s": round(DECODE / r["decode"], 1), "prefill tok/s": round(PREFILL / r["prefill"], 1)}
            if "compiled" in r:
                row["compiled decode tok/s"] = round(DECODE / r["compiled"], 1)
            if base:
                fastest = min(r["decode"], r.get("compiled", float("inf")))
                row["decode x Q4_0"] = round(base["decode"] / fastest, 2)
                row["prefill x Q4_0"] = round(base["prefill"] / r["prefill"], 2)
            rows.append(row)
            print(row, flush=True)
    flags = " ".join(sorted(f for f in cpu_flags() if f.startswith(("avx", "fma", "f16c"))))
    cols = ["threads", "engine, model", "weight MB", "decode tok/s", "compiled decode tok/s", "decode x Q4_0",
            "prefill tok/s", "prefill x Q4_0"]
    md = (f"SmolLM2-135M-Instruct, batch 1: {DECODE} tokens decoded greedily after a {PROMPT}-token prompt, prefill of "
          f"{PREFILL} tokens; best of {args.rounds} rounds, engines one after the other; llama.cpp through {NODE_LLAMA_CPP} "
          f"(prebuilt CPU binary), GGUF made from {source.name} by gguf-py; CPU flags: {flags}. `decode x Q4_0` takes "
          "wscompress's faster path (eager or compiled).\n\n" + markdown(rows, cols))
    (args.out / "results.json").write_text(json.dumps({"rows": rows, "flags": flags}, indent=1))
    (args.out / "results.md").write_text(md + "\n")
    print(md)


if __name__ == "__main__":
    main()
