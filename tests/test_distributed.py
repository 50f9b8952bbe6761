"""Several processes (torchrun, gloo on the CPU): the same numbers as one process."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
import torch
import yaml
from safetensors.torch import load_file

from wscompress.io import storage
from wscompress.pipeline.stats import Stats


def launch(args: list[str], processes: int, cwd) -> subprocess.CompletedProcess:
    """``wscompress ARGS`` under torchrun with ``processes`` CPU processes (one without)."""
    with socket.socket() as s:  # a free port for the rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    runner = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={processes}", f"--master_port={port}",
              "-m", "wscompress.cli"] if processes > 1 else [sys.executable, "-m", "wscompress.cli"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    done = subprocess.run(runner + args + ["-q"], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done


def recipe(tmp_path, model_dir, **sections) -> str:
    data = {"model": {"path": str(model_dir), "device": "cpu"},
            "calibration": {"dataset": "pydoc", "num_samples": 8, "seq_len": 32, "batch_size": 2},
            "compress": [{"method": "svd", "ratio": 0.3, "sensitivity_samples": 4}],
            "eval": {"perplexity": ["pydoc"], "context_length": 64, "max_windows": 6, "batch_size": 1}, **sections}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_calibration_over_two_processes_equals_one(tmp_path, tiny_dir):
    """Each rank takes its share of the batches (and of the sensitivity sequences); the sums
    over ranks are the single-process statistics to 1e-10."""
    path = recipe(tmp_path, tiny_dir("llama"))
    launch(["calibrate", path, "-o", str(tmp_path / "one")], 1, tmp_path)
    launch(["calibrate", path, "-o", str(tmp_path / "two")], 2, tmp_path)
    one, two = Stats(tmp_path / "one" / "calibration"), Stats(tmp_path / "two" / "calibration")
    assert one.owner == two.owner and set(one) == set(two) and len(one) == 16
    for name in one:
        torch.testing.assert_close(two[name], one[name], rtol=1e-10, atol=1e-10 * one[name].abs().max().item())
    assert two.sensitivity == pytest.approx(one.sensitivity, rel=1e-10)
    assert not list(tmp_path.glob("two/.calibration*"))  # the temporary folder was swapped in


def test_ddp_finetune_step_equals_one_process(tmp_path, tiny_dir):
    """One DDP step over two processes (each half of the global batch) gives the weights of one
    process's step on the whole batch."""
    path = recipe(tmp_path, tiny_dir("llama"), finetune={"mode": "full", "steps": 1, "batch_size": 4, "seq_len": 32,
                                                         "lr": 1e-3, "dataset": "pydoc", "eval_windows": 2})
    launch(["finetune", path, "-o", str(tmp_path / "one")], 1, tmp_path)
    launch(["finetune", path, "-o", str(tmp_path / "two")], 2, tmp_path)
    one, two = (load_file(tmp_path / run / "model" / storage.WEIGHTS) for run in ("one", "two"))
    assert one.keys() == two.keys()
    moved = load_file(next((tmp_path).glob("tiny-llama/*.safetensors")))
    assert any(not torch.equal(one[k], moved[k]) for k in one if k in moved)  # the step did something
    for k in one:  # Adam moves every weight by ~lr (1e-3) in its first step: agree to 1 % of that
        torch.testing.assert_close(two[k], one[k], rtol=0, atol=1e-5)


def test_eval_over_two_processes_equals_one(tmp_path, tiny_dir):
    import json

    path = recipe(tmp_path, tiny_dir("llama"))
    reports = {}
    for n in (1, 2):
        launch(["eval", path, "-o", str(tmp_path / f"eval{n}")], n, tmp_path)
        reports[n] = json.loads((tmp_path / f"eval{n}" / "reports" / "eval.json").read_text())["results"][0]
    assert reports[2]["tokens"] == reports[1]["tokens"]
    assert reports[2]["ppl"] == pytest.approx(reports[1]["ppl"], rel=1e-6)


@pytest.mark.parametrize("gpus, processes, auto, cuda", [
    (0, 1, "cpu", "no CUDA device"), (1, 1, "cuda:0", "cuda:0"), (2, 2, "cuda:1", "cuda:1"),
    (1, 2, "cpu", "torchrun --nproc_per_node 1")])
def test_each_process_takes_its_own_gpu_or_the_cpu(monkeypatch, gpus, processes, auto, cuda):
    """A launch with more processes on a machine than GPUs runs `auto` on the CPU (rank 1 asked
    for a second GPU that a one-GPU machine does not have) and refuses an explicit `cuda`."""
    from wscompress.errors import UsageError
    from wscompress.io.hardware import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(processes))
    monkeypatch.setenv("LOCAL_RANK", str(processes - 1))
    assert str(resolve_device("auto")) == auto
    if cuda.startswith("cuda:"):
        assert str(resolve_device("cuda")) == cuda
    else:
        with pytest.raises(UsageError, match=cuda):
            resolve_device("cuda")
