"""Checksums under 2 gloo ranks: both ranks hash a share of a save, and both agree on what loads.

The newest checkpoint is damaged in a block only rank 1 hashes: both ranks
must pass it over and load the same older one (check_resumable's choice and
the manager's own), with one `checkpoint_fallback` event; with every
checkpoint damaged, both ranks stop with the same one line.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))

from gloo_workers import spawn_gloo  # noqa: E402
from test_checkpoint_manager import Run  # noqa: E402
from titan_k3.checkpoint import integrity  # noqa: E402
from titan_k3.checkpoint.resume import check_resumable  # noqa: E402
from titan_k3.metrics.events import EventLog  # noqa: E402

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")


def _ranked(path: Path, rank: int, world: int, **kw) -> Run:
    run = Run(path, save_on_stop=False, **kw)
    m = run.manager
    m.rank, m.world_size, m.dp_rank, m.dp_world = rank, world, rank, world
    if rank != 0:
        m.events = EventLog(None)
    return run


def _rank1_block(step_dir: Path) -> integrity.Block:
    """A block of a data file that rank 1 hashes (rank 0 never reads it)."""
    doc = integrity.read(step_dir)
    return next(b for b in integrity.share(integrity.expected_blocks(doc), 1, 2) if b.file.endswith(".distcp"))


def _legs(rank: int, world: int, dump: str) -> dict:
    path = Path(dump)
    run = _ranked(path, rank, world)
    for i in range(1, 5):
        run.update(i)
        run.manager.after_step(i, last=False)
    run.close()
    folder = path / "checkpoints"
    listed = sorted(integrity.read(folder / "step-4")["files"])
    block = _rank1_block(folder / "step-4")
    if rank == 0:
        with open(folder / "step-4" / block.file, "r+b") as f:
            f.seek(block.start + block.length // 2)
            f.write(b"\x5a" * 1024)
    dist.barrier()

    fresh = _ranked(path, rank, world, seed=1)
    cfg = type("Cfg", (), {"checkpoint": fresh.manager.cfg})()
    plan = check_resumable(cfg, path, fresh.model, fresh.optimizers)
    loaded = fresh.manager.load()
    dist.barrier()
    if rank == 0:
        next(p for p in (folder / "step-2").iterdir() if p.suffix == ".distcp").unlink()
    dist.barrier()
    try:
        _ranked(path, rank, world, seed=2).manager.load()
        none_intact = ""
    except ValueError as e:
        none_intact = str(e)
    return {"listed": listed, "damaged": block.file, "plan": plan.path.name, "notes": plan.notes,
            "loaded": loaded, "none_intact": none_intact}


def test_a_damage_only_rank_1_sees_falls_back_on_every_rank(tmp_path):
    out = spawn_gloo(2, _legs, str(tmp_path), result_file=tmp_path / "results.pt")
    r0, r1 = out
    assert {"rank-0.pt", "rank-1.pt", "meta.json", ".metadata"} <= set(r0["listed"])
    assert sum(name.endswith(".distcp") for name in r0["listed"]) == 2  # both ranks wrote data
    assert r0["plan"] == r1["plan"] == "step-2" and r0["loaded"] == r1["loaded"] == 2
    assert r0["notes"] == r1["notes"] and f"step-4/{r0['damaged']}" in r0["notes"][0]
    events = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()]
    fallback = [e for e in events if e["kind"] == "checkpoint_fallback"]
    assert len(fallback) == 1 and fallback[0]["path"].endswith("step-2")
    assert r0["none_intact"] == r1["none_intact"] and "no intact checkpoint to load" in r0["none_intact"]
    assert "\n" not in r0["none_intact"] and "step-2/__" in r0["none_intact"]
