"""Short greedy generations per prompt: a quick look at what compression did to the text."""

from __future__ import annotations

import torch
from torch import nn

from ..io.offload import model_device, offload_of


@torch.no_grad()
def generate_samples(model: nn.Module, tokenizer, prompts: list[str], max_new_tokens: int) -> list[dict]:
    """Greedy continuation of each prompt (deterministic, so original and compressed compare)."""
    device = model_device(model)
    out = []
    for prompt in prompts:
        enc = tokenizer(prompt, return_tensors="pt").to(device)
        with offload_of(model).running():
            ids = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id)
        out.append({"prompt": prompt, "completion": tokenizer.decode(ids[0, enc.input_ids.shape[1]:], skip_special_tokens=True)})
    return out
