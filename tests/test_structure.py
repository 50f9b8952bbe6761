"""The package's structure: no import circles between its modules, packages that import only
downward (in the order docs/architecture.md gives), and the README's and docs/architecture.md's
drawings of the tree name every folder it has."""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import REPO

PACKAGE = REPO / "wscompress"


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, modules: set[str]) -> set[str]:
    """The package's modules ``path`` imports, anywhere in it (a function's own imports too;
    an ``if TYPE_CHECKING:`` block's are no import at run time)."""
    here = module_name(path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for n in ast.walk(node)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            for alias in node.names:  # a submodule imported from its package, or a name from a module
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {m for m in found if m in modules and m != here}


def graph() -> dict[str, set[str]]:
    files = sorted(PACKAGE.rglob("*.py"))
    modules = {module_name(f) for f in files}
    return {module_name(f): imports(f, modules) for f in files}


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in edges:
        if v not in index:
            visit(v)
    return out


def test_no_import_circles():
    edges = graph()
    assert len(edges) > 40 and edges["wscompress.workflow"]  # the graph was read
    assert circles(edges) == []


# The floors of the package, bottom up: a module imports from its own floor or one below.
# recipe/ has two: schema.py (the sections every part reads) low, load.py (which validates each
# stage with its method's config class, from the methods' registry) above the methods.
FLOORS = ["errors", "model", "recipe.schema", "io", "kernels", "maths", "pipeline", "methods", "evaluation",
          "recovery", "recipe", "workflow", "cli", ""]


def floor(module: str) -> int:
    """The floor of a module: that of the longest name in FLOORS it lies in."""
    name = module.removeprefix("wscompress").removeprefix(".")
    return max((len(f), i) for i, f in enumerate(FLOORS) if name == f or f and name.startswith(f + "."))[1]


def test_packages_import_downward():
    upward = sorted(f"{a} -> {b}" for a, deps in graph().items() for b in deps if floor(b) > floor(a))
    assert upward == []
    assert floor("wscompress.recipe.schema") < floor("wscompress.io.checkpoints") < floor("wscompress.recipe.load")
    assert floor("wscompress") == len(FLOORS) - 1 and floor("wscompress.model.arch") == 1


def test_architecture_names_the_floors_in_order():
    text = (REPO / "docs" / "architecture.md").read_text()
    drawn = " → ".join(f"`{f.replace('.', '/') + ('.py' if f == 'recipe.schema' else '')}`" for f in FLOORS[:-1])
    assert drawn.replace("`recipe`", "`recipe/load.py`") in text


def test_circle_finder_finds_one():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_drawings_of_the_tree_name_every_folder():
    folders = sorted(p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").is_file())
    assert "pipeline" in folders and "methods" in folders
    for doc in (REPO / "README.md", REPO / "docs" / "architecture.md"):
        text = doc.read_text()
        assert [f for f in folders if f"{f}/" not in text] == [], doc.name
