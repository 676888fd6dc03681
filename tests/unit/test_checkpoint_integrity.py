"""Checkpoint checksums: written at every save (sync and async), checked at load.

A damaged newest checkpoint (a truncated or deleted .distcp, a zeroed
.metadata, 1 KiB overwritten inside the weights) falls back to the newest
intact one with a `checkpoint_fallback` event naming the damaged file, and
the state loaded is exactly that checkpoint's; with none intact the load stops
with one line naming each damaged file. One process, debug flavor, CPU.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import pytest
import torch

from test_checkpoint_manager import Run, _assert_same, _events
from titan_k3.checkpoint import integrity, layout
from titan_k3.checkpoint.manager import META_VERSION
from titan_k3.checkpoint.resume import check_resumable


def _run(path: Path, **kw) -> Run:
    return Run(path, save_on_stop=False, **kw)


def _train(path: Path, steps: int = 4, **kw) -> dict[int, dict]:
    """Save every 2 updates up to `steps`; {step: snapshot at that step}."""
    run, snaps = _run(path, **kw), {}
    for i in range(1, steps + 1):
        run.update(i)
        run.manager.after_step(run.state.step, last=False)
        snaps[i] = run.snapshot()
    run.close()
    return snaps


def _without_rng(snap: dict) -> dict:
    return {k: v for k, v in snap.items() if k != "rng"}


def _damage(step_dir: Path, how: str) -> str:
    """Damage one file of `step_dir` as a crash or a bad disk would; returns the damaged file's name."""
    distcp = next(p for p in step_dir.iterdir() if p.suffix == ".distcp")
    if how == "truncate_distcp":
        data = distcp.read_bytes()
        distcp.write_bytes(data[: len(data) // 2])
        return distcp.name
    if how == "delete_distcp":
        distcp.unlink()
        return distcp.name
    if how == "zero_metadata":
        meta = step_dir / layout.DCP_METADATA
        meta.write_bytes(bytes(meta.stat().st_size))
        return meta.name
    assert how == "overwrite_1k"
    # 1 KiB in the middle of the data file: inside some tensor's bytes, size unchanged.
    with open(distcp, "r+b") as f:
        f.seek(distcp.stat().st_size // 2)
        f.write(torch.randn(256).numpy().tobytes())
    return distcp.name


@pytest.mark.parametrize("mode", ["disabled", "async"])
def test_every_save_lists_every_file_with_its_size_and_crc(tmp_path, mode):
    _train(tmp_path, async_mode=mode)
    for step_dir in layout.complete_steps(tmp_path / "checkpoints").values():
        doc = json.loads((step_dir / integrity.CHECKSUMS_FILE).read_text())
        on_disk = sorted(p.name for p in step_dir.iterdir() if p.name != integrity.CHECKSUMS_FILE)
        assert sorted(doc["files"]) == on_disk and any(n.endswith(".distcp") for n in on_disk)
        for name, entry in doc["files"].items():
            data = (step_dir / name).read_bytes()
            assert entry["bytes"] == len(data)
            assert entry["crc32"] == [f"{zlib.crc32(data):08x}"]  # one block: files under 64 MiB
        assert json.loads((step_dir / layout.META_FILE).read_text())["version"] == META_VERSION


def test_blocks_locate_the_damage_and_split_across_ranks(tmp_path, monkeypatch):
    monkeypatch.setattr(integrity, "BLOCK_BYTES", 4096)
    _train(tmp_path, steps=2)
    step_dir = tmp_path / "checkpoints" / "step-2"
    doc = integrity.read(step_dir)
    distcp = next(n for n in doc["files"] if n.endswith(".distcp"))
    size = doc["files"][distcp]["bytes"]
    assert len(doc["files"][distcp]["crc32"]) == -(-size // 4096) > 2
    blocks = integrity.expected_blocks(doc)
    shares = [integrity.share(blocks, r, 3) for r in range(3)]
    assert sum(map(len, shares)) == len(blocks) and set().union(*shares) == set(blocks) and all(shares)
    assert integrity.check_blocks(step_dir, doc, blocks) is None
    with open(step_dir / distcp, "r+b") as f:
        f.seek(3 * 4096 + 100)
        f.write(b"\xff" * 1024)
    problem = integrity.check_blocks(step_dir, doc, blocks)
    assert problem.startswith(f"{step_dir / distcp}: bytes 12288-16384 changed since the save")
    # Only the rank whose share holds block 3 sees it.
    owner = next(i for i, b in enumerate(blocks) if b.file == distcp and b.index == 3) % 3
    assert [integrity.check_blocks(step_dir, doc, s) is not None for s in shares] == [r == owner for r in range(3)]


@pytest.mark.parametrize("how", ["truncate_distcp", "delete_distcp", "zero_metadata", "overwrite_1k"])
def test_damaged_newest_checkpoint_falls_back_to_the_newest_intact(tmp_path, how):
    snaps = _train(tmp_path)
    folder = tmp_path / "checkpoints"
    damaged = _damage(folder / "step-4", how)

    fresh = _run(tmp_path, seed=1)
    assert fresh.manager.load() == 2
    _assert_same(_without_rng(snaps[2]), _without_rng(fresh.snapshot()))
    fallback = [e for e in _events(tmp_path) if e["kind"] == "checkpoint_fallback"]
    assert len(fallback) == 1 and f"step-4/{damaged}" in fallback[0]["message"]
    assert fallback[0]["path"].endswith("step-2")
    # The damaged checkpoint is left for inspection; 'latest' still names it until the next save.
    assert (folder / "step-4").is_dir() and layout.read_latest(folder) == "step-4"
    fresh.close()


def test_check_resumable_chooses_before_anything_is_written(tmp_path):
    _train(tmp_path)
    _damage(tmp_path / "checkpoints" / "step-4", "overwrite_1k")
    before = sorted(p.name for p in tmp_path.rglob("*"))
    probe = _run(tmp_path / "probe")
    cfg = type("Cfg", (), {"checkpoint": probe.manager.cfg})()
    plan = check_resumable(cfg, tmp_path, probe.model, probe.optimizers)
    assert plan.path == tmp_path / "checkpoints" / "step-2" and not plan.initial
    assert len(plan.notes) == 1 and "step-4" in plan.notes[0]
    assert sorted(p.name for p in tmp_path.rglob("*") if "probe" not in p.parts) == before


def test_no_intact_checkpoint_stops_with_one_line_naming_each_file(tmp_path):
    _train(tmp_path)
    folder = tmp_path / "checkpoints"
    _damage(folder / "step-4", "delete_distcp")
    _damage(folder / "step-2", "zero_metadata")
    fresh = _run(tmp_path, seed=1)
    with pytest.raises(ValueError) as e:
        fresh.manager.load()
    message = str(e.value)
    assert "\n" not in message and "no intact checkpoint to load" in message
    assert "step-4/__0_0.distcp: missing" in message and "step-2/.metadata" in message
    assert fresh.state.step == 0


def test_an_asked_for_damaged_step_stops_without_fallback(tmp_path):
    _train(tmp_path)
    _damage(tmp_path / "checkpoints" / "step-2", "overwrite_1k")
    with pytest.raises(ValueError, match=r"checkpoint.load_step' = 2: that checkpoint is damaged: .*step-2/__0_0"):
        _run(tmp_path, seed=1, load_step=2).manager.load()


def test_checkpoint_without_checksums(tmp_path):
    """Saved before checksums (meta version 1): loads, announced. A version-2 one without them: damaged."""
    snaps = _train(tmp_path)
    step4 = tmp_path / "checkpoints" / "step-4"
    (step4 / integrity.CHECKSUMS_FILE).unlink()
    fresh = _run(tmp_path, seed=1)
    assert fresh.manager.load() == 2
    assert "checksums.json: missing" in [e for e in _events(tmp_path) if e["kind"] == "checkpoint_fallback"][0]["message"]

    meta = json.loads((step4 / layout.META_FILE).read_text())
    (step4 / layout.META_FILE).write_text(json.dumps({**meta, "version": 1}))
    old = _run(tmp_path, seed=1)
    assert old.manager.load() == 4
    _assert_same(_without_rng(snaps[4]), _without_rng(old.snapshot()))
    assert [e["path"] for e in _events(tmp_path) if e["kind"] == "checkpoint_unverified"] == [str(step4)]


def test_initial_load_path_is_verified_too(tmp_path):
    _train(tmp_path / "src")
    folder = tmp_path / "src" / "checkpoints"
    _damage(folder / "step-4", "overwrite_1k")
    # A checkpoints folder: the newest intact one initialises the model, announced.
    dst = _run(tmp_path / "dst", enable=False, initial_load_path=str(folder))
    assert dst.manager.load() is None
    events = _events(tmp_path / "dst")
    assert [e["path"] for e in events if e["kind"] == "initial_load"] == [str(folder / "step-2")]
    assert "step-4/__0_0.distcp" in [e for e in events if e["kind"] == "checkpoint_fallback"][0]["message"]
    # A damaged step dir named directly: one line, nothing loaded.
    with pytest.raises(ValueError, match=r"initial_load_path' = '.*step-4': damaged: .*step-4/__0_0.distcp: bytes"):
        _run(tmp_path / "dst2", enable=False, initial_load_path=str(folder / "step-4")).manager.load()


def test_step_dirs_without_metadata_are_damaged_not_absent(tmp_path):
    """A `step-N` dir is renamed into place only after .metadata exists: one without it is damaged."""
    _train(tmp_path, steps=6)
    folder = tmp_path / "checkpoints"
    (folder / "step-6" / layout.DCP_METADATA).unlink()
    (folder / layout.LATEST).unlink()
    fresh = _run(tmp_path, seed=1)
    assert fresh.manager.load() == 4
    fallback = [e for e in _events(tmp_path) if e["kind"] == "checkpoint_fallback"]
    assert "step-6/.metadata: missing: damaged, passed over" in fallback[-1]["message"]
    fresh.close()

    for step in (2, 4):
        (folder / f"step-{step}" / layout.DCP_METADATA).unlink()
    with pytest.raises(ValueError) as e:
        _run(tmp_path, seed=1).manager.load()
    message = str(e.value)
    assert "\n" not in message and "no intact checkpoint to load" in message and "move the damaged step dirs aside" in message
    assert all(f"step-{s}/.metadata: missing" in message for s in (2, 4, 6))


def test_overwrite_never_starts_over_on_damaged_step_dirs(tmp_path, capsys):
    from titan_k3.train import main

    args = ["--model.flavor", "debug", "--training.seq_len", "64", "--metrics.log_freq", "1", "--training.steps", "2",
            "--checkpoint.enable", "true", "--checkpoint.interval", "1", "--job.dump_folder", str(tmp_path),
            "--job.name", "r"]
    assert main(args) == 0
    folder = tmp_path / "r" / "checkpoints"
    for step_dir in layout.complete_steps(folder).values():
        (step_dir / layout.DCP_METADATA).unlink()
    (folder / layout.LATEST).unlink()
    before = {p: p.read_bytes() for p in sorted((tmp_path / "r").rglob("*")) if p.is_file()}
    capsys.readouterr()
    assert main([*args, "--job.overwrite", "true"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no intact checkpoint to load" in err[0], err
    assert f"{folder / 'step-2' / layout.DCP_METADATA}: missing" in err[0] and "step-1/.metadata: missing" in err[0]
    assert {p: p.read_bytes() for p in sorted((tmp_path / "r").rglob("*")) if p.is_file()} == before
    # NOTE: without job.overwrite the first line already names the damage (it offered job.overwrite as the way out).
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds only damaged checkpoints (step-1/.metadata, step-2/.metadata: missing)" in err[0], err
    assert "job.overwrite" not in err[0]
    assert {p: p.read_bytes() for p in sorted((tmp_path / "r").rglob("*")) if p.is_file()} == before
