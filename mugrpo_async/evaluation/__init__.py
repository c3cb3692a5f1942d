"""Evaluation: the benchmark registry, pass@k and per-benchmark summaries."""
