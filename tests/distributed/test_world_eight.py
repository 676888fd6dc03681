"""World size 8 (gloo, CPU, debug flavor): FSDP2 x8, FSDP2 + EP8, HSDP 2x4 and HSDP 2 x (FSDP4 + EP2) equal one process;
a checkpoint saved at 8 ranks resumes at 1, 2 and 4, and one saved by one process resumes at 8.

Eight processes on a CI machine of two cores are slow to start, so every
8-rank case runs in one spawn (`_eight`); the resharding legs need one
2-rank and one 4-rank spawn besides, and the single-process legs run in the
test process. Every run trains the debug flavor on one global batch of 8
sequences (grad accumulation 2, QK-Clip active) over a 4-update schedule,
with the invariants checked every 2 updates (gradient-scale probe included):
  ref1          1 process, updates 1-4, checkpoints at 2 and 4: the reference.
  fsdp2_x8      8 ranks, updates 1-4, checkpoints at 2 and 4.
  fsdp2_ep8, hsdp_2x4, hsdp2_fsdp4_ep2    8 ranks, updates 1-2.
  back8         8 ranks resumed from ref1's step 2: updates 3-4.
  one/two/four  1, 2 and 4 ranks resumed from fsdp2_x8's step 2: updates 3-4.
Each equals the reference update for update (dist_harness.check_equivalent where
a run starts from scratch: losses, grad norms, routing state, data split; loss and
grad norm after a resume), and no invariant fires.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch.distributed as dist

from dist_harness import check_equivalent, run_trainer
from gloo_workers import spawn_gloo

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available"),
]

WORLD = 8
GLOBAL_BATCH = 8
STEPS = 4
SAVED = 2
EQUIVALENCE = {
    "fsdp2_ep8": ["--parallelism.expert_parallel_degree", "8"],
    "hsdp_2x4": ["--parallelism.data_parallel_replicate_degree", "2"],
    "hsdp2_fsdp4_ep2": ["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.expert_parallel_degree", "2"],
}
SCHEDULE = ["--training.steps", str(STEPS), "--invariants.enable", "true", "--invariants.interval", "2"]
CHECKPOINTS = ["--checkpoint.enable", "true", "--checkpoint.interval", str(SAVED), "--checkpoint.keep_latest_k", "0"]


def _args(world: int, extra: list[str]) -> list[str]:
    return ["--training.local_batch_size", str(GLOBAL_BATCH // world)] + SCHEDULE + extra


def _eight(rank: int, world: int, dump: str) -> dict:
    out = {"fsdp2_x8": run_trainer(_args(world, CHECKPOINTS), dump, "fsdp2_x8", STEPS, whole=True)}
    out.update({name: run_trainer(_args(world, argv), dump, name, SAVED) for name, argv in EQUIVALENCE.items()})
    out["back8"] = run_trainer(_args(world, CHECKPOINTS), dump, "back8", STEPS - SAVED, whole=True)
    return out


def _resume(rank: int, world: int, dump: str, name: str) -> dict:
    return run_trainer(_args(world, CHECKPOINTS), dump, name, STEPS - SAVED, whole=True)


def _copy_checkpoint(src: Path, run: Path) -> None:
    folder = run / "checkpoints"
    folder.mkdir(parents=True)
    shutil.copytree(src, folder / src.name)
    (folder / "latest").write_text(src.name + "\n")


def _events(run: Path, kind: str) -> list[dict]:
    return [e for e in map(json.loads, (run / "events.jsonl").read_text().splitlines()) if e["kind"] == kind]


@pytest.fixture(scope="module")
def legs(tmp_path_factory):
    assert "WORLD_SIZE" not in os.environ, "the reference must be a plain single process"
    dump = tmp_path_factory.mktemp("world8")
    reference = run_trainer(_args(1, CHECKPOINTS), str(dump), "ref1", STEPS, whole=True)
    assert max(reference["max_logit"]) > 0.05, "QK-Clip never triggered: the MAX-reduction would go untested"
    _copy_checkpoint(dump / "ref1" / "checkpoints" / f"step-{SAVED}", dump / "back8")
    runs = {"eight": spawn_gloo(WORLD, _eight, str(dump), result_file=dump / "results8.pt")}
    for name in ("one", "two", "four"):
        _copy_checkpoint(dump / "fsdp2_x8" / "checkpoints" / f"step-{SAVED}", dump / name)
    runs["one"] = [run_trainer(_args(1, CHECKPOINTS), str(dump), "one", STEPS - SAVED, whole=True)]
    runs["two"] = spawn_gloo(2, _resume, str(dump), "two", result_file=dump / "results2.pt")
    runs["four"] = spawn_gloo(4, _resume, str(dump), "four", result_file=dump / "results4.pt")
    return dump, reference, runs


def _checked_clean(dump: Path, name: str, step: int) -> None:
    """The invariants ran at update `step` of run `name` and nothing fired in the whole run."""
    assert f"invariants at step {step}:" in (dump / name / "stdout.log").read_text(), name
    assert _events(dump / name, "invariant_violation") == [], name


@pytest.mark.parametrize("name", ["fsdp2_x8", *EQUIVALENCE])
def test_eight_ranks_equal_one_process(legs, name):
    dump, reference, runs = legs
    steps = STEPS if name == "fsdp2_x8" else SAVED
    check_equivalent(runs["eight"], reference, name, steps)
    _checked_clean(dump, name, steps)


@pytest.mark.parametrize("name, source", [("back8", "ref1"), ("one", "fsdp2_x8"), ("two", "fsdp2_x8"),
                                          ("four", "fsdp2_x8")])
def test_checkpoints_move_between_world_sizes(legs, name, source):
    dump, reference, runs = legs
    ranks = [r[name] for r in runs["eight"]] if name == "back8" else runs[name]
    resumed = _events(dump / name, "resumed")
    assert [e["step"] for e in resumed] == [SAVED], resumed
    assert (dump / source / "checkpoints" / f"step-{SAVED}").is_dir()
    for rank, run in enumerate(ranks):
        for i, step in enumerate(range(SAVED, STEPS)):
            assert run["loss"][i] == pytest.approx(reference["loss"][step], rel=1e-5), (name, rank, step + 1)
            assert run["grad_norm"][i] == pytest.approx(reference["grad_norm"][step], rel=1e-4), (name, rank, step + 1)
        assert all(run["routing_identical"]) or len(ranks) == 1
    _checked_clean(dump, name, STEPS)
