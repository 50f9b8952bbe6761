"""The command line through typer's CliRunner: success paths, reports, and exit code 2 on bad input."""

import json

import pytest
import yaml
from typer.testing import CliRunner

from wscompress.cli import app

from conftest import WIKI_TEST

runner = CliRunner()


def recipe(tmp_path, model_dir, **sections):
    data = {"model": {"path": str(model_dir)},
            "eval": {"perplexity": [WIKI_TEST], "context_length": 64, "max_windows": 3, "batch_size": 2},
            "output": {"dir": str(tmp_path / "out")}, **sections}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_help_lists_every_subcommand():
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    for cmd in ("calibrate", "compress", "finetune", "eval", "bench", "run", "export", "check"):
        assert cmd in result.output


def test_eval_writes_json_and_markdown(tmp_path, tiny_dir):
    path = recipe(tmp_path, tiny_dir("llama"))
    result = runner.invoke(app, ["eval", str(path), "--quiet"])
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "out" / "reports" / "eval.json").read_text())
    row = report["results"][0]
    assert row["ppl"] > 1 and row["tokens"] == 3 * 63
    assert row["source"] == "wiki.test.txt" and row["bos"] == "none"  # the file's name, not a cut path
    assert "wiki.test.txt" in result.output and "wik…" not in result.output
    assert report["environment"]["torch"] and report["recipe"]["eval"]["max_windows"] == 3
    assert "| model |" in (tmp_path / "out" / "reports" / "eval.md").read_text()


def test_set_override_and_output_option(tmp_path, tiny_dir):
    path = recipe(tmp_path, tiny_dir("gpt2"))
    result = runner.invoke(app, ["eval", str(path), "-q", "--set", "eval.max_windows=1", "-o", str(tmp_path / "o2")])
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "o2" / "reports" / "eval.json").read_text())
    assert report["results"][0]["tokens"] == 63


def test_bad_recipe_exits_2_with_one_message(tmp_path, tiny_dir):
    path = recipe(tmp_path, tiny_dir("llama"), calibration={"num_sample": 3})
    result = runner.invoke(app, ["eval", str(path)])
    assert result.exit_code == 2
    assert "calibration.num_sample" in result.output and "fix:" in result.output
    assert "Traceback" not in result.output
    assert not (tmp_path / "out").exists()


def test_missing_checkpoint_exits_2(tmp_path):
    path = recipe(tmp_path, tmp_path / "no-such-model")
    result = runner.invoke(app, ["eval", str(path)])
    assert result.exit_code == 2 and "not a checkpoint directory" in result.output


def test_unknown_method_exits_2(tmp_path, tiny_dir):
    path = recipe(tmp_path, tiny_dir("llama"), compress=[{"method": "zip"}])
    result = runner.invoke(app, ["check", str(path)])
    assert result.exit_code == 2 and "unknown method 'zip'" in result.output


def test_compress_without_stages_exits_2(tmp_path, tiny_dir):
    result = runner.invoke(app, ["compress", str(recipe(tmp_path, tiny_dir("llama")))])
    assert result.exit_code == 2 and "no stages" in result.output


def test_calibrate_writes_statistics(tmp_path, tiny_dir):
    path = recipe(tmp_path, tiny_dir("llama"), calibration={"dataset": "pydoc", "num_samples": 4, "seq_len": 32})
    result = runner.invoke(app, ["calibrate", str(path), "-q"])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "out" / "calibration" / "stats.json").is_file()
    report = json.loads((tmp_path / "out" / "reports" / "calibrate.json").read_text())
    assert report["modules"] == 4 * 7 and report["gram_matrices"] == 4 * 4  # q/k/v and gate/up share inputs


def test_saved_statistics_feed_a_multi_stage_compress(tmp_path, tiny_dir, monkeypatch):
    """Stage 0 reuses the saved statistics; stage 1 sees a changed model and recomputes."""
    from wscompress.pipeline import calibration

    path = recipe(tmp_path, tiny_dir("llama"), calibration={"dataset": "pydoc", "num_samples": 4, "seq_len": 32},
                  compress=[{"method": "svd", "ratio": 0.3, "targets": ["mlp"]},
                            {"method": "svd", "ratio": 0.3, "targets": ["self_attn"]}])
    assert runner.invoke(app, ["calibrate", str(path), "-q"]).exit_code == 0
    computed, real = [], calibration.collect_grams
    monkeypatch.setattr(calibration, "collect_grams", lambda model, batches, names, *a, **k: computed.append(names) or
                        real(model, batches, names, *a, **k))
    result = runner.invoke(app, ["compress", str(path), "-q"])
    assert len(computed) == 1 and all("self_attn" in n for n in computed[0])  # stage 1 only: stage 0 read the saved
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "out" / "reports" / "compress.json").read_text())
    assert [s["method"] for s in report["stages"]] == ["svd", "svd"]
    assert report["compressed"]["params"] < report["original"]["params"]


