"""Checkpoints of FSDP2 and FSDP2 + EP runs (gloo, CPU): exact 2-rank resume, stop agreement, resharding to 1 and 4
ranks.

The real Trainer runs in spawned gloo processes over one global batch of 4
sequences (local batch 4 / W). Legs:
  ref     2 ranks, 8 updates, checkpoints every 4.
  res     2 ranks, async saves; a SIGTERM reaches only the last rank after update 3:
          every rank must stop after update 3 and save; restarted with the same name,
          it must match `ref` bitwise, update for update, and end with the same state.
  one     1 process resumed from the 2-rank step-4 checkpoint (DCP reshards),
  four    4 ranks resumed from it: losses continue within float32 tolerance.
  ep      2 ranks, FSDP2 + EP 2 (experts sharded over "ep", outside FSDP), 8 updates: `ref`'s numbers;
  ep_one  1 process and ep_four 4 ranks (FSDP4 + EP 4) resumed from its step-4 checkpoint: the experts'
          and their optimizer state's shards move to another layout, and the losses continue `ref`'s.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from gloo_workers import spawn_gloo
from titan_k3.checkpoint.hf import read_dcp_tensors

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available"),
]

GLOBAL_BATCH = 4
STEPS = 8
ARGS = [
    "--model.flavor", "debug", "--training.seq_len", "64", "--training.steps", str(STEPS),
    "--training.device", "cpu", "--training.compute_dtype", "float32", "--kernels.kda", "torch",
    "--kernels.experts", "torch", "--kernels.loss", "torch", "--kernels.attn_res", "torch",
    "--kernels.attention", "math",
    "--lr_scheduler.warmup_steps", "1", "--metrics.log_freq", "1", "--checkpoint.enable", "true",
    "--checkpoint.interval", "4", "--checkpoint.keep_latest_k", "0",
]
EP2 = ("--parallelism.expert_parallel_degree", "2")


def _train(dump: str, name: str, world: int, rank: int, stop_after: int = -1, extra: tuple = ()) -> int:
    """One Trainer run; with stop_after, only the last rank sees a SIGTERM after that update."""
    from titan_k3.config import load_job_config
    from titan_k3.train import Trainer

    local = ["--training.local_batch_size", str(GLOBAL_BATCH // world)]
    trainer = Trainer(load_job_config(ARGS + local + list(extra) + ["--job.dump_folder", dump, "--job.name", name]))
    after_step = trainer.checkpointer.after_step

    def signalled_after_step(step, last):
        if step == stop_after and rank == world - 1:
            trainer.checkpointer.stop.signum = signal.SIGTERM
        return after_step(step, last)

    trainer.checkpointer.after_step = signalled_after_step
    try:
        trainer.train()
    finally:
        trainer.close()
    return trainer.step


def _legs(rank: int, world: int, dump: str, legs: list) -> list[int]:
    return [_train(dump, name, world, rank, stop_after, extra) for name, stop_after, extra in legs]


def _spawn(world: int, dump: Path, legs: list[tuple[str, int, tuple]]) -> list[list[int]]:
    return spawn_gloo(world, _legs, str(dump), legs, result_file=dump / f"steps-{world}.pt")


def _metrics(run: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}


def _events(run: Path, kind: str) -> list[dict]:
    return [e for e in map(json.loads, (run / "events.jsonl").read_text().splitlines()) if e["kind"] == kind]


def _copy_checkpoint(src: Path, run: Path) -> None:
    folder = run / "checkpoints"
    folder.mkdir(parents=True)
    shutil.copytree(src, folder / src.name)
    (folder / "latest").write_text(src.name + "\n")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    dump = tmp_path_factory.mktemp("ckpt_dist")
    asynchronous = ("--checkpoint.async_mode", "async")
    steps = _spawn(2, dump, [("ref", -1, ()), ("res", 3, asynchronous), ("res", -1, asynchronous), ("ep", -1, EP2)])
    for name, source in (("one", "res"), ("four", "res"), ("ep_one", "ep"), ("ep_four", "ep")):
        _copy_checkpoint(dump / source / "checkpoints" / "step-4", dump / name)
    assert "WORLD_SIZE" not in os.environ
    one_steps = [_train(str(dump), name, world=1, rank=0) for name in ("one", "ep_one")]
    four_steps = _spawn(4, dump, [("four", -1, ()), ("ep_four", -1, ("--parallelism.expert_parallel_degree", "4"))])
    return dump, steps, one_steps, four_steps


def test_stop_signal_on_one_rank_stops_all_after_the_same_update(runs):
    dump, steps, _, _ = runs
    assert [s[1] for s in steps] == [3, 3]
    stopped = _events(dump / "res", "stopped")
    assert [e["step"] for e in stopped] == [3] and "SIGTERM" in stopped[0]["message"]
    assert (dump / "res" / "checkpoints" / "step-3" / "rank-1.pt").is_file()


def test_two_rank_resume_is_bitwise_exact(runs):
    dump, steps, _, _ = runs
    assert [s[0] for s in steps] == [STEPS, STEPS] and [s[2] for s in steps] == [STEPS, STEPS]
    assert [e["step"] for e in _events(dump / "res", "resumed")] == [3]
    ref, res = _metrics(dump / "ref"), _metrics(dump / "res")
    assert sorted(res) == list(range(1, STEPS + 1))
    for step in ref:
        for key in ("loss", "grad_norm", "lr", "tokens_seen"):
            assert ref[step][key] == res[step][key], (step, key)
    a = read_dcp_tensors(dump / "ref" / "checkpoints" / f"step-{STEPS}")
    b = read_dcp_tensors(dump / "res" / "checkpoints" / f"step-{STEPS}")
    assert a.keys() == b.keys() and any(k.endswith("qb_bias") for k in a)
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_expert_parallel_run_equals_the_fsdp2_run(runs):
    dump, steps, _, _ = runs
    assert [s[3] for s in steps] == [STEPS, STEPS]
    ref, ep = _metrics(dump / "ref"), _metrics(dump / "ep")
    assert sorted(ep) == sorted(ref)
    for step in ref:
        assert ep[step]["loss"] == pytest.approx(ref[step]["loss"], rel=1e-5), step
        assert ep[step]["grad_norm"] == pytest.approx(ref[step]["grad_norm"], rel=1e-4), step


@pytest.mark.parametrize("name", ["one", "four", "ep_one", "ep_four"])
def test_resharded_resume_continues_the_two_rank_run(runs, name):
    dump, _, one_steps, four_steps = runs
    assert one_steps == [STEPS, STEPS] and four_steps == [[STEPS, STEPS]] * 4
    resumed = _events(dump / name, "resumed")
    assert [e["step"] for e in resumed] == [4] and "resharded" in resumed[0]["message"]
    ref, run = _metrics(dump / "ref"), _metrics(dump / name)
    assert sorted(run) == list(range(5, STEPS + 1))
    for step in run:
        assert run[step]["tokens_seen"] == ref[step]["tokens_seen"]
        assert run[step]["loss"] == pytest.approx(ref[step]["loss"], rel=1e-5), step
        assert run[step]["grad_norm"] == pytest.approx(ref[step]["grad_norm"], rel=1e-4), step
