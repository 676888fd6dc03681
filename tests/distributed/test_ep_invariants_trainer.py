"""The EP dispatch invariant as wired into the real Trainer (FSDP2 + EP 2 over 2 gloo processes)."""

from __future__ import annotations

import json

import pytest

from gloo_workers import spawn_gloo

WORLD = 2
ARGS = [
    "--model.flavor", "debug", "--training.seq_len", "64", "--training.local_batch_size", "1", "--training.steps", "2",
    "--training.device", "cpu", "--kernels.kda", "torch", "--kernels.experts", "torch", "--kernels.loss", "torch",
    "--kernels.attn_res", "torch",
    "--kernels.attention", "math", "--lr_scheduler.warmup_steps", "1", "--metrics.log_freq", "1000",
    "--invariants.interval", "1", "--parallelism.expert_parallel_degree", "2", "--activation_checkpoint.mode", "full",
]


def _scenarios(rank: int, world: int, dump: str) -> None:
    from titan_k3.config import load_job_config
    from titan_k3.invariants.runner import expert_dispatchers
    from titan_k3.train import Trainer

    for bug in ("clean", "dropped_rows"):
        trainer = Trainer(load_job_config(ARGS + ["--job.dump_folder", dump, "--job.name", bug]))
        try:
            dispatchers = expert_dispatchers(trainer.model)
            assert len(dispatchers) == 3  # layers 1-3 are MoE in the debug flavor
            if bug == "dropped_rows" and rank == 1:
                original = dispatchers[0].reset_counts

                def lose_a_row():  # the next interval's accounting starts one row short on one rank
                    original()
                    dispatchers[0].received_W[0] -= 1

                dispatchers[0].reset_counts = lose_a_row
            trainer.train()  # full AC: the recompute must not count a second dispatch
        finally:
            trainer.close()


@pytest.mark.slow
def test_ep_dispatch_counts_checked_in_training(tmp_path):
    spawn_gloo(WORLD, _scenarios, str(tmp_path))
    clean = [json.loads(x) for x in (tmp_path / "clean" / "events.jsonl").read_text().splitlines()]
    assert not [e for e in clean if e["kind"] == "invariant_violation"]
    bad = [json.loads(x) for x in (tmp_path / "dropped_rows" / "events.jsonl").read_text().splitlines()]
    violations = [e for e in bad if e["kind"] == "invariant_violation"]
    assert violations and all("ep_token_counts" in json.dumps(e) for e in violations)
    assert violations[0]["step"] == 2  # the interval after the accounting went wrong