def test_target_matching_nothing_exits_2_without_output(tmp_path, tiny_dir):
    path = recipe(tmp_path, tiny_dir("llama"), compress=[{"method": "svd", "ratio": 0.3, "targets": ["no_such_proj"]}])
    result = runner.invoke(app, ["compress", str(path)])
    assert result.exit_code == 2 and "matches no module" in result.output
    assert not (tmp_path / "out" / "model").exists()


@pytest.mark.parametrize("sections,words", [
    ({"finetune": {"mode": "dkm", "dkm": {"no_such_option": 1}}}, "finetune.dkm.no_such_option: unknown key"),
    ({"finetune": {"mode": "lora", "lora_rank": 4}}, "moved to finetune.lora.rank"),
    ({"finetune": {"mode": "lora", "lora": {"targets": ["no_such_proj"]}}}, "finetune.lora.targets: pattern 'no_such_proj'"),
    ({"compress": [{"method": "kmeans", "targets": ["no_such_proj"]}]}, "pattern 'no_such_proj' matches no module"),
    ({"compress": [{"method": "kmeans", "cluster_dim": 3}]}, "cluster_dim=3 does not divide"),
    ({"compress": [{"method": "basis_sharing", "group_size": 9}]}, "group_size 9 exceeds the model's 4 layers"),
    ({"compress": [{"method": "cross_layer", "group_size": 2, "targets": ["mlp"]}]}, "compress.0.targets: unknown key"),
    ({"compress": [{"method": "gqa", "groups": 3}]}, "groups=3 does not divide the model's 2 key/value heads"),
    ({"compress": [{"method": "svd"}, {"method": "kmeans", "targets": ["no_such_proj"]}]}, "compress.1.targets"),
    # a later stage whose targets no stage before it replaces is checked whole, as the first is
    ({"compress": [{"method": "svd"}, {"method": "kmeans", "targets": ["lm_head"], "cluster_dim": 3}]},
     "cluster_dim=3 does not divide"),
    ({"compress": [{"method": "kmeans"}, {"method": "gqa", "groups": 3}]}, "groups=3 does not divide"),  # untargeted, later
    ({"eval": {"perplexity": ["pydoc"], "context_length": 4096}}, "eval.context_length 4096 exceeds the 2048 positions"),
])
def test_check_finds_every_mistake_before_any_work(tmp_path, tiny_dir, monkeypatch, sections, words):
    """``check`` (and every command before it starts) finds what a run met only mid-way, from
    the model's structure on the meta device: no weight is loaded for it."""
    from wscompress import workflow

    path = recipe(tmp_path, tiny_dir("llama"), **sections)
    monkeypatch.setattr(workflow, "load_model", lambda *a, **k: pytest.fail("weights were loaded"))
    result = runner.invoke(app, ["check", str(path)])
    assert result.exit_code == 2 and words in result.output and "fix:" in result.output, result.output
    assert "Traceback" not in result.output


def test_check_accepts_what_earlier_stages_create(tmp_path, tiny_dir):
    """A later stage may target the children an earlier one creates (the coefficients of a
    low-rank layer); ``check`` does not refuse it, and the run compresses them."""
    path = recipe(tmp_path, tiny_dir("llama"), calibration={"dataset": "pydoc", "num_samples": 4, "seq_len": 32},
                  compress=[{"method": "svd", "ratio": 0.3, "whitening": False},
                            {"method": "kmeans", "bits": 4, "targets": ["coeff"], "refit": False}])
    assert runner.invoke(app, ["check", str(path)]).exit_code == 0
    result = runner.invoke(app, ["compress", str(path), "-q"])
    assert result.exit_code == 0, result.output


def test_output_dir_that_is_a_file_exits_2(tmp_path, tiny_dir):
    path = recipe(tmp_path, tiny_dir("llama"))
    (tmp_path / "out").write_text("not a folder")
    for command in ("eval", "check"):
        result = runner.invoke(app, [command, str(path)])
        assert result.exit_code == 2 and f"{tmp_path / 'out'} is a file" in result.output, result.output
        assert "Traceback" not in result.output
    assert (tmp_path / "out").read_text() == "not a folder"


def test_pickle_only_checkpoint_is_refused(tmp_path, tiny_dir):
    import torch

    from conftest import tiny_model

    folder = tiny_dir("llama")
    (folder / "model.safetensors").unlink()
    torch.save(tiny_model("llama").state_dict(), folder / "pytorch_model.bin")
    result = runner.invoke(app, ["eval", str(recipe(tmp_path, folder))])
    assert result.exit_code == 2 and "pickle checkpoints are not loaded" in result.output
    assert "safetensors" in result.output.split("fix:")[1]


