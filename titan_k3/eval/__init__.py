"""Evaluation: validation loss on held-out data and multiple-choice benchmarks scored by log-likelihood.

In training: `runner.Evaluator` (every eval.interval updates and at the end, into metrics.jsonl).
Offline: `python -m titan_k3.eval` (offline.py) on one checkpoint or every checkpoint of a run.
"""
