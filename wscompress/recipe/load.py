"""Reading a recipe: YAML, ``--set`` overrides, and validation into the typed sections of
``schema`` (each stage by its method's own config class), with the file, the key and the fix
named on any error."""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from ..errors import UsageError
from .schema import Recipe, StageConfig, error_fix, error_lines


def _parse_value(text: str) -> Any:
    """`--set` values are YAML scalars/lists: 0.3 -> float, true -> bool, [a, b] -> list."""
    return yaml.safe_load(text) if text.strip() else ""


def apply_override(data: dict, assignment: str) -> None:
    """Apply ``a.b.0.c=value`` to nested dicts/lists, creating dicts on the way."""
    if "=" not in assignment:
        raise UsageError(f"override {assignment!r} has no '='", "write --set section.key=value")
    path, value = assignment.split("=", 1)
    keys = path.strip().split(".")
    node: Any = data
    for i, key in enumerate(keys):
        last = i == len(keys) - 1
        if isinstance(node, list):
            if not key.isdigit() or int(key) >= len(node):
                raise UsageError(f"override {path!r}: {'.'.join(keys[:i])} has no item {key}",
                                 f"use an index below {len(node)}")
            key = int(key)
        elif not isinstance(node, dict):
            raise UsageError(f"override {path!r}: {'.'.join(keys[:i])} is not a section")
        if last:
            node[key] = _parse_value(value)
        else:
            if isinstance(node, dict) and node.get(key) is None:
                node[key] = {}
            node = node[key]


def parse_stage(data: Any, index: int, where: str) -> StageConfig:
    from ..methods import METHODS

    prefix = f"compress.{index}"
    if not isinstance(data, dict) or "method" not in data:
        raise UsageError(f"{where}: {prefix}: a stage must be a mapping with a 'method' key",
                         f"e.g. - method: svd; known methods: {', '.join(sorted(METHODS))}")
    name = data["method"]
    if name not in METHODS:
        close = difflib.get_close_matches(str(name), METHODS, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise UsageError(f"{where}: {prefix}.method: unknown method {name!r}",
                         f"{hint}known methods: {', '.join(sorted(METHODS))}")
    cls = METHODS[name].config
    try:
        return cls.model_validate(data)
    except ValidationError as err:
        raise UsageError(error_lines(err, where, prefix), error_fix(err, cls, f"method {name!r}", prefix)) from None


def load_recipe(path: str | Path | None = None, overrides: list[str] = (), data: dict | None = None) -> Recipe:
    """Read, override and validate a recipe. Raises UsageError naming file, key and fix."""
    where = str(path) if path else "<recipe>"
    if data is None:
        if path is None:
            data = {}
        else:
            p = Path(path)
            if not p.is_file():
                raise UsageError(f"recipe {where} not found", "pass the path of a YAML recipe, e.g. configs/demo.yaml")
            try:
                data = yaml.safe_load(p.read_text()) or {}
            except yaml.YAMLError as err:
                raise UsageError(f"{where}: not valid YAML: {err}", "fix the YAML syntax at the line shown") from None
    if not isinstance(data, dict):
        raise UsageError(f"{where}: the recipe must be a mapping of sections", "start with e.g. 'model:'")
    data = dict(data)
    for assignment in overrides:
        apply_override(data, assignment)
    stages = data.pop("compress", None) or []
    if not isinstance(stages, list):
        raise UsageError(f"{where}: compress: must be a list of stages", "write each stage as '- method: NAME'")
    try:
        recipe = Recipe.model_validate(data)
    except ValidationError as err:
        raise UsageError(error_lines(err, where), error_fix(err, Recipe, "the recipe")) from None
    recipe.compress = [parse_stage(s, i, where) for i, s in enumerate(stages)]
    recipe.source = str(path) if path else None
    return recipe


def recipe_dict(recipe: Recipe) -> dict:
    """The recipe as plain data (for reports), stages with their method-specific fields."""
    data = recipe.model_dump(mode="json", exclude={"compress"})
    data["compress"] = [s.model_dump(mode="json") for s in recipe.compress]
    return data
