"""A damaged or crafted folder fails cleanly through each of the three loads (``wscompress.load``,
``from_pretrained`` after ``import wscompress``, ``trust_remote_code`` without wscompress): a
Python exception that names the problem, raised before any kernel reads the data, and before
anything is allocated for shapes the weight files do not hold."""

from __future__ import annotations

import json
import re
import shutil
import textwrap

import pytest
import torch
from safetensors.torch import load_file, save_file

import wscompress
from wscompress.errors import UsageError
from wscompress.io import storage

from conftest import tiny_model
from test_transformers import CALIBRATION, WITHOUT_WSCOMPRESS, run_without_wscompress

BASES = {
    "palettized": [{"method": "kmeans", "bits": 4, "outliers": 0.02, "targets": [r"model\.layers\.", "lm_head"]}],
    "huffman": [{"method": "kmeans", "bits": 4, "entropy_coding": True}],
    "low_rank": [{"method": "svd", "ratio": 0.3, "whitening": False}],
    "half": [{"method": "half"}],  # the tied table in float16, stored under the embedding's name
    "int8": [{"method": "int8"}],  # the tied table in int8 blocks
}
TABLE = "model.embed_tokens.table.bits16"  # (512, 64) int16
LAYER = "model.layers.0.mlp.down_proj"  # (64, 128)


def _tensors(folder, change) -> None:
    tensors = load_file(folder / storage.WEIGHTS)
    change(tensors)
    save_file(tensors, folder / storage.WEIGHTS, {"format": "pt"})


def _config(folder, change) -> None:
    config = json.loads((folder / "config.json").read_text())
    change(config)
    (folder / "config.json").write_text(json.dumps(config))


def _modules(config) -> dict:
    return config["compression"]["modules"]


def _outlier_past_the_end(t):
    t[f"{LAYER}.outlier_index"][0] = 64 * 128 + 5


def _rename_module(new: str):
    return lambda c: _modules(c).__setitem__(new, _modules(c).pop(LAYER))


def _huffman_lengths(t):
    t[f"{LAYER}.huffman_lengths"][:] = 1  # 16 codes of one bit: not a prefix code


