"""Greedy decoding on a static KV cache, one token a step, optionally compiled (torch.compile)
or replayed as a CUDA graph.

Eager decoding of a small model is bound by Python running each module's small ops one at a
time, not by the weights: on a GPU a 135M model then decodes no faster than a 1B one, and on a
CPU attention, norms and the framework take as long as the compressed linears (``profile``).
Serving stacks compile the decode step, or capture it once as a CUDA graph and replay it.
``StaticDecoder`` does the same on transformers' ``StaticCache`` (fixed shapes and addresses,
which both need): ``compile=True`` traces the step once with torch.compile (the compressed
layers' kernels are PyTorch operators the graph calls), ``graph=True`` (CUDA) captures it.
``compile_decode`` sets a model's ``generate`` up the same way (transformers' own static cache
and automatic compilation; on CPU, through ``step_cache``'s step kept across processes).
"""

from __future__ import annotations

import inspect
import types
from typing import Callable, Sequence

import torch
from torch import nn
from transformers import StaticCache

WARMUP = 2  # eager steps before capture or tracing: kernels compile and tune, layers build their layouts


def cache_argument(model: nn.Module) -> str:
    """The name the model's forward takes its KV cache by: ``cache`` (transformers >= 5.2x, which
    deprecates the old name) or ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def prompt_forward(model: nn.Module, input_ids: torch.Tensor):
    """The forward ``generate()`` makes for a prompt: with a KV cache, and logits for the last
    position only where the model takes ``logits_to_keep`` (generate passes 1), as llama.cpp
    evaluates a prompt. What a benchmark's prefill times: all positions' logits would add a
    whole head product a token (a tenth of a 1.1B model's prefill)."""
    keep = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
    return model(input_ids=input_ids, use_cache=True, **keep)


def compile_decode(model: nn.Module) -> nn.Module:
    """Make ``model.generate()`` decode on a static KV cache with its forward compiled
    (transformers' own automatic compilation, which it otherwise turns on only on GPUs). On CPU
    a compressed model's first call compiles its step in this process (about a minute for a
    135M model on 2 cores; again for each new cache length) and saves it for later processes
    (``step_cache``); without this call ``generate()`` compiles it in the background instead."""
    model.generation_config.cache_implementation = "static"
    model.generation_config.compile_config = compile_config()
    return model


def compile_config():
    """transformers' compile config for ``generate``'s decode step on a static cache, on any
    device (transformers otherwise compiles only on GPUs)."""
    from transformers.generation.configuration_utils import CompileConfig

    config = CompileConfig(fullgraph=True, dynamic=False)
    config._compile_all_devices = True  # transformers' switch for compiling off GPUs
    return config


def step_guards(entries: Sequence) -> list[bool]:
    """Dynamo's guards a decode step keeps (``torch.compile``'s ``guard_filter_fn``): those on
    its arguments (``ids``, ``positions``: shape, dtype, device) and on global state (grad
    mode, default device), none on the model or the modules' code."""
    return [e.name in ("ids", "positions") or not e.name for e in entries]


class StaticDecoder:
    """Greedy decoding after ``prompt`` (batch, length): the prompt is run once on construction;
    each ``step()`` decodes one token per sequence (at most ``max_new_tokens`` after each
    ``reset()``). ``compile=True`` runs the step compiled (traced once, after eager warm-up
    steps); ``graph=True`` (CUDA only) captures it once and replays it."""

    @torch.no_grad()  # decoding never needs gradients: a step traced with them would keep a backward graph
    def __init__(self, model: nn.Module, prompt: torch.Tensor, max_new_tokens: int, graph: bool = False,
                 compile: bool = False):
        self.model, self.prompt, self.start = model, prompt, prompt.shape[1]
        self.cache_name = cache_argument(model)
        self.cache = StaticCache(config=model.config, max_cache_len=self.start + max(max_new_tokens, WARMUP))
        self.forward = self._logits
        self.first = self._prefill()  # the token the prompt predicts
        self.token, self.position = self.first.clone(), torch.tensor([self.start], device=prompt.device)
        self.graph: torch.cuda.CUDAGraph | None = None
        if compile:
            for _ in range(WARMUP):  # layers build their kernel layouts eagerly: the graph reads them
                self._step()
            self.forward = self._compiled()
            self._step()  # traced and compiled here, not in the first timed step
            self.reset()
        if graph:
            self._capture()

    def _compiled(self) -> Callable:
        """This decoder's step, compiled, checking before each call only what can change between
        calls: the step's own inputs and the interpreter's global state. Dynamo otherwise checks
        the model's every module before each call (thousands of guards on a 30-layer model: their
        evaluation was about a fifth of a compiled SmolLM2 step, docs/runtime.md) to catch a
        model changed since tracing; the step, like a captured CUDA graph, is bound to the model
        as it was traced. The step is a copy of ``_logits``' code, so that dynamo keeps this
        decoder's graph apart from every other decoder's (its cache is per code object): with
        the module guards gone, a shared one would serve one model's graph to another."""
        own = types.FunctionType(StaticDecoder._logits.__code__.replace(), globals(), "_logits")
        return torch.compile(types.MethodType(own, self), dynamic=False, fullgraph=True,
                             options={"guard_filter_fn": step_guards})

    def _logits(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, cache_position=positions, use_cache=True, **{self.cache_name: self.cache}).logits

    def _prefill(self) -> torch.Tensor:
        return self._logits(self.prompt, torch.arange(self.start, device=self.prompt.device))[:, -1:].argmax(-1)

    def _step(self) -> None:
        self.token.copy_(self.forward(self.token, self.position)[:, -1:].argmax(-1))
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

    @torch.no_grad()
    def reset(self) -> None:
        """Back to the first token after the prompt. The cache is emptied in place (its layers
        may count their own length) and the prompt run again: a captured graph keeps its addresses."""
        self.cache.reset()
        self.token.copy_(self._prefill())
        self.position.fill_(self.start)

    @torch.no_grad()
    def step(self) -> torch.Tensor:
        """Decode one token per sequence; returns the (batch, 1) tensor holding it (reused each step)."""
        if self.graph is not None:
            self.graph.replay()
        else:
            self._step()
        return self.token
