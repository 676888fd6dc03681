"""A prepared dataset of three sources at the weights it was prepared with, and a context stage, on two gloo ranks
(FSDP2 + EP 2) equal one process on the same global batch.

The dataset is written here with the embedded tokenizer's identity: three sources of random token documents prepared
at weights 0.25 / 0.5 / 0.25, the heaviest one a single document of 32 tokens, so that every window of it holds the same
text and each micro-batch trains that text on both ranks (two sequences of the stream, not one on two ranks). Every
run trains the debug flavor for 5 updates (grad accumulation 2) and switches from sequences of 32 to sequences of 64
at update 3. dist_harness.check_equivalent compares them update for update (loss, grad norm, routing
state, the ranks' sequences together exactly the single process's and disjoint); the tokens per source of the last
update's record, summed over the ranks, are the single process's.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch.distributed as dist

from dist_harness import GLOBAL_BATCH, STEPS, check_equivalent, run_trainer
from gloo_workers import spawn_gloo

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available"),
]

WEIGHTS = {"books": 0.25, "papers": 0.5, "web": 0.25}


def _write_dataset(path: Path) -> None:
    from titan_k3.data.shards import token_dtype, write_index, write_shard
    from titan_k3.data.tokenizer import load_tokenizer

    tok = load_tokenizer("embedded")
    dtype, rng = token_dtype(tok.vocab_size), np.random.default_rng(0)
    records = []
    for source, n_docs, lo, hi in (("books", 12, 200, 600), ("papers", 1, 31, 32), ("web", 40, 10, 120)):
        docs = [np.append(rng.integers(1, tok.vocab_size, int(n)), tok.eos_id).astype(dtype)
                for n in rng.integers(lo, hi, n_docs)]
        records.append(write_shard(path, f"train-{source}-00000", docs, source=source, dtype=dtype))
    write_index(path, tok, {"train": records}, mixture=WEIGHTS)


def _args(dataset: Path) -> list[str]:
    return ["--data.dataset", str(dataset), "--training.context_stages", "3:64"]


def _whole_runs(rank: int, world: int, runs: list, dump: str) -> dict:
    """Each (name, argv) as a whole run (Trainer.train: its metrics.jsonl records the tokens per source)."""
    local = ["--training.local_batch_size", str(GLOBAL_BATCH // world)]
    return {name: run_trainer(argv + local, dump, name, STEPS, whole=True) for name, argv in runs}


def _sources(dump: Path, name: str) -> dict[str, int]:
    last = json.loads((dump / name / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["step"] == STEPS
    return {k: v for k, v in last.items() if k.startswith("tokens_per_source/")}


def test_prepared_sources_and_a_context_stage_equal_one_process(tmp_path):
    assert "WORLD_SIZE" not in os.environ, "the reference must be a plain single process"
    dataset = tmp_path / "data"
    dataset.mkdir()
    _write_dataset(dataset)
    args = _args(dataset)
    reference = _whole_runs(0, 1, [("ref", args)], str(tmp_path))["ref"]
    runs = [("fsdp2_ep2", args + ["--parallelism.expert_parallel_degree", "2"])]
    ranks = spawn_gloo(2, _whole_runs, runs, str(tmp_path), result_file=tmp_path / "results.pt")
    want = _sources(tmp_path, "ref")
    assert set(want) == {f"tokens_per_source/{k}" for k in WEIGHTS} and all(want.values())
    for name, _ in runs:
        check_equivalent(ranks, reference, name)
        assert _sources(tmp_path, name) == want, name
