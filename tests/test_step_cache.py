"""generate() on CPU through a decode step compiled once and kept across processes
(wscompress.evaluation.step_cache): the same tokens as eager decoding, a miss that decodes
eagerly while a background process compiles, keys that tell models and calls apart."""

from __future__ import annotations

import time

import pytest
import torch

from wscompress import compress, load
from wscompress.evaluation import step_cache
from wscompress.io import storage
from conftest import tiny_model

pytestmark = pytest.mark.skipif(not step_cache.available(), reason="this torch cannot save compiled steps")

KMEANS = {"method": "kmeans", "bits": 4, "sensitivity": "none", "error_feedback": False, "refit": False,
          "outliers": 0.01}


def folder_of(tmp_path, tokenizer, seed: int = 0, outliers: float = 0.01):
    model = tiny_model("llama", seed=seed, layers=2)
    compress(model, [{**KMEANS, "outliers": outliers}])
    storage.save(model, tokenizer, tmp_path / f"model-{seed}-{outliers}")
    return tmp_path / f"model-{seed}-{outliers}"


def generate(model, prompt, new: int = 6):
    with torch.no_grad():
        return model.generate(prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False)


def test_a_miss_decodes_eagerly_then_a_step_compiled_in_the_background_serves(tmp_path, tokenizer, monkeypatch, one_thread):
    """The first generate() decodes eagerly and starts `wscompress precompile` in a process of its
    own; once it saved the step, generate() decodes through it: the eager tokens, batch of two."""
    monkeypatch.setenv("WSCOMPRESS_COMPILE", "auto")
    monkeypatch.setenv("WSCOMPRESS_STEP_CACHE", str(tmp_path / "steps"))
    model, _ = load(str(folder_of(tmp_path, tokenizer)), device="cpu")
    prompt = torch.randint(0, 512, (2, 5), generator=torch.Generator().manual_seed(1))
    monkeypatch.setenv("WSCOMPRESS_COMPILE", "0")
    expected = generate(model, prompt)
    monkeypatch.setenv("WSCOMPRESS_COMPILE", "auto")
    assert torch.equal(generate(model, prompt), expected)  # eager, while the step compiles
    logs = list((tmp_path / "steps").glob("*.log"))
    assert len(logs) == 1
    key = logs[0].stem
    deadline = time.monotonic() + 240
    while not (tmp_path / "steps" / f"{key}.step").exists() and time.monotonic() < deadline:
        time.sleep(1)
    time.sleep(1)  # the log's last line follows the save
    assert "ready" in logs[0].read_text(), logs[0].read_text()
    assert key not in step_cache._loaded
    assert torch.equal(generate(model, prompt), expected)
    assert key in step_cache._loaded  # loaded from the file the other process wrote
    assert torch.equal(generate(model, prompt[:, :3], new=9), generate_eager(model, prompt[:, :3], 9, monkeypatch))
    assert len(list((tmp_path / "steps").glob("*.log"))) == 1  # another prompt length: the same step


def generate_eager(model, prompt, new, monkeypatch):
    monkeypatch.setenv("WSCOMPRESS_COMPILE", "0")
    out = generate(model, prompt, new)
    monkeypatch.setenv("WSCOMPRESS_COMPILE", "auto")
    return out


def test_a_step_that_does_not_load_is_removed_and_decoding_goes_on(tmp_path, tokenizer, monkeypatch, one_thread):
    """A damaged step file (a torch upgraded in place, a disk error) is a miss: a warning, the file
    and its log removed, the eager tokens; nothing compiles for a model compressed in memory."""
    monkeypatch.setenv("WSCOMPRESS_STEP_CACHE", str(tmp_path))
    model = tiny_model("llama", layers=2)
    compress(model, [KMEANS])
    prompt = torch.randint(0, 512, (1, 5), generator=torch.Generator().manual_seed(2))
    expected = generate(model, prompt)
    monkeypatch.setenv("WSCOMPRESS_COMPILE", "auto")
    keys = []
    real_key = step_cache.step_key
    monkeypatch.setattr(step_cache, "step_key", lambda *a: keys.append(real_key(*a)) or keys[-1])
    generate(model, prompt)
    (tmp_path / f"{keys[-1]}.step").write_bytes(b"not a step")
    (tmp_path / f"{keys[-1]}.log").write_text("compiled by an older torch\n")
    with pytest.warns(UserWarning, match="does not load"):
        assert torch.equal(generate(model, prompt), expected)
    assert not (tmp_path / f"{keys[-1]}.step").exists()
    assert not (tmp_path / f"{keys[-1]}.log").exists()  # a later generate() may compile it again
    assert not list(tmp_path.glob("*.log"))  # no folder describes this model: nothing to compile from


