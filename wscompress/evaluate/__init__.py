"""Evaluation: perplexity, lm-eval tasks, generation samples, latency benchmarks."""
