"""The invariants as wired into the real Trainer (FSDP2 over 2 gloo processes): clean, same data, drifted routing."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from gloo_workers import spawn_gloo

from titan_k3.invariants.checks import CHECKS

WORLD = 2
ARGS = [
    "--model.flavor", "debug", "--training.seq_len", "64", "--training.local_batch_size", "1", "--training.steps", "4",
    "--training.device", "cpu", "--training.compute_dtype", "float32", "--kernels.kda", "torch",
    "--kernels.experts", "torch", "--kernels.loss", "torch", "--kernels.attn_res", "torch",
    "--kernels.attention", "math",
    "--lr_scheduler.warmup_steps", "1", "--metrics.log_freq", "1000", "--invariants.interval", "1",
]


def _scenario(bug: str, dump: str) -> None:
    from titan_k3.config import load_job_config
    from titan_k3.data.loader import build_dataloader
    from titan_k3.train import Trainer

    cfg = load_job_config(ARGS + ["--job.dump_folder", dump, "--job.name", bug])
    trainer = Trainer(cfg)
    try:
        if bug == "same_data":
            trainer.loader.close()
            trainer.loader = build_dataloader(cfg.data.dataset, trainer.tokenizer, 64, 1, 0, trainer.dp_world, cfg.training.seed,
                                              prefetch=0)
        if bug == "routing_drift" and trainer.rank == 1:
            with torch.no_grad():
                trainer.model.moe_routers()[2].qb_bias[0] += 1e-6
        trainer.train_step()
    finally:
        trainer.close()


def _scenarios(rank: int, world: int, dump: str) -> None:
    for bug in ("clean", "same_data", "routing_drift"):
        _scenario(bug, dump)


@pytest.fixture(scope="module")
def dump(tmp_path_factory):
    out = tmp_path_factory.mktemp("trainer_invariants")
    spawn_gloo(WORLD, _scenarios, str(out))
    return out


def _violations(dump: Path, bug: str) -> list[dict]:
    events = [json.loads(x) for x in (dump / bug / "events.jsonl").read_text().splitlines()]
    return [e for e in events if e["kind"] == "invariant_violation"]


pytestmark = [pytest.mark.slow, pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")]


def test_clean_fsdp_step_passes_every_check_and_logs_the_cost(dump):
    assert _violations(dump, "clean") == []
    line = next(x for x in (dump / "clean" / "stdout.log").read_text().splitlines() if x.startswith("invariants at step 1:"))
    # NOTE: 8 of the 9 checks ran (no expert parallelism: no ep_token_counts); the probe is not one of them.
    assert "8 checks and the probe in" in line, line
    # NOTE: each cost is a check's own name (the line named a 'replicas.shards' no violation is reported under).
    inner = line[re.search(r" ms(, off the training clock)? \(", line).end():line.rindex("); ")]
    costs = inner.split("amortised; ")[-1].split(", ")
    named = {c.rsplit(" ", 2)[0] for c in costs}
    assert named - set(CHECKS) == {"probe (two forwards and backwards)"}, named


def test_trainer_catches_every_rank_reading_the_same_data(dump):
    found = _violations(dump, "same_data")
    assert [e["check"] for e in found] == ["data.disjoint_sequences"] and found[0]["step"] == 1


def test_trainer_catches_routing_state_drift_on_one_rank(dump):
    found = _violations(dump, "routing_drift")
    assert [e["check"] for e in found] == ["replicas.checksums"] and found[0]["step"] == 1
    assert "layers.2.ffn.router.qb_bias" in found[0]["message"] and found[0]["ranks"] == [1]
