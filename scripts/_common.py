"""What the benchmarks of scripts/ share: argument parsing, a `wscompress` step run as a user runs
it, one-shot compression of a copy, the protocol's perplexities, Markdown tables and results
files, and the toy model their ``--dry-run`` compresses, evaluates and times in seconds."""

from __future__ import annotations

import argparse
import copy
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
# the dry runs' model: LLaMA-shaped, every shipped layout fits it (k/v 64 rows: a codebook per 64 channels)
TOY = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def parser(doc: str, out: str | None = None, threads: int | None | bool = False) -> argparse.ArgumentParser:
    """An argument parser described by the first line of the script's docstring ``doc``; with
    ``--out`` (default outputs/``out``) where ``out`` is given, and ``--threads N`` (torch's CPU
    threads, set by ``parse``; default ``threads``, None: torch's own) unless ``threads`` is False."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    if out is not None:
        ap.add_argument("--out", type=Path, default=REPO / "outputs" / out)
    if threads is not False:
        ap.add_argument("--threads", type=int, default=threads, help="torch's CPU threads")
    return ap


def parse(ap: argparse.ArgumentParser) -> argparse.Namespace:
    """``ap``'s arguments, torch's CPU threads set from a single ``--threads`` where it is given."""
    args = ap.parse_args()
    if isinstance(getattr(args, "threads", None), int):
        torch.set_num_threads(args.threads)
    return args


def cpu_line() -> str:
    """The CPU's model and vector flags, for a table's heading."""
    from wscompress.io.hardware import cpu_name, vector_flags

    return f"{cpu_name()}, flags: {vector_flags()}"


def markdown(rows: list[dict], cols: list[str] | None = None) -> str:
    """``rows`` as a Markdown table of ``cols`` (default: every key, in order of appearance): a
    float to 6 significant digits (the scripts round their own figures; a report's raw ones need
    it), a missing value blank."""
    cols = cols or list(dict.fromkeys(k for r in rows for k in r))

    def line(cells) -> str:  # a | of a cell's own is escaped
        return "| " + " | ".join((f"{c:.6g}" if isinstance(c, float) else str(c)).replace("|", "\\|") for c in cells) + " |"

    return "\n".join([line(cols), "|" + "---|" * len(cols), *(line("" if r.get(c) is None else r[c] for c in cols)
                                                             for r in rows)])


def write_results(out: Path, payload: dict, md: str, stem: str = "results") -> None:
    """``payload`` as ``out/<stem>.json`` and ``md`` as ``out/<stem>.md``. Scripts that run long
    call it after every row, so an interrupted run keeps what it measured."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(payload, indent=1, default=str))
    (out / f"{stem}.md").write_text(md + "\n")


def wscompress(*args: str) -> float:
    """The ``wscompress`` command in a fresh process, quiet, as a user runs it (its console
    script sets its process up, which ``python -m`` would not); its wall seconds."""
    start = time.perf_counter()
    subprocess.run([str(Path(sys.executable).parent / "wscompress"), *args, "-q"], cwd=REPO, check=True)
    return time.perf_counter() - start


def step(command: str, recipe: Path | str, out: Path, sets: list[str] = ()) -> dict:
    """One step (calibrate, compress, finetune, eval, bench) of ``recipe`` into ``out`` with the
    overrides ``sets``, in a fresh process; its report, with its wall seconds as ``wall_s``."""
    seconds = wscompress(command, str(recipe), "-o", str(out), *(a for s in sets for a in ("--set", s)))
    return {**json.loads((out / "reports" / f"{command}.json").read_text()), "wall_s": seconds}


def compressed_copy(model: torch.nn.Module, tokenizer, recipe, stages: list[dict]) -> tuple[torch.nn.Module, list[dict], float]:
    """A copy of ``model`` compressed by ``stages`` with ``recipe``'s calibration (statistics a
    `wscompress calibrate` saved in its output are reused): (the copy, the stages' reports, seconds)."""
    from wscompress.recipe.load import load_recipe
    from wscompress.workflow import apply_stages

    copied, run = copy.deepcopy(model), recipe.model_copy()
    run.compress = load_recipe(data={"compress": stages}).compress
    start = time.perf_counter()
    reports = apply_stages(copied, tokenizer, run)
    return copied, reports, time.perf_counter() - start


def perplexities(model: torch.nn.Module, tokenizer, texts: list[str], windows: int, bos: str = "auto") -> dict[str, float]:
    """Perplexity on the first ``windows`` windows of 512 tokens of each text, as the protocol
    scores it, by the text's file name (wiki.test, brown)."""
    from wscompress.evaluation.perplexity import evaluate_text
    from wscompress.io.data import source_label

    model.eval()
    return {Path(source_label(t)).stem: round(evaluate_text(model, tokenizer, t, 512, None, 4, windows, bos,
                                                            label=f"ppl {source_label(t)}")["ppl"], 2) for t in texts}


def toy_model(folder: Path, vocab: int = 512) -> Path:
    """A LLaMA of the ``TOY`` shape with random weights and a tokenizer of one token a character
    (the first ``vocab`` - 3 code points), saved in ``folder`` once with ``calibration.txt`` (the
    start of wiki.train, which tokenizes in a moment): what a dry run uses instead of SmolLM2,
    built in a second with nothing downloaded."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from wscompress.io.data import load_text

    if (folder / "config.json").is_file():
        return folder
    specials = {"<unk>": 0, "<s>": 1, "</s>": 2}
    chars = {chr(i): i + 3 for i in range(vocab - 3)}
    tok = Tokenizer(models.WordLevel(vocab={**specials, **chars}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                        pad_token="</s>")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=True, **TOY)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    (folder / "calibration.txt").write_text(load_text("builtin:wiki.train")[:50_000])
    return folder


def toy_sets(folder: Path) -> list[str]:
    """Recipe overrides that run a recipe on the toy model in ``folder``: a few short calibration
    windows of its calibration text, one evaluation window a text."""
    return [f"model.path={folder}", f"calibration.dataset={folder / 'calibration.txt'}", "calibration.num_samples=4",
            "calibration.seq_len=64", "calibration.batch_size=2", "eval.max_windows=1"]
