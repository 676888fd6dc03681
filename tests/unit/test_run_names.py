"""Run names and run folders: every bad one is one line before any work, and nothing is touched.

A reused job.name resumes only when its run has a checkpoint; otherwise the
start stops (exit 2) and leaves the old files as they were, unless
job.overwrite starts it over (old files removed, listed in the manifest).
Names cannot leave the dump folder; an unwritable or file-blocked dump folder
is one line; a mismatched initial_load_path (DCP or export) leaves no run
directory behind.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest

from test_checkpoint_manager import Run
from titan_k3.checkpoint.export import export_checkpoint, export_shapes
from titan_k3.config import ConfigError, load_job_config
from titan_k3.metrics import run_dir
from titan_k3.models.k3.args import get_flavor
from titan_k3.train import main

FAST = ["--model.flavor", "debug", "--training.seq_len", "64", "--metrics.log_freq", "1", "--training.steps", "2"]


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("error: ")
    return err[0]


def _files(path: Path) -> dict[str, tuple[bytes, int]]:
    return {str(p.relative_to(path)): (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("name", ["../../x", "a/b", "/abs", "..", ".", "a\\b", " x", "x\n"])
def test_names_that_are_paths_are_refused(name):
    with pytest.raises(ConfigError) as e:
        load_job_config(["--job.name", name])
    assert "\n" not in str(e.value) and str(e.value).startswith("config key 'job.name' = ")


def test_a_name_outside_the_dump_folder_stops_before_anything(tmp_path, capsys):
    dump = tmp_path / "runs"
    assert main([*FAST, "--job.dump_folder", str(dump), "--job.name", "../escaped"]) == 2
    assert "job.name" in _one_error_line(capsys)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("folder", ["../up", "/abs", "a/../../b"])
def test_checkpoint_folders_outside_the_run_directory_are_refused(folder):
    with pytest.raises(ConfigError, match="config key 'checkpoint.folder'"):
        load_job_config(["--checkpoint.folder", folder])


def test_the_dump_folder_check_creates_a_folder_there_and_leaves_nothing(tmp_path):
    """Root passes os.access everywhere, /proc too: the check creates a folder where the run will, and removes it."""
    runs = tmp_path / "runs"
    runs.mkdir()
    assert run_dir.run_dir_problem(load_job_config(["--job.dump_folder", str(runs / "new"), "--job.name", "r"])) is None
    assert list(tmp_path.rglob("*")) == [runs]


def test_unusable_dump_folders_are_one_line(tmp_path, monkeypatch, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    cfg = lambda dump: load_job_config(["--job.dump_folder", str(dump), "--job.name", "r"])  # noqa: E731
    assert run_dir.run_dir_problem(cfg(blocker)).endswith(": is a file, not a folder")
    assert run_dir.run_dir_problem(cfg(blocker / "deeper" / "runs")).endswith(
        f": {blocker} is a file, so the folder cannot be created")
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "r").write_text("not a directory")
    assert "runs/r is a file, not a run directory" in run_dir.run_dir_problem(cfg(tmp_path / "runs"))
    # Permissions do not stop root: ask os.access as an unprivileged user would be answered.
    locked = tmp_path / "locked"
    locked.mkdir()
    real_access = run_dir.os.access
    monkeypatch.setattr(run_dir.os, "access", lambda p, mode: Path(p) != locked and real_access(p, mode))
    assert run_dir.run_dir_problem(cfg(locked)) == f"config key 'job.dump_folder' = '{locked}': is not writable by this user"
    assert run_dir.run_dir_problem(cfg(locked / "sub")).endswith(f": {locked} is not writable by this user")
    # Through the trainer: exit 2, one line, nothing created.
    before = sorted(tmp_path.rglob("*"))
    assert main([*FAST, "--job.dump_folder", str(blocker / "runs"), "--job.name", "r"]) == 2
    assert "config key 'job.dump_folder'" in _one_error_line(capsys)
    assert sorted(tmp_path.rglob("*")) == before


def test_a_folder_the_service_made_or_a_run_with_a_checkpoint_is_usable(tmp_path):
    cfg = load_job_config(["--job.dump_folder", str(tmp_path), "--job.name", "svc", "--checkpoint.enable", "true"])
    (tmp_path / "svc" / "service").mkdir(parents=True)
    (tmp_path / "svc" / "submitted.toml").write_text("")
    assert run_dir.run_dir_problem(cfg) is None
    (tmp_path / "svc" / "metrics.jsonl").write_text("")
    assert "holds a previous run (metrics.jsonl) and nothing to resume: no complete checkpoint" in run_dir.run_dir_problem(cfg)
    (tmp_path / "svc" / "checkpoints" / "step-2").mkdir(parents=True)
    (tmp_path / "svc" / "checkpoints" / "step-2" / ".metadata").write_bytes(b"x")
    assert run_dir.run_dir_problem(cfg) is None
    cfg.checkpoint.enable = False
    assert "checkpoints are off (checkpoint.enable = false)" in run_dir.run_dir_problem(cfg)


def test_a_torchrun_restart_continues_its_own_job_without_a_checkpoint(tmp_path, monkeypatch):
    cfg = load_job_config(["--job.dump_folder", str(tmp_path), "--job.name", "r"])
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "metrics.jsonl").write_text("")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert "nothing to resume" in run_dir.run_dir_problem(cfg)  # the first attempt reusing a name is refused
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert run_dir.run_dir_problem(cfg) is None  # a restart of the job that wrote these files starts again


def test_reusing_a_name_with_nothing_to_resume_stops_untouched_or_overwrites(tmp_path, capsys):
    args = [*FAST, "--job.dump_folder", str(tmp_path), "--job.name", "r"]
    assert main(args) == 0
    run = tmp_path / "r"
    before = _files(run)
    capsys.readouterr()

    assert main(args) == 2
    line = _one_error_line(capsys)
    assert f"{run} holds a previous run" in line and "job.overwrite = true" in line
    assert _files(run) == before

    # NOTE: what the tools wrote of the previous run (offline evaluation's table, summarize's folder) goes too:
    # left beside the new run they read as its own.
    (run / "eval_table.md").write_text("| step | acc |\n")
    (run / "summary").mkdir()
    (run / "summary" / "summary.md").write_text("old")
    assert main([*args, "--job.overwrite", "true"]) == 0
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert len([x for x in (run / "events.jsonl").read_text().splitlines() if '"kind": "startup"' in x]) == 1
    overwrote = json.loads((run / "manifest.json").read_text())["overwrote"]
    assert {"config.toml", "manifest.json", "metrics.jsonl", "events.jsonl", "stdout.log", "eval_table.md",
            "summary"} <= set(overwrote)
    assert not (run / "eval_table.md").exists() and not (run / "summary").exists()


def _checkpoint_of_another_shape(folder: Path) -> Path:
    """A complete checkpoint of a debug model 96 wide (the CLI's is 64), meta.json as the trainer writes it."""
    other = Run(folder, flavor_kw={"dim": 96}, save_on_stop=False)
    other.manager.meta = {"flavor": "debug", "model_args": asdict(get_flavor("debug", 512).replace(dim=96)),
                          "qb_eta": 1.0, "tokenizer": ""}
    other.update(1)
    other.manager.save(1)
    other.close()
    return folder / "checkpoints" / "step-1"


def test_a_mismatched_initial_load_path_leaves_no_run_directory(tmp_path, capsys):
    step_dir = _checkpoint_of_another_shape(tmp_path / "src")
    export = tmp_path / "export"
    export_checkpoint(step_dir, export)
    assert export_shapes(export)["tok_embeddings.weight"] == (512, 96)
    dump = tmp_path / "runs"
    for source in (step_dir, export):
        assert main([*FAST, "--job.dump_folder", str(dump), "--job.name", "init",
                     "--checkpoint.initial_load_path", str(source)]) == 2
        assert "tok_embeddings.weight" in _one_error_line(capsys)
        assert not dump.exists()


def test_a_run_directory_the_system_will_not_create_names_the_dump_folder(tmp_path, monkeypatch):
    """As root every path reads as writable (/proc too), so the checks before can pass a folder the mkdir then
    refuses: that line names job.dump_folder too (it named a bare path)."""
    cfg = load_job_config(["--job.dump_folder", str(tmp_path / "runs"), "--job.name", "r"])

    def refuse(self, *args, **kwargs):
        raise PermissionError(1, "Operation not permitted", str(self))

    monkeypatch.setattr(run_dir.Path, "mkdir", refuse)
    with pytest.raises(ValueError, match=rf"^config key 'job.dump_folder' = '{tmp_path / 'runs'}': cannot create the run "
                                         rf"directory {tmp_path / 'runs' / 'r'} \(Operation not permitted\)$"):
        run_dir.prepare_run_dir(cfg, {})