def test_keys_tell_structures_and_calls_apart_not_values(tmp_path, tokenizer, monkeypatch, one_thread):
    """Two folders of the same structure share a step; another outlier count (other kernel
    layout shapes), another cache length or thread count does not. (That a key is the same in
    another process, the background test shows.)"""
    monkeypatch.setenv("WSCOMPRESS_COMPILE", "auto")
    a, b = (load(str(folder_of(tmp_path, tokenizer, seed=s)), device="cpu")[0] for s in (0, 1))
    other = load(str(folder_of(tmp_path, tokenizer, outliers=0.03)), device="cpu")[0]
    prompt = torch.randint(0, 512, (1, 5), generator=torch.Generator().manual_seed(3))
    for m in (a, b, other):
        generate(m, prompt, 1)  # kernel layouts built, as before a key is taken

    def call(length: int):
        kwargs = step_cache.prepare_generate(a, (prompt,), {"max_new_tokens": length})
        return {"input_ids": prompt[:, :1], "cache": kwargs["cache" if "cache" in kwargs else "past_key_values"]}

    key = step_cache.step_key(a, call(8))
    assert step_cache.step_key(b, call(8)) == key
    assert step_cache.step_key(other, call(8)) != key
    assert step_cache.step_key(a, call(300)) != key
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        assert step_cache.step_key(a, call(8)) != key
    finally:
        torch.set_num_threads(threads)


def test_generate_keeps_its_own_way_where_a_step_does_not_apply(tmp_path, tokenizer, monkeypatch):
    """Beam search, a cache or generation config of the caller's, WSCOMPRESS_COMPILE=0, lengths
    past MAX_CACHE: arguments unchanged. Otherwise a static cache rounded up to CACHE_BLOCK."""
    monkeypatch.setenv("WSCOMPRESS_COMPILE", "auto")
    model, _ = load(str(folder_of(tmp_path, tokenizer)), device="cpu")
    ids = torch.zeros(1, 5, dtype=torch.long)
    prepared = step_cache.prepare_generate(model, (ids,), {"max_new_tokens": 10})
    cache = prepared.get("cache", prepared.get("past_key_values"))
    assert step_cache.cache_length(cache) == step_cache.CACHE_BLOCK and prepared["compile_config"] is not None
    for kwargs in ({"max_new_tokens": 10, "num_beams": 2}, {"max_new_tokens": 10, "past_key_values": cache},
                   {"max_new_tokens": step_cache.MAX_CACHE}, {"max_new_tokens": 4, "cache_implementation": "dynamic"}):
        assert step_cache.prepare_generate(model, (ids,), kwargs) == kwargs
    monkeypatch.setenv("WSCOMPRESS_COMPILE", "0")
    assert step_cache.prepare_generate(model, (ids,), {"max_new_tokens": 10}) == {"max_new_tokens": 10}


def test_precompile_refuses_what_is_not_a_compressed_folder(tmp_path, tiny_dir):
    """`wscompress precompile` on a missing folder or an uncompressed one: one message, exit 2."""
    from typer.testing import CliRunner

    from wscompress.cli import app

    for path in (tmp_path / "missing", tiny_dir()):
        out = CliRunner().invoke(app, ["precompile", str(path)])
        assert out.exit_code == 2, out.output
        assert "precompile:" in out.output and "fix:" in out.output


def test_a_step_is_remembered_for_the_same_modules_only(tmp_path, tokenizer, monkeypatch):
    """Later generate() calls take the step a model took before without an eager step or a key,
    until a module of the model is swapped (another structure: the key is taken again)."""
    model = tiny_model("llama", layers=1)
    call = {"input_ids": torch.zeros(1, 1, dtype=torch.long), "use_cache": True}
    monkeypatch.setitem(step_cache._memo, model, (step_cache._modules(model), {step_cache._signature(call): len}))
    assert step_cache._remembered(model, call).func is len
    assert step_cache._remembered(model, {**call, "use_cache": False}) is None
    model.lm_head = torch.nn.Linear(model.lm_head.in_features, model.lm_head.out_features, bias=False)
    assert step_cache._remembered(model, call) is None


def test_a_remembered_step_does_not_keep_its_model_alive(monkeypatch, one_thread):
    """The memo is weak on models: a model that decoded through a step is freed with its last reference."""
    import gc
    import weakref

    monkeypatch.setenv("WSCOMPRESS_COMPILE", "1")
    monkeypatch.setattr(step_cache, "_loaded", {})  # this fake step serves no other test
    monkeypatch.setattr(step_cache, "compile_step", lambda model, kwargs, key: lambda m, **kw: m(**kw).logits)
    model = tiny_model("llama", layers=1)
    compress(model, [KMEANS])
    generate(model, torch.zeros(1, 3, dtype=torch.long), 3)
    assert model in step_cache._memo
    gone = weakref.ref(model)
    del model
    gc.collect()
    assert gone() is None


def test_a_step_that_does_not_compile_leaves_generate_eager(monkeypatch, one_thread):
    """WSCOMPRESS_COMPILE=1 on a model the compiler cannot take: a warning naming the error, the eager tokens."""
    model = tiny_model("llama", layers=1)
    compress(model, [KMEANS])
    prompt = torch.randint(0, 512, (1, 4), generator=torch.Generator().manual_seed(4))
    expected = generate(model, prompt, 4)

    def fails(*args):
        raise RuntimeError("no such lowering")

    monkeypatch.setattr(step_cache, "compile_step", fails)
    monkeypatch.setattr(step_cache, "_loaded", {})
    monkeypatch.setenv("WSCOMPRESS_COMPILE", "1")
    with pytest.warns(UserWarning, match="no such lowering"):
        assert torch.equal(generate(model, prompt, 4), expected)
