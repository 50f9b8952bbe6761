"""Scoring of the ``wscompress_summarization`` lm-eval task: ROUGE-L F1 of the generated
summary against the reference (Lin 2004; the rouge-score package, stemmed, as the
summarization papers report it)."""

from __future__ import annotations

from rouge_score import rouge_scorer

_SCORER = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)


def process_results(doc: dict, results: list[str]) -> dict[str, float]:
    return {"rougeL": _SCORER.score(doc["summary"], results[0].strip())["rougeL"].fmeasure}