def test_missing_eval_source_is_found_before_compress_works(tmp_path, tiny_dir):
    path = recipe(tmp_path, tiny_dir("llama"), compress=[{"method": "svd", "whitening": False, "ratio": 0.3}],
                  eval={"perplexity": [str(tmp_path / "missing.txt")]})
    for command in ("run", "check"):
        result = runner.invoke(app, [command, str(path)])
        assert result.exit_code == 2 and "missing.txt" in result.output and "eval.perplexity" in result.output
    assert not (tmp_path / "out").exists()  # nothing was compressed or written


def test_missing_task_file_and_calibration_text_are_found_up_front(tmp_path, tiny_dir):
    path = recipe(tmp_path, tiny_dir("llama"), calibration={"dataset": str(tmp_path / "calib.txt")},
                  compress=[{"method": "svd", "ratio": 0.3}])
    result = runner.invoke(app, ["compress", str(path)])
    assert result.exit_code == 2 and "calibration.dataset" in result.output and "calib.txt" in result.output
    path = recipe(tmp_path, tiny_dir("llama"), eval={"tasks": [str(tmp_path / "task.yaml")]})
    result = runner.invoke(app, ["check", str(path)])
    assert result.exit_code == 2 and "task.yaml" in result.output


def test_run_evaluates_only_with_an_eval_section(tmp_path, tiny_dir):
    path = recipe(tmp_path, tiny_dir("llama"), compress=[{"method": "svd", "ratio": 0.3, "whitening": False}])
    data = yaml.safe_load(path.read_text())
    del data["eval"]
    path.write_text(yaml.safe_dump(data))
    result = runner.invoke(app, ["run", str(path), "-q"])
    assert result.exit_code == 0, result.output
    reports = tmp_path / "out" / "reports"
    assert (reports / "compress.json").is_file() and not (reports / "eval.json").exists()


def test_the_original_perplexity_is_computed_once(tmp_path, tiny_dir, monkeypatch):
    """Per (model, text, protocol): a second evaluation of the same original reads the cache;
    another protocol (window count) computes again."""
    from wscompress.evaluation import perplexity as ppl

    monkeypatch.setenv("WSCOMPRESS_CACHE", str(tmp_path / "cache"))
    path = recipe(tmp_path, tiny_dir("llama"))
    assert runner.invoke(app, ["eval", str(path), "-q"]).exit_code == 0
    first = json.loads((tmp_path / "out" / "reports" / "eval.json").read_text())["results"][0]
    calls = []
    real = ppl.perplexity
    monkeypatch.setattr(ppl, "perplexity", lambda *a, **k: calls.append(1) or real(*a, **k))
    assert runner.invoke(app, ["eval", str(path), "-q"]).exit_code == 0
    second = json.loads((tmp_path / "out" / "reports" / "eval.json").read_text())["results"][0]
    assert calls == [] and second["ppl"] == first["ppl"]
    assert runner.invoke(app, ["eval", str(path), "-q", "--set", "eval.max_windows=2"]).exit_code == 0
    assert calls == [1]
    # an entry that cannot be read is measured again, said, and written anew
    for entry in (tmp_path / "cache" / "perplexity").glob("*.json"):
        entry.write_text("{not json")
    result = runner.invoke(app, ["eval", str(path)])
    assert result.exit_code == 0 and "unreadable" in result.output and calls == [1, 1], result.output
    assert runner.invoke(app, ["eval", str(path), "-q"]).exit_code == 0 and calls == [1, 1]  # healed


def test_run_writes_a_model_card_with_the_measured_figures(tmp_path, tiny_dir):
    path = recipe(tmp_path, tiny_dir("llama"), compress=[{"method": "svd", "ratio": 0.3, "allocation": "uniform"}],
                  calibration={"dataset": "pydoc", "num_samples": 4, "seq_len": 32, "batch_size": 2},
                  bench={"batch_sizes": [1], "seq_lens": [8], "decode_tokens": 2, "warmup": 0, "repeats": 1})
    result = runner.invoke(app, ["run", str(path), "-q"])
    assert result.exit_code == 0, result.output
    card = (tmp_path / "out" / "model" / "README.md").read_text()
    meta, body = card.split("---\n")[1], card.split("---\n", 2)[2]
    assert yaml.safe_load(meta)["tags"] == ["wscompress", "svd"] and yaml.safe_load(meta)["library_name"] == "transformers"
    compress = json.loads((tmp_path / "out" / "reports" / "compress.json").read_text())
    evaluation = json.loads((tmp_path / "out" / "reports" / "eval.json").read_text())
    size = f"| compressed | {compress['compressed']['tensor_bytes'] / 2**20:.1f} |"  # size before and after, bytes first
    assert "| model | tensor MB | file MB | bits a weight | parameters |" in body and size in body, body
    import transformers

    import wscompress  # which versions wrote it, and how to get wscompress (no index page that does not exist)
    assert f"by wscompress {wscompress.__version__} (with transformers {transformers.__version__})" in body
    assert "http" not in body and "pip install <clone>" in body
    assert '"ratio": 0.3' in body and '"allocation": "uniform"' in body  # every option of the stage
    compressed_ppl = next(r["ppl"] for r in evaluation["results"] if r["model"] == "compressed")
    assert f"| {compressed_ppl:.4g} |" in body and "## Speed" in body and "decode tok/s b1 s8" in body
    # figures measured on another model than the folder holds now are left out
    runner.invoke(app, ["compress", str(path), "-q", "--set", "compress.0.ratio=0.5"])
    card = (tmp_path / "out" / "model" / "README.md").read_text()
    assert "## Size" in card and "## Perplexity" not in card and "## Speed" not in card and '"ratio": 0.5' in card


