"""A full disk and failed saves: the space check before a save, a writer that fails mid-save (sync and
async), and the rerun. Each failure is one line (needed / free / where, or ENOSPC named), removes its
partial files, keeps `latest` on the last good checkpoint, emits `checkpoint_failed`, and the next start
resumes from that checkpoint. The faults come from the documented [debug] keys (checkpoint/faults.py).
"""

from __future__ import annotations

import errno
import json
from collections import namedtuple

import pytest
from torch.distributed.checkpoint.api import CheckpointException

from test_checkpoint_integrity import _run, _without_rng
from test_checkpoint_manager import _assert_same, _events
from titan_k3.checkpoint import CheckpointSaveError, faults, layout
from titan_k3.checkpoint.faults import CheckpointFaults
from titan_k3.checkpoint.verify import describe_failure
from titan_k3.config import load_job_config
from titan_k3.metrics import run_dir as run_dir_module
from titan_k3.train import main

FAST = ["--model.flavor", "debug", "--training.seq_len", "64", "--metrics.log_freq", "1"]
Usage = namedtuple("Usage", "total used free")


def _to_step_2(path, **kw):
    """A run saved at update 2 and moved on to update 4 (not saved): (run, snapshot at 2)."""
    run = _run(path, **kw)
    for i in (1, 2):
        run.update(i)
        run.manager.after_step(i, last=False)
    at2 = run.snapshot()
    run.update(3)
    run.manager.after_step(3, last=False)
    run.update(4)
    return run, at2


def _assert_left_as_before(path) -> None:
    folder = path / "checkpoints"
    assert layout.read_latest(folder) == "step-2"
    assert sorted(p.name for p in folder.iterdir()) == ["latest", "step-2"]  # no tmp dir left behind
    failed = [e for e in _events(path) if e["kind"] == "checkpoint_failed"]
    assert len(failed) == 1 and failed[0]["step"] == 4 and failed[0]["latest"] == "step-2"


def test_a_save_that_does_not_fit_is_refused_before_writing(tmp_path, monkeypatch):
    run, at2 = _to_step_2(tmp_path)
    monkeypatch.setattr(faults.shutil, "disk_usage", lambda _path: Usage(10**9, 10**9 - 1000, 1000))
    with pytest.raises(CheckpointSaveError) as e:
        run.manager.after_step(4, last=False)
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith("checkpoint of update 4 needs ") and f"1000 B free at {tmp_path / 'checkpoints'}" in message
    assert "'latest' stays on step-2" in message
    _assert_left_as_before(tmp_path)
    monkeypatch.undo()
    fresh = _run(tmp_path, seed=1)
    assert fresh.manager.load() == 2
    _assert_same(_without_rng(at2), _without_rng(fresh.snapshot()))


def test_debug_checkpoint_free_bytes_simulates_a_full_disk(tmp_path):
    cfg = load_job_config(["--debug.checkpoint_free_bytes", "0"])
    assert CheckpointFaults.from_debug(cfg.debug) == CheckpointFaults(free_bytes=0)
    assert CheckpointFaults.from_debug(load_job_config([]).debug).active() == {}
    run, _ = _to_step_2(tmp_path)
    run.manager.faults = CheckpointFaults.from_debug(cfg.debug)
    with pytest.raises(CheckpointSaveError, match=r"needs [0-9.]+ MiB, 0 B free at "):
        run.manager.save(4)
    _assert_left_as_before(tmp_path)


def test_the_expected_size_covers_the_files_written(tmp_path):
    _run(tmp_path).manager.save(0)
    saved = [e for e in _events(tmp_path) if e["kind"] == "checkpoint_saved"][0]
    assert saved["bytes"] <= saved["expected_bytes"] <= 1.05 * saved["bytes"] + 2**20


@pytest.mark.parametrize("mode", ["disabled", "async"])
def test_a_write_failing_mid_save_is_named_cleaned_and_resumable(tmp_path, mode):
    run, at2 = _to_step_2(tmp_path, async_mode=mode)
    run.manager.faults = CheckpointFaults(write_error_at_step=4)
    with pytest.raises(CheckpointSaveError) as e:
        run.manager.after_step(4, last=False)
        run.manager.close()  # async: the failure surfaces when the save is waited for
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith("checkpoint save of update 4 failed: no space left on device (ENOSPC) at ")
    assert "its partial files are removed; 'latest' stays on step-2" in message
    _assert_left_as_before(tmp_path)
    fresh = _run(tmp_path, seed=1)
    assert fresh.manager.load() == 2
    _assert_same(_without_rng(at2), _without_rng(fresh.snapshot()))


def test_failure_descriptions_name_a_full_disk():
    enospc = OSError(errno.ENOSPC, "No space left on device")
    wrapped = CheckpointException("save failed", {1: (enospc, None)})
    assert describe_failure(wrapped, "/ckpt", 5 << 30) == "no space left on device (ENOSPC) at /ckpt: 5.0 GiB free"
    # torch's zip writer on a full disk says nothing of space; the free space does.
    pos = RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 704 vs 598")
    assert describe_failure(pos, "/ckpt", 0).endswith("(the disk is full, ENOSPC: 0 B free at /ckpt)")
    assert "ENOSPC" not in describe_failure(PermissionError(errno.EACCES, "Permission denied"), "/ckpt", 5 << 30)


def test_the_cli_stops_with_one_line_and_the_rerun_resumes(tmp_path, capsys, monkeypatch):
    args = [*FAST, "--job.dump_folder", str(tmp_path), "--job.name", "disk", "--training.steps", "4",
            "--checkpoint.enable", "true", "--checkpoint.interval", "2"]
    assert main([*args, "--debug.checkpoint_write_error_at_step", "4"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: checkpoint save of update 4 failed: no space left on device (ENOSPC)")
    run, folder = tmp_path / "disk", tmp_path / "disk" / "checkpoints"
    assert layout.read_latest(folder) == "step-2" and sorted(p.name for p in folder.iterdir()) == ["latest", "step-2"]
    # A save killed on a full disk leaves its tmp dir: the rerun removes it before writing anything.
    stale = folder / "step-4.tmp-0badc0de"
    stale.mkdir()
    (stale / "__0_0.distcp").write_bytes(b"\0" * 4096)
    written, real_write = [], run_dir_module._write_run_files

    def write_checking(cfg, path, extra):
        assert not stale.exists(), "the run directory was written to before the stale save was removed"
        written.append(path)
        return real_write(cfg, path, extra)

    monkeypatch.setattr(run_dir_module, "_write_run_files", write_checking)
    assert main(args) == 0
    events = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
    assert [e["removed"] for e in events if e["kind"] == "checkpoint_discarded"] == [[stale.name]]
    assert [e["step"] for e in events if e["kind"] == "resumed"] == [2]
    assert written == [run] and not stale.exists() and not (run / "manifest.json.tmp").exists()
    assert layout.read_latest(folder) == "step-4"
