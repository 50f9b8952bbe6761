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
