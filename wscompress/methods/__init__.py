"""Registry of compression methods.

Each method is one module in this package with one config class (a ``StageConfig``
subclass whose ``method`` field is a ``Literal`` of its name, and whose ``check(model)``
refuses options this model cannot take: it runs on the model's structure alone, on the meta
device, before any work) and one entry point ``apply(model, cfg, ctx) -> dict`` decorated
with ``@register(ConfigClass)``. The dict it returns goes into the compression report.
Modules here are imported automatically (``_sharing.py`` holds what the structural methods share).

Methods work one decoder-layer group at a time: a targeted method swaps its layers through
``pipeline.layerwise.replace_each`` (or reads them through ``onloaded``), others read weights inside
``offload_of(model).onload(group)`` (or ``groups``/``pipeline.layerwise``), and statistics come from
``ctx.stats`` (on disk, one matrix at a time), so memory follows one group, not the model.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from typing import Callable

from torch import nn

from ..recipe.schema import StageConfig


@dataclass(frozen=True)
class Method:
    name: str
    config: type[StageConfig]
    run: Callable  # (model, cfg, ctx) -> dict: the method's work
    whole_model: bool  # needs every decoder layer in memory at once (not with model.offload: disk)

    def apply(self, model: nn.Module, cfg: StageConfig, ctx) -> dict:
        """Check the options against this model, then compress it (in place); the report row."""
        cfg.check(model)
        return self.run(model, cfg, ctx) or {}


METHODS: dict[str, Method] = {}


def register(config: type[StageConfig], whole_model: bool = False) -> Callable:
    """Register ``apply`` for ``config``. A method that works one decoder-layer group at a time
    goes through ``offload.onload``/``pipeline.layerwise``; one that needs all layers at once
    (sharing between any layers, removing layers) says ``whole_model=True``."""
    name = config.model_fields["method"].default
    assert isinstance(name, str), f"{config.__name__}.method needs a Literal default"

    def deco(fn: Callable) -> Callable:
        METHODS[name] = Method(name, config, fn, whole_model)
        return fn

    return deco


for _info in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_info.name}")
