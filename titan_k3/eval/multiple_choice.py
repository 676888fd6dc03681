"""Multiple-choice benchmarks scored by log-likelihood (the lm-eval conventions).

A task is a JSONL file, one example per line: {"context": str, "choices": [str],
"gold": int} (read by tasks.py). Each choice is scored by the summed log-probability of its tokens
given the context (context and choice tokenised separately, then joined);
`acc` takes the highest sum, `acc_norm` the highest sum per character of the
choice text (lm-eval's length normalisation). Ties go to the first choice. The
same files feed the data pipeline's decontamination.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from titan_k3.eval.tasks import Example, iter_examples, where

IGNORE_INDEX = -100


def load_task(path: str | Path) -> list[Example]:
    """Read and check a task file (tasks.iter_examples), with at least two non-empty choices per line given a
    non-empty context; a bad line stops with its file and line number."""
    examples = []
    for n, ex in iter_examples(path):
        if len(ex.choices) < 2:
            raise ValueError(f"{where(path, n)}: gold = {ex.gold} with {len(ex.choices)} choices (need >= 2 choices, "
                             "0 <= gold < choices)")
        if not ex.context or not all(ex.choices):
            raise ValueError(f"{where(path, n)}: empty context or choice (a choice is scored given a non-empty context)")
        examples.append(ex)
    if not examples:
        raise ValueError(f"task file {str(path)!r}: no examples")
    return examples


LogLikelihood = Callable[[Sequence[int], Sequence[Sequence[int]]], list[float]]
"""(context tokens, [continuation tokens per choice]) -> log p(continuation | context) per choice."""


def model_loglikelihood(model, device: torch.device, max_len: int, pad_to: int = 1, autocast=None) -> LogLikelihood:
    """log p(continuation | context) under `model`, one forward per choice.

    The row is context + continuation, left-truncated to `max_len` inputs and
    right-padded to a multiple of `pad_to` (the KDA kernels want whole chunks;
    the model is causal, so padding after the last target changes nothing).
    Only the continuation's targets carry labels, so the model's own loss path
    returns -log p(continuation) without materialising [T, V] logits.
    Every rank of a sharded model must call it with the same inputs.
    """
    if max_len < 1 or pad_to < 1:
        raise ValueError(f"max_len={max_len}, pad_to={pad_to}: both must be >= 1")

    @torch.no_grad()
    def score(context: Sequence[int], continuations: Sequence[Sequence[int]]) -> list[float]:
        if not context or not all(continuations):
            raise ValueError("model_loglikelihood: context and every continuation need at least one token")
        was_training = model.training
        model.eval()
        try:
            return [_one(list(context) + list(cont), len(cont)) for cont in continuations]
        finally:
            model.train(was_training)

    def _one(ids: list[int], n_cont: int) -> float:
        ids = ids[-(max_len + 1):]
        T = len(ids) - 1
        n_cont = min(n_cont, T)
        T_pad = -(-T // pad_to) * pad_to
        x = torch.zeros(1, T_pad, dtype=torch.long)
        y = torch.full((1, T_pad), IGNORE_INDEX, dtype=torch.long)
        x[0, :T] = torch.tensor(ids[:-1])
        y[0, T - n_cont:T] = torch.tensor(ids[T - n_cont + 1:])
        ctx = autocast if autocast is not None else torch.autocast(device.type, enabled=False)
        with ctx:
            out = model(x.to(device), y.to(device))
        return -float(out.loss_sum.double())

    return score


def score_task(examples: Sequence[Example], encode: Callable[[str], list[int]], loglikelihood: LogLikelihood) -> dict[str, float]:
    """-> {"acc", "acc_norm", "n"} over the examples."""
    correct = correct_norm = 0
    for ex in examples:
        scores = loglikelihood(encode(ex.context), [encode(choice) for choice in ex.choices])
        per_char = [s / len(c) for s, c in zip(scores, ex.choices)]
        correct += int(_argmax(scores) == ex.gold)
        correct_norm += int(_argmax(per_char) == ex.gold)
    n = len(examples)
    return {"acc": correct / n, "acc_norm": correct_norm / n, "n": float(n)}


def _argmax(values: Sequence[float]) -> int:
    return max(range(len(values)), key=values.__getitem__)
