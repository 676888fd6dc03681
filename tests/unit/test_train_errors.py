"""The trainer's refusals under torchrun: a line every rank raises is printed once, a line of one rank by that rank.

The ranks are simulated in this process: each `main` call sets the environment torchrun gives a worker, and a real
TCPStore server stands in for the one torchrun's agent keeps.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch.distributed as dist

from ports import free_port
from titan_k3.config.check import CONFIG_ERROR_EXIT
from titan_k3.train import main


@pytest.fixture
def torchrun_env(monkeypatch):
    """Set up a store as torchrun's agent does; returns a function that makes this process rank `r` of 2."""
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=10))

    def as_rank(rank: int, restart: int = 0) -> None:
        for key, value in {"WORLD_SIZE": "2", "RANK": str(rank), "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
                           "MASTER_PORT": str(port), "TORCHELASTIC_USE_AGENT_STORE": "True",
                           "TORCHELASTIC_RESTART_COUNT": str(restart)}.items():
            monkeypatch.setenv(key, value)

    yield as_rank
    del store


def test_a_config_error_of_every_rank_is_printed_once(torchrun_env, capsys):
    printed = []
    for rank in (1, 0):  # whichever rank gets there first prints; the others exit with the same status
        torchrun_env(rank)
        assert main(["--training.stepz", "3"]) == CONFIG_ERROR_EXIT
        printed.append(capsys.readouterr().err)
    assert printed == ["error: unknown config key 'training.stepz'; did you mean 'training.steps'?\n", ""]
    # A restarted attempt (torchrun --max-restarts) reports it again, once.
    torchrun_env(0, restart=1)
    assert main(["--training.stepz", "3"]) == CONFIG_ERROR_EXIT
    assert capsys.readouterr().err.startswith("error: unknown config key 'training.stepz'")


def test_an_error_of_one_rank_is_printed_by_that_rank(torchrun_env, capsys, tmp_path):
    torchrun_env(0)
    assert main(["--training.stepz", "3"]) == CONFIG_ERROR_EXIT
    capsys.readouterr()
    torchrun_env(1)  # a file missing on this rank's host only: its own line
    assert main(["--data.tokenizer", str(tmp_path / "tok.json")]) == CONFIG_ERROR_EXIT
    assert capsys.readouterr().err == f"error: config key 'data.tokenizer' = '{tmp_path}/tok.json': no such file or directory\n"


def test_without_torchruns_store_every_rank_prints(monkeypatch, capsys):
    """Ranks started by another launcher (env:// by hand, Slurm's srun) have no store before the process group."""
    for rank in (0, 1):
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setenv("RANK", str(rank))
        assert main(["--training.stepz", "3"]) == CONFIG_ERROR_EXIT
        assert capsys.readouterr().err.startswith("error: unknown config key 'training.stepz'")


@pytest.mark.parametrize("key, kind, expected", [
    ("data.tokenizer", "dir", "is a directory, not a file"),
    ("eval.tasks", "dir", "is a directory, not a file"),
    ("checkpoint.initial_load_path", "file", "not a directory (expected a checkpoint step-N directory"),
    ("data.tokenizer", "bad", "tokenizer '{path}': not a valid HF tokenizer.json"),
    ("eval.tasks", "bad", "task file '{path}' line 1: expected"),
])
def test_a_path_of_the_wrong_kind_or_content_is_one_line_naming_its_key(tmp_path, capsys, key, kind, expected):
    """A checkpoint path that is a file was a NotADirectoryError traceback (exit 1); a tokenizer or a task file that
    is a directory said 'no such file', and one that does not parse named no key."""
    path = tmp_path / "x.json"
    if kind == "dir":
        path.mkdir()
    else:
        path.write_text("{}\n")
    argv = ["--model.flavor", "debug", "--training.seq_len", "64", "--job.dump_folder", str(tmp_path / "runs")]
    assert main([*argv, f"--{key}", str(path)]) == CONFIG_ERROR_EXIT
    err = capsys.readouterr().err
    assert err.startswith(f"error: config key '{key}' = '{path}': " + expected.format(path=path)), err
    assert err.count("\n") == 1
    assert not (tmp_path / "runs").exists()


def test_a_run_whose_stdout_reader_has_gone_trains_on(tmp_path):
    """`python -m titan_k3.train ... | head` ended the run with a BrokenPipeError traceback at its next line (exit 1,
    no metrics); it trains on, and stdout.log keeps every line."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    read_end, write_end = os.pipe()
    os.close(read_end)  # gone before the first line, so the first write fails for certain
    try:
        proc = subprocess.run([sys.executable, "-m", "titan_k3.train", "--model.flavor", "debug", "--training.seq_len",
                               "64", "--training.steps", "2", "--job.dump_folder", str(tmp_path), "--job.name", "p"],
                              cwd=Path(__file__).resolve().parents[2], stdout=write_end, stderr=subprocess.PIPE,
                              text=True, timeout=600)
    finally:
        os.close(write_end)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr
    assert '"step": 2,' in (tmp_path / "p" / "metrics.jsonl").read_text().splitlines()[-1]
    assert "files: " in (tmp_path / "p" / "stdout.log").read_text()
