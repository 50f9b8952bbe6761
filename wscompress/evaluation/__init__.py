"""Measuring a model: perplexity, lm-eval tasks, generation samples, latency (``bench``), and the
reports, model cards and comparisons they are written into."""
