"""Multiple-choice benchmarks scored by log-likelihood (the lm-eval conventions).

A task is a JSONL file, one example per line: {"context": str, "choices": [str],
"gold": int}. Each choice is scored by the summed log-probability of its tokens
given the context; `acc` takes the highest sum, `acc_norm` the highest sum per
byte of the choice text (lm-eval's length normalisation). The same files feed
the data pipeline's decontamination.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch


@dataclass(frozen=True)
class Example:
    context: str
    choices: tuple[str, ...]
    gold: int


def load_task(path: str | Path) -> list[Example]:
    """Read and check a task file; a bad line stops with its file and line number."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"task file {str(path)!r}: no such file")
    examples = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            ex = Example(str(rec["context"]), tuple(str(c) for c in rec["choices"]), int(rec["gold"]))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise ValueError(f"task file {str(path)!r} line {n}: expected {{context, choices, gold}} ({e})") from None
        if not 0 <= ex.gold < len(ex.choices) or len(ex.choices) < 2:
            raise ValueError(f"task file {str(path)!r} line {n}: gold {ex.gold} with {len(ex.choices)} choices")
        examples.append(ex)
    if not examples:
        raise ValueError(f"task file {str(path)!r}: no examples")
    return examples


LogLikelihood = Callable[[Sequence[int], Sequence[int]], float]


@torch.no_grad()
def model_loglikelihood(model, device: torch.device, max_len: int) -> LogLikelihood:
    """log p(continuation | context) under `model` (left-truncated to `max_len` tokens)."""

    def score(context: Sequence[int], continuation: Sequence[int]) -> float:
        ids = (list(context) + list(continuation))[-(max_len + 1):]
        n_cont = min(len(continuation), len(ids) - 1)
        x = torch.tensor(ids[:-1], device=device)[None]
        logits = model(x)[0, -n_cont:].double()
        targets = torch.tensor(ids[-n_cont:], device=device)
        return float(torch.log_softmax(logits, dim=-1).gather(1, targets[:, None]).sum())

    return score


def score_task(examples: Sequence[Example], encode: Callable[[str], list[int]], loglikelihood: LogLikelihood) -> dict[str, float]:
    """-> {"acc", "acc_norm", "n"} over the examples."""
    correct = correct_norm = 0
    for ex in examples:
        ctx = encode(ex.context)
        scores = [loglikelihood(ctx, encode(choice)) for choice in ex.choices]
        per_byte = [s / max(1, len(c.encode())) for s, c in zip(scores, ex.choices)]
        correct += int(max(range(len(scores)), key=scores.__getitem__) == ex.gold)
        correct_norm += int(max(range(len(per_byte)), key=per_byte.__getitem__) == ex.gold)
    n = len(examples)
    return {"acc": correct / n, "acc_norm": correct_norm / n, "n": float(n)}
