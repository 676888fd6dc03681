"""Evaluation: validation loss on held-out data and multiple-choice benchmarks scored by log-likelihood."""