def test_export_hf_rewrites_a_folder_of_format_1(tmp_path, tiny_dir):
    """A folder written before config.json described the compression (base config.json plus
    wscompress.json) loads in wscompress and is rewritten as a folder transformers loads."""
    import torch
    from transformers import AutoModelForCausalLM

    import wscompress

    path = recipe(tmp_path, tiny_dir("llama"), compress=[{"method": "kmeans", "bits": 4, "entropy_coding": True}],
                  calibration={"dataset": "pydoc", "num_samples": 4, "seq_len": 32, "batch_size": 2})
    assert runner.invoke(app, ["compress", str(path), "-q"]).exit_code == 0
    old = tmp_path / "out" / "model"
    config = json.loads((old / "config.json").read_text())
    (old / "wscompress.json").write_text(json.dumps({"format": "wscompress", "version": 1, **config["compression"]}))
    (old / "config.json").write_text(json.dumps({**config["base_config"], "torch_dtype": "float32", "dtype": "float32"}))
    (old / "modeling_wscompress.py").unlink()
    (old / "model.wscompress.safetensors").rename(old / "model.safetensors")  # format 1's name
    ids = torch.randint(0, 512, (1, 12))
    with torch.no_grad():
        want = wscompress.load(old, device="cpu")[0](ids).logits
    result = runner.invoke(app, ["export", str(old), str(tmp_path / "hf"), "--format", "hf", "-q"])
    assert result.exit_code == 0, result.output
    with torch.no_grad():
        torch.testing.assert_close(AutoModelForCausalLM.from_pretrained(tmp_path / "hf")(ids).logits, want)
    assert (tmp_path / "hf" / "README.md").is_file() and (tmp_path / "hf" / "modeling_wscompress.py").is_file()
    assert runner.invoke(app, ["export", str(old), str(tmp_path / "dense"), "-q"]).exit_code == 0
    with torch.no_grad():
        torch.testing.assert_close(AutoModelForCausalLM.from_pretrained(tmp_path / "dense")(ids).logits, want,
                                   rtol=1e-5, atol=1e-5)


def test_reports_say_when_they_run_from_a_source_tree(monkeypatch):
    """A source tree on PYTHONPATH (as on a lent GPU machine) has no installed metadata: reports
    say so instead of failing the step after its work is done."""
    from importlib.metadata import PackageNotFoundError

    from wscompress.evaluation import report

    def missing(name):
        raise PackageNotFoundError(name)

    monkeypatch.setattr(report, "version", missing)
    assert report.environment()["wscompress"] == "source tree, not installed"


def test_a_run_stopped_by_sigterm_leaves_nothing_behind(tmp_path, tiny_dir):
    """SIGTERM (a cancelled CI job) mid-stage: no half-written model, no scratch statistics
    beside the output, no spill folder, and the exit code of a terminated process."""
    import os
    import signal
    import subprocess
    import sys
    import time

    spill = tmp_path / "spill"
    path = recipe(tmp_path, tiny_dir("llama"), model={"path": str(tmp_path / "tiny-llama"), "offload": "disk",
                                                      "offload_folder": str(spill)},
                  calibration={"dataset": "pydoc", "num_samples": 256, "seq_len": 128},
                  compress=[{"method": "svd", "ratio": 0.3}])
    run = subprocess.Popen([sys.executable, "-m", "wscompress.cli", "compress", str(path), "-q"],
                           cwd=tmp_path)
    deadline = time.monotonic() + 120
    while not list((tmp_path / "out").glob(".stats-*")) and run.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert run.poll() is None, "the run ended before its statistics were collected"
    run.send_signal(signal.SIGTERM)
    assert run.wait(timeout=60) == 128 + signal.SIGTERM
    assert not spill.exists()
    assert not (tmp_path / "out").exists() or not [p.name for p in (tmp_path / "out").iterdir() if p.name != "reports"]
