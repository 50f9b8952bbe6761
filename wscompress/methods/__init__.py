"""Registry of compression methods.

Each method is one module in this package with one config class (a ``StageConfig``
subclass whose ``method`` field is a ``Literal`` of its name) and one entry point
``apply(model, cfg, ctx) -> dict`` decorated with ``@register(ConfigClass)``. The dict it
returns goes into the compression report. Modules here are imported automatically.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from typing import Callable

from ..recipe import StageConfig


@dataclass(frozen=True)
class Method:
    name: str
    config: type[StageConfig]
    apply: Callable  # (model, cfg, ctx) -> dict


METHODS: dict[str, Method] = {}


def register(config: type[StageConfig]) -> Callable:
    name = config.model_fields["method"].default
    assert isinstance(name, str), f"{config.__name__}.method needs a Literal default"

    def deco(fn: Callable) -> Callable:
        METHODS[name] = Method(name, config, fn)
        return fn

    return deco


for _info in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_info.name}")
