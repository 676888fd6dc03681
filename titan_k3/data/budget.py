"""What a run reads: the dataset's identity and size, and how many epochs of it the run takes.

The start-up report prints it, manifest.json records it (key "dataset"), and a run
that reads any source more than once emits a `data_epochs` warning event: a corpus
looped many times is memorised, not learned, and the loss says nothing of it.

Units: tokens are input tokens of the training split (a sequence of T inputs reads
T tokens of its source's stream; see loader.py). Epochs of a source are the tokens
the run takes from it (its mixture weight x the run's tokens) over the tokens it has.

Torch-free.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from titan_k3.config.validate import parse_context_stages, seq_len_at


def content_sha256(index: dict) -> str:
    """sha256 of a dataset's content, from its index: every split's shard records (each with the sha256
    of its tokens and offsets) and the tokenizer's identity. Two datasets share it only if their shards do.

    NOTE: the shards' own hashes are the index's; open_dataset checks them against the files for datasets
    under 256 MiB and only sizes above, so this hashes the index, not terabytes of tokens.
    """
    ident = {"splits": index["splits"], "tokenizer": index["tokenizer"].get("sha256"), "dtype": index["dtype"]}
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()


def run_tokens(*, steps: int, seq_len: int, context_stages: str, local_batch_size: int, grad_accum: int,
               dp_world: int, done_steps: int = 0, done_tokens: int = 0) -> int:
    """Input tokens the whole run trains on: `done_tokens` of its first `done_steps` updates (a resumed run's,
    as its checkpoint counted them) plus, over each update after those, batch x seq_len(update) x accum x dp.

    NOTE: a resume on another number of ranks trains at another rate per update; the updates already done
    keep the tokens they had.
    """
    stages = parse_context_stages(context_stages) if context_stages else []
    rows = local_batch_size * grad_accum * dp_world
    first = done_steps + 1
    bounds = sorted({first, max(first, steps + 1), *(start for start, _ in stages if first < start <= steps)})
    return done_tokens + sum(rows * seq_len_at(a, seq_len, stages) * (b - a) for a, b in zip(bounds, bounds[1:]))


def epochs_per_source(tokens_per_source: dict[str, int], weights: dict[str, float], total: int) -> dict[str, float]:
    """{source: epochs of it that `total` run tokens take}, the run's tokens split by the mixture weights."""
    return {name: total * weights[name] / n for name, n in tokens_per_source.items() if weights.get(name, 0) > 0}


def describe_run_data(dataset: dict[str, Any], *, total_tokens: int, fixed_batch: bool) -> dict[str, Any]:
    """The manifest's "dataset" record: the dataset's description plus the run's tokens and epochs.

    dataset: DataLoader.describe() (name, sha256, tokens, tokens_per_source, weights).
    A fixed-batch run repeats one batch by design; it has no epochs.
    """
    out = dict(dataset, run_tokens=total_tokens)
    if fixed_batch:
        out["epochs"] = None
        return out
    per_source = epochs_per_source(dataset["tokens_per_source"], dataset["weights"], total_tokens)
    out["epochs_per_source"] = {k: round(v, 4) for k, v in per_source.items()}
    out["epochs"] = round(max(per_source.values()), 4)
    return out


def _epochs(x: float) -> str:
    """Epochs for the start-up line: two decimals, or two significant digits below 0.01 (a probe's 0.0024 read 0.00)."""
    return f"{x:,.2f}" if x >= 0.01 or x == 0 else f"{x:.2g}"


def report_lines(data: dict[str, Any]) -> tuple[str, str | None]:
    """(the start-up line, the warning when the run reads a source more than once, else None)."""
    sources = ", ".join(f"{k} {v:,}" for k, v in data["tokens_per_source"].items())
    line = (f"data: {data['dataset']} (sha256 {data['sha256'][:12]}, {data['tokens']:,} training tokens: {sources}) | "
            f"the run trains on {data['run_tokens']:,} tokens")
    if data["epochs"] is None:
        return line + " of one repeated batch (training.fixed_batch)", None
    per_source = data["epochs_per_source"]
    uneven = len(set(per_source.values())) > 1
    line += f" = {_epochs(data['epochs'])} epochs" + (" (" + ", ".join(f"{k} {_epochs(v)}" for k, v in per_source.items())
                                                   + " by the mixture)" if uneven else "")
    if data.get("mixture_from") == "prepared":
        line += (" | mixture: the dataset's prepare weights (" + ", ".join(f"{k} {w:.3g}" for k, w in data["weights"].items())
                 + "; data.mixture overrides them)")
    if data["epochs"] <= 1:
        return line, None
    repeated = ", ".join(f"{k} {v:,.1f}x" for k, v in per_source.items() if v > 1)
    warning = (f"WARNING: the run reads {data['epochs']:,.1f} epochs of dataset {data['dataset']} "
               f"({data['run_tokens']:,} tokens of {data['tokens']:,}" + (f"; {repeated}" if uneven else "")
               + "): repeated tokens are memorised, and the loss then overstates learning; for more than a probe, "
               "prepare a larger dataset (python -m titan_k3.data.prepare) and pass --data.dataset")
    return line, warning
