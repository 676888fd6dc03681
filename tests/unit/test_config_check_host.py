"""`python -m titan_k3.config.check` (the service's check before a launch) against the host: it refuses what the run
would, with the run's line."""

from __future__ import annotations

import os

import pytest

from titan_k3.config import load_job_config
from titan_k3.config.check import CONFIG_ERROR_EXIT, config_error, main
from titan_k3.metrics.run_dir import run_dir_problem


@pytest.mark.parametrize("where", ["proc", "file"])
def test_the_check_refuses_a_dump_folder_the_run_refuses_with_its_line(tmp_path, capsys, where):
    """A recipe's own job.dump_folder on /proc (or under a file): the check said 'config ok', and the run stopped on
    it at its start; the check now stops on the run's line."""
    if where == "proc" and not os.path.isdir("/proc"):
        pytest.skip("no /proc")
    blocker = tmp_path / "file"
    blocker.write_text("x")
    dump = "/proc/titan_k3-runs" if where == "proc" else str(blocker / "runs")
    recipe = tmp_path / "recipe.toml"
    recipe.write_text(f'[job]\ndump_folder = "{dump}"\nname = "r"\n')
    line = config_error(["--job.config_file", str(recipe)])
    assert line is not None and line.startswith(f"config key 'job.dump_folder' = '{dump}': ")
    assert line == run_dir_problem(load_job_config(["--job.config_file", str(recipe)]))
    assert main(["--job.config_file", str(recipe)]) == CONFIG_ERROR_EXIT
    assert capsys.readouterr().err == f"error: {line}\n"


def test_the_check_leaves_nothing_in_a_usable_dump_folder(tmp_path, capsys):
    dump = tmp_path / "runs"
    assert main(["--job.dump_folder", str(dump / "deeper"), "--job.name", "r"]) == 0
    assert capsys.readouterr().out == "config ok\n"
    assert list(tmp_path.iterdir()) == []
