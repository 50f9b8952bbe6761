"""bench: original vs compressed in one table; the timing helpers' warm-up and medians."""

from __future__ import annotations

import pytest
import torch

from wscompress import compress, kernels
from wscompress.evaluation import bench
from wscompress.evaluation.decode import StaticDecoder
from wscompress.io import storage
from wscompress.recipe.load import load_recipe
from wscompress.recipe.schema import BenchConfig
from wscompress.workflow import step_bench

from conftest import tiny_model


def test_bench_compares_original_and_compressed(tmp_path, tiny_dir, tokenizer):
    original = tiny_dir()
    model = tiny_model("llama")
    compress(model, [{"method": "svd", "ratio": 0.5, "whitening": False, "targets": ["mlp"]}])
    saved = storage.save(model, tokenizer, tmp_path / "run" / "model")
    r = load_recipe(data={"model": {"path": str(original), "device": "cpu"}, "output": {"dir": str(tmp_path / "run")},
                          "bench": {"batch_sizes": [1, 2], "seq_lens": [16], "decode_tokens": 2, "warmup": 0, "repeats": 1}})
    out = step_bench(r)
    rows = {row["measure"]: row for row in out["table"]}
    assert list(rows) == ["weights MB", "bits a weight", "params", "resident weights MB", "file MB", "load s", "peak memory MB",
                          "prefill tok/s b1 s16", "decode tok/s b1 s16", "prefill tok/s b2 s16", "decode tok/s b2 s16"]
    assert rows["params"]["compressed"] == saved["params"] < rows["params"]["original"]
    assert rows["file MB"]["compressed"] * 2**20 == saved["file_bytes"]
    assert rows["params"]["compressed/original"] == saved["params"] / rows["params"]["original"]
    assert all(row["original"] > 0 and row["compressed"] > 0 for row in out["table"])
    assert (tmp_path / "run" / "reports" / "bench.md").read_text().count("compressed/original") == 1
    assert out["kernels"]["original"] == "dense matmuls (torch)"
    assert out["kernels"]["compressed"].startswith("LowRankLinear: fused kernel for decoding" if kernels.lowrank()
                                                   else "LowRankLinear: two matmuls (torch)")
    assert rows["resident weights MB"]["compressed"] < rows["resident weights MB"]["original"]
    parts = {(r["model"], r["part"]): r for r in out["breakdown"]}  # where a decoded token's time goes
    assert {("original", "linears: dense"), ("compressed", "linears: low rank"), ("compressed", "head"),
            ("compressed", "attention (linears apart)"), ("compressed", "norms"), ("compressed", "step")} <= set(parts)
    assert parts["compressed", "step"]["MB read"] < parts["original", "step"]["MB read"]
    assert "## breakdown" in (tmp_path / "run" / "reports" / "bench.md").read_text()


def test_decode_breakdown_accounts_for_the_step():
    """Each part's own time (hooks' cost taken out) and the rest add up to the plain step; the
    parts read the model's weights once (the embedding one row)."""
    from wscompress.evaluation.profile import decode_breakdown, markdown

    model = tiny_model("llama")
    compress(model, [{"method": "kmeans", "bits": 4, "sensitivity": "none", "error_feedback": False, "refit": False,
                      "outliers": 0.01}])
    b = decode_breakdown(model, bandwidth=1e10, prompt=8, steps=4)
    parts = {r["part"]: r for r in b["rows"]}
    assert "linears: palettized 4-bit, scalar, a codebook per channel, outliers" in parts
    assert {"head", "embedding", "norms", "attention (linears apart)"} < set(parts) and any(p.startswith("rest") for p in parts)
    assert sum(r["ms"] for r in b["rows"]) >= 0.99 * b["ms"] > 0
    assert parts["embedding"]["MB"] * 2**20 == 64 * 4  # one row of the float32 table
    assert parts["head"]["MB"] * 2**20 == 512 * 64 * 4
    assert b["bound_ms"] == b["MB"] * 2**20 / 1e10 * 1e3
    assert "| **step** |" in markdown(b)


def test_median_after_warmup(monkeypatch):
    times = iter([9.0, 1.0, 3.0, 2.0])  # the first run is warm-up and must not count
    monkeypatch.setattr(bench, "_elapsed", lambda device, fn: (fn(), next(times))[1])
    states, seen = iter(range(4)), []
    median = bench._median_seconds(torch.device("cpu"), seen.append, lambda: next(states), BenchConfig(warmup=1, repeats=3))
    assert median == 2.0 and seen == [0, 1, 2, 3]


