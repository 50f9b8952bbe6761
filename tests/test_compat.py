"""Folders keep loading: a folder written with today's transformers loads with the oldest
transformers ``pyproject.toml`` claims and with the newest in the registry, through all three
loads, and a folder written there loads here. ``make test-compat`` makes a small virtual
environment per bound (transformers alone; torch and wscompress come from the main one) and
names their Pythons in WSCOMPRESS_COMPAT_PYTHONS; ``.ci/run`` calls it after ``make test``."""

from __future__ import annotations

import json
import os
import re
import subprocess
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import wscompress
from wscompress.io import storage

from conftest import REPO, kernel_tolerance, tiny_model
from test_transformers import CALIBRATION, FORMS, INPUT, WITHOUT_WSCOMPRESS, logits_of

PYTHONS = os.environ.get("WSCOMPRESS_COMPAT_PYTHONS", "").split()
pytestmark = pytest.mark.skipif(not PYTHONS, reason="`make test-compat` runs these, one virtual environment per bound")

# In the bound's environment, with wscompress: both of its loads of every folder, then a model
# compressed and saved there (with transformers' save_pretrained and with wscompress's own).
WITH = textwrap.dedent("""
    import json, sys, warnings
    warnings.simplefilter("error", FutureWarning)  # an internal going away, announced by a transformers we use
    warnings.simplefilter("error", DeprecationWarning)
    sys.path.insert(0, sys.argv[4])
    import torch, transformers, wscompress
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM
    from conftest import make_tokenizer, tiny_model
    from wscompress.io import storage

    folders, ids, out = json.loads(sys.argv[1]), load_file(sys.argv[2])["ids"], sys.argv[3]
    logits = {}
    with torch.no_grad():
        for name, folder in folders.items():
            logits[f"{name} from_pretrained"] = AutoModelForCausalLM.from_pretrained(folder)(ids).logits.contiguous()
            logits[f"{name} load"] = wscompress.load(folder, device="cpu")[0](ids).logits.contiguous()
    model = tiny_model("llama")
    tokenizer = make_tokenizer()
    stages = [{"method": "svd", "ratio": 0.3}, {"method": "kmeans", "bits": 4, "outliers": 0.01}]
    wscompress.compress(model, stages, tokenizer, {"dataset": "pydoc", "num_samples": 4, "seq_len": 32, "batch_size": 2})
    model.save_pretrained(out + "/written_there")
    storage.save(model, tokenizer, out + "/saved_there")
    with torch.no_grad():
        logits["written there"] = model(ids).logits.contiguous()
    save_file(logits, out + "/logits.safetensors")
    print("@transformers@", transformers.__version__)
""")

# The same bound, where wscompress cannot be imported: each folder through the code it carries
WITHOUT = WITHOUT_WSCOMPRESS + textwrap.dedent("""
    import transformers
    print("@transformers@", transformers.__version__)
""")


def _run(python: str, script: str, *args: str, tmp_path: Path) -> str:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_MODULES_CACHE=str(tmp_path / "hf_modules"), HF_HUB_OFFLINE="1", HF_HUB_DISABLE_PROGRESS_BARS="1")
    done = subprocess.run([python, "-c", script, *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return re.search(r"@transformers@ (\S+)", done.stdout).group(1)


@pytest.fixture(scope="module")
def written(tmp_path_factory, tokenizer):
    """Every form compressed and saved with today's transformers: (folders, their logits, input file)."""
    root = tmp_path_factory.mktemp("written_here")
    folders, logits = {}, {}
    for name, (kind, stages) in FORMS.items():
        model = tiny_model(kind)
        wscompress.compress(model, stages, tokenizer, CALIBRATION)
        storage.save(model, tokenizer, root / name)
        folders[name], logits[name] = str(root / name), logits_of(model)
    save_file({"ids": INPUT}, root / "ids.safetensors")
    return folders, logits, root / "ids.safetensors"


def _claimed_oldest() -> str:
    return re.search(r'"transformers>=([0-9.]+)', (REPO / "pyproject.toml").read_text()).group(1)


@pytest.mark.parametrize("python", PYTHONS)
def test_folders_load_both_ways_across_transformers_versions(python, written, tmp_path):
    from transformers import AutoModelForCausalLM

    folders, want, ids = written
    there = _run(python, WITH, json.dumps(folders), str(ids), str(tmp_path), str(REPO / "tests"), tmp_path=tmp_path)
    got = load_file(tmp_path / "logits.safetensors")
    for name, logits in want.items():
        for how in ("from_pretrained", "load"):
            torch.testing.assert_close(got[f"{name} {how}"], logits, rtol=1e-5, atol=1e-5, msg=f"{name} {how} ({there})")
    (tmp_path / "remote").mkdir()
    again = _run(python, WITHOUT, json.dumps(folders), str(ids), str(tmp_path / "remote" / "logits.safetensors"),
                 tmp_path=tmp_path / "remote")
    remote = load_file(tmp_path / "remote" / "logits.safetensors")
    for name, logits in want.items():  # no kernels there: the torch path, to the kernels' logits
        atol = kernel_tolerance(wscompress.load(folders[name], device="cpu")[0])
        torch.testing.assert_close(remote[name], logits, rtol=1e-5, atol=atol, msg=f"{name} trust_remote_code ({there})")
    # written there, loaded here: both writers' folders, with this transformers
    for folder in ("written_there", "saved_there"):
        with torch.no_grad():
            here = AutoModelForCausalLM.from_pretrained(tmp_path / folder)(INPUT).logits
        torch.testing.assert_close(here, got["written there"], rtol=1e-5, atol=1e-5)
        config = json.loads((tmp_path / folder / "config.json").read_text())
        assert config["transformers_version"] == there and config["wscompress_version"] == wscompress.__version__
    assert there == again
    if python == PYTHONS[0]:  # make test-compat names the oldest bound first
        assert there == _claimed_oldest() or there == _claimed_oldest() + ".0", there
