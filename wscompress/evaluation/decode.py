"""Greedy decoding on a static KV cache, one token a step, optionally replayed as a CUDA graph.

Eager decoding of a small model on a GPU is bound by Python launching kernels one at a time,
not by the GPU: a 135M model then decodes no faster than a 1B one, and what a compressed layer
saves in bytes never shows. Serving stacks capture the decode step once as a CUDA graph and
replay it. ``StaticDecoder`` does the same on transformers' ``StaticCache`` (fixed shapes and
addresses, which a graph needs), so ``bench`` can measure the layers rather than Python.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import StaticCache

WARMUP = 2  # eager steps before capture: kernels compile and tune, layers build their layouts


class StaticDecoder:
    """Greedy decoding after ``prompt`` (batch, length): the prompt is run once on construction;
    each ``step()`` decodes one token per sequence (at most ``max_new_tokens`` after each
    ``reset()``). ``graph=True`` (CUDA only) captures the step once and replays it."""

    def __init__(self, model: nn.Module, prompt: torch.Tensor, max_new_tokens: int, graph: bool = False):
        self.model, self.prompt, self.start = model, prompt, prompt.shape[1]
        self.cache = StaticCache(config=model.config, max_cache_len=self.start + max(max_new_tokens, WARMUP))
        self.first = self._prefill()  # the token the prompt predicts
        self.token, self.position = self.first.clone(), torch.tensor([self.start], device=prompt.device)
        self.graph: torch.cuda.CUDAGraph | None = None
        if graph:
            self._capture()

    def _prefill(self) -> torch.Tensor:
        logits = self.model(input_ids=self.prompt, past_key_values=self.cache, use_cache=True,
                            cache_position=torch.arange(self.start, device=self.prompt.device)).logits
        return logits[:, -1:].argmax(-1)

    def _step(self) -> None:
        logits = self.model(input_ids=self.token, past_key_values=self.cache, cache_position=self.position,
                            use_cache=True).logits
        self.token.copy_(logits[:, -1:].argmax(-1))
        self.position += 1

    def _capture(self) -> None:
        side = torch.cuda.Stream()  # warm-up runs off the default stream, as capture requires
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP):
                self._step()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self._step()
        self.reset()

    def reset(self) -> None:
        """Back to the first token after the prompt. The cache is emptied in place (its layers
        may count their own length) and the prompt run again: a captured graph keeps its addresses."""
        self.cache.reset()
        self.token.copy_(self._prefill())
        self.position.fill_(self.start)

    def step(self) -> torch.Tensor:
        """Decode one token per sequence; returns the (batch, 1) tensor holding it (reused each step)."""
        if self.graph is not None:
            self.graph.replay()
        else:
            self._step()
        return self.token
