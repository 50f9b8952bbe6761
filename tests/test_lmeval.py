"""lm-eval through its Python API on in-memory models, with the shipped offline sentiment task."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from wscompress import compress
from wscompress.errors import UsageError
from wscompress.evaluation.lmeval import run_tasks, shipped_tasks, task_specs
from wscompress.evaluation.samples import generate_samples
from wscompress.recipe.load import load_recipe
from wscompress.workflow import step_eval

from conftest import SENTIMENT, WIKI_TEST, tiny_model

TASK = "wscompress_sentiment"


def test_sentiment_task_runs_offline_on_a_compressed_model(tokenizer):
    model = tiny_model("llama")
    compress(model, [{"method": "svd", "ratio": 0.3, "whitening": False, "targets": ["mlp"]}])
    out = run_tasks(model, tokenizer, [TASK], limit=6, batch_size=4, task_data={TASK: SENTIMENT})
    metrics = out[TASK]
    assert 0 <= metrics["acc"] <= 1 and 0 <= metrics["acc_norm"] <= 1 and "acc_stderr" in metrics


def test_local_task_yaml_resolves_data_next_to_it(tmp_path, tokenizer):
    """A task file copied elsewhere with its data finds the data relative to itself."""
    (tmp_path / "reviews.jsonl").write_text("\n".join(Path(SENTIMENT).read_text().splitlines()[:4]) + "\n")
    cfg = yaml.safe_load(shipped_tasks()[TASK].read_text())
    cfg.update(task="my_reviews", dataset_kwargs={"data_files": {"test": "reviews.jsonl"}})
    (tmp_path / "my_reviews.yaml").write_text(yaml.safe_dump(cfg))
    specs, folders = task_specs([str(tmp_path / "my_reviews.yaml"), "hellaswag"], {})
    assert specs[0]["dataset_kwargs"]["data_files"]["test"] == str((tmp_path / "reviews.jsonl").resolve())
    assert specs[1] == "hellaswag" and tmp_path.resolve() in folders
    out = run_tasks(tiny_model("llama"), tokenizer, [str(tmp_path / "my_reviews.yaml")])
    assert out["my_reviews"]["sample_len"] == 4


def test_task_errors_name_the_fix(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the shipped task's data travels beside its YAML: found from any folder
    assert task_specs([TASK], {})[0][0]["dataset_kwargs"]["data_files"]["test"] == SENTIMENT
    (tmp_path / "orphan.yaml").write_text("task: orphan\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
                                          "    test: gone.jsonl\noutput_type: loglikelihood\n")
    with pytest.raises(UsageError, match="eval.task_data.orphan"):
        task_specs([str(tmp_path / "orphan.yaml")], {})
    with pytest.raises(UsageError, match="not found"):
        task_specs([TASK], {TASK: str(tmp_path / "nope.jsonl")})
    with pytest.raises(UsageError, match="not a local task"):
        task_specs(["hellaswag"], {"hellaswag": SENTIMENT})
    with pytest.raises(UsageError, match="task file"):
        task_specs([str(tmp_path / "missing.yaml")], {})


def test_unknown_task_name_is_a_usage_error(tokenizer):
    with pytest.raises(UsageError, match="eval.tasks"):
        run_tasks(tiny_model("llama"), tokenizer, ["no_such_task_xyz"], limit=1)


def test_eval_step_reports_tasks_and_samples(tmp_path, tiny_dir):
    r = load_recipe(data={"model": {"path": str(tiny_dir())},
                          "eval": {"perplexity": [WIKI_TEST], "context_length": 32, "max_windows": 1, "tasks": [TASK],
                                   "task_data": {TASK: SENTIMENT}, "limit": 4, "prompts": ["The course was"], "max_new_tokens": 5},
                          "output": {"dir": str(tmp_path / "out")}})
    out = step_eval(r)
    assert out["tasks"][0]["task"] == TASK and 0 <= out["tasks"][0]["acc"] <= 1
    assert out["samples"][0]["prompt"] == "The course was" and isinstance(out["samples"][0]["model"], str)
    md = (tmp_path / "out" / "reports" / "eval.md").read_text()
    assert "## tasks" in md and "## samples" in md


def test_samples_are_greedy_and_deterministic(tokenizer):
    model = tiny_model("llama")
    a = generate_samples(model, tokenizer, ["def f(x):", "Hello"], max_new_tokens=6)
    assert a == generate_samples(model, tokenizer, ["def f(x):", "Hello"], max_new_tokens=6)
    assert len(tokenizer(a[0]["completion"], add_special_tokens=False).input_ids) <= 8


SUMMARY = "wscompress_summarization"


def test_rouge_l_of_the_summarization_task():
    from wscompress.evaluation.tasks.summarization import process_results

    doc = {"summary": "the bridge will close to cars next spring"}
    assert process_results(doc, [" the bridge will close to cars next spring\n"])["rougeL"] == pytest.approx(1.0)
    # LCS "the bridge close" = 3 words of 8 (reference) and 4 (prediction): F1 = 2PR/(P+R)
    assert process_results(doc, ["the old bridge closed"])["rougeL"] == pytest.approx(2 * 3 / 4 * 3 / 8 / (3 / 4 + 3 / 8))
    assert process_results(doc, ["seals on sandbanks"])["rougeL"] == 0.0


def test_summarization_task_runs_offline_and_scores_generations(tokenizer, tmp_path, monkeypatch):
    """The shipped generation task on a fixture passed through task_data: a real (tiny) model
    generates and is scored; a generator that returns the references scores ROUGE-L 1."""
    from lm_eval.models.huggingface import HFLM

    sample = shipped_tasks()[SUMMARY].with_name("summarization_sample.jsonl")
    fixture = tmp_path / "articles.jsonl"
    fixture.write_text("\n".join(sample.read_text().splitlines()[:3]) + "\n")
    out = run_tasks(tiny_model("llama"), tokenizer, [SUMMARY], task_data={SUMMARY: str(fixture)})
    assert out[SUMMARY]["sample_len"] == 3 and 0 <= out[SUMMARY]["rougeL"] <= 1
    monkeypatch.setattr(HFLM, "generate_until", lambda self, requests, disable_tqdm=False: [r.doc["summary"] for r in requests])
    out = run_tasks(tiny_model("llama"), tokenizer, [SUMMARY], task_data={SUMMARY: str(fixture)})
    assert out[SUMMARY]["rougeL"] == pytest.approx(1.0)


def test_lm_eval_cli_scores_a_compressed_folder(tmp_path, tokenizer):
    """The lm-eval command line, as users run it on a folder (`--model hf` with the folder's own
    code): it loads the weights variant through the folder's classes and scores the task."""
    import os
    import subprocess
    import sys

    from wscompress.io import storage

    model = tiny_model("llama")
    compress(model, [{"method": "kmeans", "bits": 4, "outliers": 0.01}], tokenizer,
             {"dataset": "pydoc", "num_samples": 4, "seq_len": 32, "batch_size": 2})
    storage.save(model, tokenizer, tmp_path / "model")
    tasks = Path(SENTIMENT).parent
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules"), "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    done = subprocess.run([sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args",
                           f"pretrained={tmp_path / 'model'},trust_remote_code=True", "--tasks", TASK, "--include_path",
                           str(tasks), "--limit", "4", "--device", "cpu", "--output_path", str(tmp_path / "results")],
                          cwd=tasks, env=env, capture_output=True, text=True, timeout=600)  # its data file is beside it
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"|{TASK}|" in done.stdout.replace(" ", "") and "acc" in done.stdout