def test_throughput_without_decode_and_table_of_one_model():
    model = tiny_model("gpt2")  # Conv1D projections, learned positions
    row = bench.throughput(model, 2, 8, BenchConfig(decode_tokens=0, warmup=0, repeats=1))
    assert list(row) == ["prefill_tok_s"] and row["prefill_tok_s"] > 0
    result = {"params": 1, "weights_mb": 1.0, "bits_per_weight": 32.0, "resident_mb": 1.0, "file_mb": None, "load_s": 0.1, "peak_memory_mb": 5.0,
              "shapes": [{"batch": 2, "seq_len": 8, **row}]}
    rows = bench.comparison_rows({"original": result})
    assert [r["measure"] for r in rows][-1] == "prefill tok/s b2 s8" and all("compressed/original" not in r for r in rows)


def test_peak_memory_is_this_process_not_its_parents():
    """A process started by a large one reports its own peak: ru_maxrss would carry the parent's
    over fork and exec (a benchmark that built a 5 GB model reported 5.98 GB for every child)."""
    import subprocess
    import sys

    ballast = torch.ones(2**30 // 4)  # 1 GiB resident in this process
    code = "import torch; from wscompress.evaluation.report import peak_memory_mb; print(peak_memory_mb(torch.device('cpu')))"
    child = float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    from wscompress.evaluation.report import peak_memory_mb

    assert peak_memory_mb(torch.device("cpu")) > 1024 > child
    del ballast


@pytest.mark.parametrize("method", [None, {"method": "kmeans", "bits": 4, "sensitivity": "none", "error_feedback": False,
                                           "refit": False, "outliers": 0.01}])
def test_static_decoder_decodes_what_generate_does(method):
    """The static-cache decoder (what bench replays as a CUDA graph on a GPU) gives generate's
    greedy tokens, dense and palettized (the LUT kernel with outliers), and restarts on reset."""
    model = tiny_model("llama")
    if method:
        compress(model, [method])
    prompt = torch.randint(0, 512, (2, 7), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = model.generate(prompt, max_new_tokens=6, do_sample=False, min_new_tokens=6)[:, 7:]
        decoder = StaticDecoder(model, prompt, max_new_tokens=5)
        for _ in range(2):  # the second time after a reset
            tokens = [decoder.first] + [decoder.step().clone() for _ in range(5)]
            assert torch.equal(torch.cat(tokens, 1), expected)
            decoder.reset()


def test_compiled_decoding_gives_the_eager_tokens(tokenizer):
    """The decode step compiled (torch.compile, the compressed layers' kernels called as operators
    inside the graph) decodes the eager tokens, through StaticDecoder and through generate once
    compile_decode set it up (transformers' static cache and automatic compilation)."""
    from wscompress.evaluation.decode import compile_decode

    model = tiny_model("llama")
    compress(model, [{"method": "svd", "ratio": 0.3, "whitening": False, "targets": ["mlp"]},
                     {"method": "kmeans", "bits": 4, "sensitivity": "none", "error_feedback": False, "refit": False,
                      "outliers": 0.01, "targets": ["self_attn", "lm_head"]}])
    prompt = torch.randint(0, 512, (1, 7), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = model.generate(prompt, max_new_tokens=6, do_sample=False, min_new_tokens=6)
        decoder = StaticDecoder(model, prompt, max_new_tokens=5, compile=True)
        tokens = [decoder.first] + [decoder.step().clone() for _ in range(5)]
        assert torch.equal(torch.cat(tokens, 1), expected[:, 7:])
        compiled = compile_decode(model).generate(prompt, max_new_tokens=6, do_sample=False, min_new_tokens=6)
    assert torch.equal(compiled, expected)
    assert model.generation_config.cache_implementation == "static"


def test_many_compiled_decoders_in_one_process():
    """Each compiled decoder traces its own model's step (benchmarks compile a dozen models side
    by side), more of them than dynamo's recompile limit (lowered to 1 here to keep the test
    short; 8 by default), and each decodes its own model's tokens: its step checks no guard on
    the model, so a graph shared between decoders would serve one model's step to another."""
    import torch._dynamo

    prompt = torch.tensor([[1, 2, 3]])
    decoders = []
    with torch._dynamo.config.patch(recompile_limit=1):
        for i in range(3):
            model = tiny_model("llama", seed=i, layers=1, vocab_size=256 + 16 * i)
            decoders.append((model, StaticDecoder(model, prompt, max_new_tokens=3, compile=True)))
        for model, decoder in decoders:
            decoder.reset()
            tokens = torch.cat([decoder.first] + [decoder.step().clone() for _ in range(3)], 1)
            with torch.no_grad():
                expected = model.generate(prompt, max_new_tokens=4, do_sample=False, min_new_tokens=4)
            assert torch.equal(tokens, expected[:, 3:])
