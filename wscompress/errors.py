"""One exception type for every user mistake: the CLI prints it and exits with code 2."""

from __future__ import annotations

import importlib
from types import ModuleType


class UsageError(Exception):
    """Bad input (recipe, checkpoint, option). ``fix`` tells the user what to do about it."""

    def __init__(self, problem: str, fix: str | None = None):
        self.problem, self.fix = problem, fix
        super().__init__(problem if fix is None else f"{problem}\n  fix: {fix}")


def need(module: str, extra: str, purpose: str) -> ModuleType:
    """Import ``module`` from an optional extra of the package (pyproject.toml): loading a
    compressed folder needs none of them, so a missing one is named, with what installs it,
    where a step first needs it (``preflight`` asks before a run spends time)."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise UsageError(f"{purpose} needs {module.split('.')[0]}, which is not installed",
                         f"pip install 'wscompress[{extra}]' (or 'wscompress[all]': the whole toolkit)") from None
