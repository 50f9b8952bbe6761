"""scripts/peers_llamacpp.py runs its dry run at TinyLlama's shape: the GGUF files llama.cpp would
time are written with the shape's keys, tensor shapes and types, and wscompress's models are built
and timed, without npm or llama.cpp (the benchmark itself needs them)."""

import json

import pytest
from bench_scripts import run_script

gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.scripts

HIDDEN, FFN, LAYERS, HEADS, KV, HEAD_DIM = 128, 256, 2, 4, 2, 32  # the dry run's toy size (peers_llamacpp.TINY)


def test_peers_llamacpp_dry_run_tinyllama(tmp_path):
    # two of the models (every layout's building is the benchmark runtime's own, tested there): the suite's time
    models = ["dense", "configs/kmeans_4bit.yaml layout + int8 tied embedding/head"]
    run_script("peers_llamacpp.py", "--shape", "tinyllama", "--dry-run", "--out", str(tmp_path), "--models", *models)
    results = json.loads((tmp_path / "results-tinyllama.json").read_text())
    assert results["shape"] == "tinyllama" and results["dry_run"] and results["cpu"]
    assert results["rows"] and all(r["engine, model"].startswith("wscompress ") for r in results["rows"])  # no llama.cpp
    assert all(r["decode tok/s"] > 0 and r["decode GB/s"] > 0 for r in results["rows"])
    assert "TinyLlama-1.1B's shape" in (tmp_path / "results-tinyllama.md").read_text()

    types = gguf.GGMLQuantizationType
    for qtype, table in (("Q4_0", types.Q8_0), ("Q8_0", types.Q8_0), ("F16", types.F16)):  # the tied table's type
        (path,) = tmp_path.glob(f"*.{qtype}.gguf")
        reader = gguf.GGUFReader(path)
        keys = {k: reader.fields[k].contents() for k in reader.fields}
        assert keys["general.architecture"] == "llama"
        assert (keys["llama.embedding_length"], keys["llama.feed_forward_length"], keys["llama.block_count"],
                keys["llama.attention.head_count"], keys["llama.attention.head_count_kv"],
                keys["llama.rope.dimension_count"]) == (HIDDEN, FFN, LAYERS, HEADS, KV, HEAD_DIM)
        assert keys["llama.rope.freq_base"] == 10000.0  # TinyLlama's (SmolLM2's is 100000)
        assert len(keys["tokenizer.ggml.tokens"]) == 49152  # SmolLM2's tokenizer, copied
        tensors = {t.name: t for t in reader.tensors}
        assert len(tensors) == 2 + 9 * LAYERS and "output.weight" not in tensors  # tied: no separate head
        assert [int(n) for n in tensors["blk.0.ffn_down.weight"].shape] == [FFN, HIDDEN]  # GGUF's order: (in, out)
        assert [int(n) for n in tensors["blk.1.attn_k.weight"].shape] == [HIDDEN, KV * HEAD_DIM]
        assert [int(n) for n in tensors["token_embd.weight"].shape] == [HIDDEN, 49152]
        assert tensors["token_embd.weight"].tensor_type == table
        assert tensors["output_norm.weight"].tensor_type == types.F32
        assert {tensors[f"blk.{i}.{n}.weight"].tensor_type for i in range(LAYERS)
                for n in ("ffn_gate", "ffn_up", "ffn_down", "attn_q", "attn_k", "attn_v", "attn_output")} == {types[qtype]}
        down = tensors["blk.0.ffn_down.weight"]
        values = gguf.quants.dequantize(down.data, down.tensor_type)
        assert values.shape == (HIDDEN, FFN) and 0 < abs(values).max() <= 0.2  # finite, small scales