def _truncate(folder) -> None:
    data = (folder / storage.WEIGHTS).read_bytes()
    (folder / storage.WEIGHTS).write_bytes(data[: len(data) // 2])


def _alias_loop(c):
    c["compression"]["module_aliases"] = {"model.layers.1.mlp": "model.layers.0.mlp", "model.layers.0.mlp": "model.layers.1.mlp"}


def _alias_to_parent(c):
    c["compression"]["module_aliases"] = {"model.layers.0.mlp.down_proj": "model.layers.0"}


# case -> (base folder, what is done to it: ("tensors" | "config" | "folder", function), the message all three loads give)
CASES = {
    "codebook shorter than the indices imply": ("palettized", ("tensors", lambda t: t.__setitem__(
        f"{LAYER}.codebook", t[f"{LAYER}.codebook"][:, :8].clone())), r"codebook' is \[64, 8, 1\]"),
    "outlier position past the weight": ("palettized", ("tensors", _outlier_past_the_end), r"outlier_index has positions outside"),
    "indices of another size": ("palettized", ("tensors", lambda t: t.__setitem__(
        f"{LAYER}.indices", t[f"{LAYER}.indices"][:-8].clone())), r"indices' is \[4088\]"),
    "indices stored as floats": ("palettized", ("tensors", lambda t: t.__setitem__(
        f"{LAYER}.indices", t[f"{LAYER}.indices"].float())), r"indices' is \[4096\] torch.float32"),
    "Huffman lengths of no prefix code": ("huffman", ("tensors", _huffman_lengths), r"not the lengths of a prefix code"),
    "Huffman blocks past the stream": ("huffman", ("tensors", lambda t: t[f"{LAYER}.huffman_blocks"].__setitem__(0, 2**30)),
                                       r"huffman_blocks point past the end"),
    "a module the model does not have": ("palettized", ("config", _rename_module("model.layers.9.mlp.down_proj")),
                                         r"model.layers.9.mlp.down_proj'?, which the base model"),
    "a dunder name": ("palettized", ("config", _rename_module("model.layers.0.__class__")), r"not a module path"),
    "an unknown layer type": ("palettized", ("config", lambda c: _modules(c)[LAYER].__setitem__("type", "FutureLinear")),
                              r"newer wscompress"),
    "an absurd shape": ("palettized", ("config", lambda c: _modules(c)[LAYER]["spec"].__setitem__("in_features", 2**39)),
                        r"not that of the module it replaces"),
    "an absurd rank": ("low_rank", ("config", lambda c: _modules(c)[LAYER]["spec"].__setitem__("rank", 2**30)),
                       r"rank 1073741824 is outside"),
    "an argument of the wrong type": ("palettized", ("config", lambda c: _modules(c)[LAYER]["spec"].__setitem__("bits", "4")),
                                      r"argument bits='4', which it does not take"),
    "a newer format version": ("palettized", ("config", lambda c: c["compression"].__setitem__("version", 99)),
                               r"format 99, newer than the 3 this code reads: upgrade wscompress"),
    "another format": ("palettized", ("config", lambda c: c["compression"].__setitem__("format", "99")),
                       r"compression.format is '99', not 'wscompress'.*upgrade wscompress"),
    "an alias cycle": ("palettized", ("config", _alias_loop), r"a cycle"),
    "a module aliased to its parent": ("palettized", ("config", _alias_to_parent), r"a cycle"),
    "a truncated weight file": ("palettized", ("folder", _truncate), r"truncated"),
    "a float16 table of another shape": ("half", ("tensors", lambda t: t.__setitem__(TABLE, t[TABLE][:500].clone())),
                                         r"bits16' is \[500, 64\] torch.int16"),
    "int8 scales of another shape": ("int8", ("tensors", lambda t: t.__setitem__(
        "model.embed_tokens.table.scale_bits", t["model.embed_tokens.table.scale_bits"][:, :1].clone())),
        r"scale_bits' is \[512, 1\] torch.int16"),
}


@pytest.fixture(scope="module")
def crafted(tmp_path_factory, tokenizer):
    """Every case's folder: case -> path (each made from a freshly written folder of its base)."""
    root = tmp_path_factory.mktemp("crafted")
    for name, stages in BASES.items():
        model = tiny_model("llama")
        wscompress.compress(model, stages, tokenizer, CALIBRATION)
        storage.save(model, tokenizer, root / "base" / name)
    out = {}
    for i, (case, (base, (where, change), _)) in enumerate(CASES.items()):
        folder = root / f"case{i}"
        shutil.copytree(root / "base" / base, folder)
        {"tensors": _tensors, "config": _config, "folder": lambda f, c: c(f)}[where](folder, change)
        out[case] = folder
    out["base"] = root / "base"
    return out


def test_the_untouched_folders_load(crafted):
    for name in BASES:
        wscompress.load(crafted["base"] / name, device="cpu")


@pytest.mark.parametrize("case", sorted(CASES))
def test_wscompress_load_refuses(case, crafted):
    with pytest.raises(UsageError, match=CASES[case][2]):
        wscompress.load(crafted[case], device="cpu")


@pytest.mark.parametrize("case", sorted(CASES))
def test_from_pretrained_refuses(case, crafted):
    from transformers import AutoModelForCausalLM

    with pytest.raises(ValueError, match=CASES[case][2]):
        AutoModelForCausalLM.from_pretrained(crafted[case])


TRY_EACH = WITHOUT_WSCOMPRESS.split("folders, ids, out")[0] + textwrap.dedent("""
    for name, folder in json.loads(sys.argv[1]).items():
        try:
            AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
        except Exception as err:  # noqa: BLE001 - each case says what it raised
            print(f"@{name}@ {type(err).__name__}: {err}".replace("\\n", " "))
        else:
            print(f"@{name}@ loaded")
""")


def test_trust_remote_code_refuses_without_wscompress(crafted, tmp_path):
    """The same checks run in the folder's own code, where wscompress is not installed; a folder
    without its modeling file is refused by transformers, naming the file."""
    no_code = tmp_path / "no_code"
    shutil.copytree(crafted["base"] / "palettized", no_code)
    (no_code / "modeling_wscompress.py").unlink()
    folders = {case: str(crafted[case]) for case in CASES} | {"no code": str(no_code)}
    done = run_without_wscompress(TRY_EACH, json.dumps(folders), tmp_path=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    said = dict(re.findall(r"@(.+?)@ (.*)", done.stdout))
    for case, (_, _, message) in CASES.items():
        assert said[case].startswith("ValueError") and re.search(message, said[case]), (case, said[case])
    assert said["no code"].startswith(("OSError", "EnvironmentError")) and "modeling_wscompress.py" in said["no code"]


def test_wscompress_load_never_runs_python_from_the_folder(crafted, tmp_path):
    folder = tmp_path / "planted"
    shutil.copytree(crafted["base"] / "low_rank", folder)
    marker = tmp_path / "ran"
    (folder / "modeling_wscompress.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    model, _ = wscompress.load(folder, device="cpu")
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]]))
    assert not marker.exists()
