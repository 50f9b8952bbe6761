"""The real SmolLM2-135M-Instruct: builtin conversion, GGUF loading, perplexity on wiki text."""

import pytest
import torch

from wscompress.evaluation.perplexity import perplexity
from wscompress.io import data
from wscompress.io.checkpoints import load_model
from wscompress.model.arch import discover
from wscompress.recipe.schema import ModelConfig

from conftest import WIKI_TEST

pytestmark = pytest.mark.slow


def test_builtin_is_a_plain_llama_checkpoint(smollm2):
    model, tokenizer = smollm2
    arch = discover(model)
    assert arch.num_layers == 30 and arch.num_heads == 9 and arch.num_kv_heads == 3 and arch.is_gqa
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.config.rope_parameters["rope_theta"] == 100000.0
    assert not hasattr(model.config, "quantization_config")


def test_perplexity_on_wiki_text(smollm2):
    model, tokenizer = smollm2
    ids = data.tokenize(tokenizer, WIKI_TEST, max_tokens=4 * 256)
    result = perplexity(model, ids, context_length=256, batch_size=4)
    # a real 135M model on Wikipedia: far better than chance (vocab 49152), in the 10-40 range
    assert 8 < result["ppl"] < 40 and result["tokens"] == 4 * 255


def test_gguf_file_loads_like_the_converted_folder(smollm2, smollm2_dir):
    model, _ = smollm2
    gguf = next(smollm2_dir.glob("*.gguf"))
    from_gguf, _ = load_model(ModelConfig(path=str(gguf), device="cpu"))
    x = torch.tensor([[1, 2, 3, 4, 5, 6]])
    with torch.no_grad():
        assert torch.allclose(from_gguf(x).logits, model(x).logits, atol=1e-4)


def test_a_model_compressed_from_gguf_saves_load_and_saves_again(smollm2_dir, tmp_path, tokenizer):
    """transformers de-quantizes a GGUF source as it loads it: the compressed folder's config
    describes what it holds (no GGUF quantization_config), so save -> load -> save round trips,
    with wscompress and through the folder's own code."""
    import json

    from transformers import AutoModelForCausalLM

    import wscompress
    from wscompress.io import storage

    gguf = next(smollm2_dir.glob("*.gguf"))
    model, tok = load_model(ModelConfig(path=str(gguf), device="cpu"))
    assert getattr(model, "hf_quantizer", None) is None and "quantization_config" not in model.config.to_dict()
    wscompress.compress(model, [{"method": "svd", "ratio": 0.3, "whitening": False, "targets": [r"layers\.0\.mlp\."]}], tok)
    model.save_pretrained(tmp_path / "a")  # the in-memory model saves (it refused while it kept the GGUF quantizer)
    config = json.loads((tmp_path / "a" / "config.json").read_text())
    assert "quantization_config" not in config["base_config"] and config["dtype"] == "float32"
    x = torch.tensor([[1, 2, 3, 4, 5, 6]])
    with torch.no_grad():
        want = model(x).logits
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "a")
    assert getattr(loaded, "hf_quantizer", None) is None
    loaded.save_pretrained(tmp_path / "b")
    again, _ = wscompress.load(tmp_path / "b", device="cpu")
    storage.save(again, tok, tmp_path / "c")
    with torch.no_grad():
        for folder in ("a", "b", "c"):
            got = AutoModelForCausalLM.from_pretrained(tmp_path / folder)(x).logits
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
