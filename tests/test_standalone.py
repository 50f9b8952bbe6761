"""A clone with nothing beside it runs: the texts ship in the package, nothing names the folder beside the repository."""

from __future__ import annotations

import pytest

from wscompress.errors import UsageError
from wscompress.io import data
from wscompress.recipe.load import load_recipe

from conftest import REPO

BESIDE = "/".join(["..", "shared"])  # spelled so that this file does not name it itself


def test_nothing_reads_the_folder_beside_the_repository():
    places = [REPO / "Makefile", REPO / "pyproject.toml", *(REPO / d for d in ("wscompress", "configs", "tests", "scripts", ".ci"))]
    files = [f for p in places for f in ([p] if p.is_file() else p.rglob("*")) if f.is_file() and f.suffix not in (".xz", ".pyc")]
    hits = [str(f.relative_to(REPO)) for f in files if BESIDE in f.read_text(errors="ignore")]
    assert len(files) > 50 and hits == []


def test_builtin_texts_load_and_are_named_by_their_file():
    assert set(data.builtin_texts()) == {"wiki.train", "wiki.test", "brown"}
    for name, size in (("wiki.train", 1_215_145), ("wiki.test", 1_608_382), ("brown", 5_983_284)):
        text = data.load_text(f"builtin:{name}")
        assert len(text.encode()) == size
        data.check_source(f"builtin:{name}", "eval.perplexity")
        assert data.source_label(f"builtin:{name}") == f"{name}.txt"
    assert data.load_text("builtin:wiki.test").startswith(" = ")


def test_unknown_builtin_text_names_the_known_ones():
    with pytest.raises(UsageError, match="no builtin text 'wiki.valid'") as err:
        data.check_source("builtin:wiki.valid", "calibration.dataset")
    assert "builtin:wiki.train" in err.value.fix


def test_recipe_defaults_name_shipped_texts():
    recipe = load_recipe(data={"finetune": {"steps": 1}})
    for source in (recipe.calibration.dataset, recipe.finetune.dataset, *recipe.eval.perplexity):
        assert source.startswith("builtin:")
        data.check_source(source, "default")
