"""Registry of compression methods.

Each method is one module in this package with one config class (a ``StageConfig``
subclass whose ``method`` field is a ``Literal`` of its name) and one entry point
``apply(model, cfg, ctx) -> dict`` decorated with ``@register(ConfigClass)``. The dict it
returns goes into the compression report. Modules here are imported automatically.

Methods work one decoder-layer group at a time: they read weights inside
``offload_of(model).onload(group)`` (or ``groups``/``pipeline.layerwise``) and statistics from
``ctx.stats`` (on disk, one matrix at a time), so memory follows one group, not the model.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from typing import Callable

from ..recipe.schema import StageConfig


@dataclass(frozen=True)
class Method:
    name: str
    config: type[StageConfig]
    apply: Callable  # (model, cfg, ctx) -> dict
    whole_model: bool  # needs every decoder layer in memory at once (not with model.offload: disk)


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
