"""Console output: progress bars (silenced by quiet mode), and tables: drawn by rich in a
terminal, printed as Markdown at their natural width elsewhere (a CI log, a file, a pipe),
where a drawn table would be wrapped to the 80 columns rich assumes."""

from __future__ import annotations

import json
import sys
from contextlib import contextmanager
from typing import Callable, Iterable, Iterator, TypeVar

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

T = TypeVar("T")
console = Console(stderr=True)
QUIET = False


def set_quiet(quiet: bool) -> None:
    global QUIET
    QUIET = quiet
    console.quiet = quiet


def log(message: str) -> None:
    console.print(message)


def track(items: Iterable[T], description: str, total: int | None = None) -> Iterator[T]:
    """Iterate with a progress bar (nothing drawn in quiet mode or when nested in another bar)."""
    if total is None and hasattr(items, "__len__"):
        total = len(items)
    with bar(description, total) as advance:
        for item in items:
            try:
                yield item
            finally:  # also where the caller, done with this item, closes the loop (it needs no more)
                advance()


@contextmanager
def bar(description: str, total: int | None) -> Iterator[Callable[[], None]]:
    """A progress bar of ``total`` steps with a time estimate; the caller advances it a step at a
    time through the function it gets (nothing drawn in quiet mode or when nested in another bar)."""
    if QUIET or _active or total == 0:
        yield lambda: None
        return
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), TimeRemainingColumn())
    with Progress(*columns, console=console, transient=False) as progress, _nested():
        task = progress.add_task(description, total=total)
        yield lambda: progress.advance(task)


_active = False


@contextmanager
def _nested():
    global _active
    _active = True
    try:
        yield
    finally:
        _active = False


def table(title: str, rows: list[dict]) -> Table:
    t = Table(title=title)
    columns = list(dict.fromkeys(k for r in rows for k in r))
    for c in columns:
        # fold, never cut: a value cut to "/data/corpora/wik…" says nothing
        t.add_column(c, justify="right" if rows and isinstance(rows[0].get(c), (int, float)) else "left", overflow="fold")
    for r in rows:
        t.add_row(*(cell(r.get(c)) for c in columns))
    return t


def cell(v) -> str:
    """A value as a table shows it."""
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, (dict, list)):
        return json.dumps(v)[:80]
    return "-" if v is None else str(v)


def markdown_table(rows: list[dict]) -> str:
    columns = list(dict.fromkeys(k for r in rows for k in r))
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def show(title: str, rows: list[dict]) -> None:
    """Print a summary table to stdout (kept in quiet mode: it is the result; by the first
    process of a launch only): drawn in a terminal, as Markdown anywhere else."""
    from .distributed import is_main

    if not is_main():
        return
    if sys.stdout.isatty():
        Console().print(table(title, rows))
    else:
        print(f"{title}\n\n{markdown_table(rows)}\n", flush=True)
