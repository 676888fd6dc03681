"""A configuration error under the real torchrun (2 CPU ranks): one `error:` line, every rank torchrun saw end exits 2,
torchrun's failure summary shows that line for each, and the control service reads it as a refusal."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from service.attempts import config_error
from service.registry import Attempt
from titan_k3.signals import start_up_stop_line

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone",
            "--monitor-interval", "0.2"]


def _check_refusal(tmp_path: Path, argv: list[str], line: str, ranks_listed: tuple[int, ...]) -> str:
    """torchrun over `argv` ends as one refusal whose `error:` line starts with `line`, with `ranks_listed` the
    counts of ranks its failure summary may list. Returns its output."""
    runs = tmp_path / "runs"
    out = subprocess.run([*TORCHRUN, *argv, "--job.dump_folder", str(runs)], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    text = out.stdout + out.stderr
    errors = [e for e in text.splitlines() if e.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith(line), text
    # torchrun exits 1 whenever a worker failed. Its summary lists the ranks that had ended when it first saw one
    # fail, each with the configuration error's status (none ended by torchrun's SIGTERM) and our line where a
    # traceback would be: the control service's test for a refusal it must not relaunch (service/attempts.py).
    assert out.returncode == 1, text
    codes = re.findall(r"^\s*exitcode\s*:\s*(-?\d+)", out.stderr, re.MULTILINE)
    assert len(codes) in ranks_listed and set(codes) == {"2"}, text
    assert out.stderr.count(f"  traceback : {errors[0]}\n") == len(codes), text
    log = tmp_path / "console.log"
    log.write_text(text)
    attempt = Attempt("r", 1, 0, 0.0, 0.0, None, None, [], str(log), "")
    assert config_error("torchrun", attempt, out.returncode) == errors[0].removeprefix("error: "), text
    assert "To enable traceback" not in text and "titan_k3/" not in text, text  # no frame of ours
    assert not runs.exists() or not list(runs.iterdir())
    return text


@pytest.mark.parametrize("bad, line", [
    (["--training.stepz", "3"], "error: unknown config key 'training.stepz'; did you mean 'training.steps'?"),
    # the mesh, refused before the process group
    (["--parallelism.data_parallel_shard_degree", "3"], "error: config key 'parallelism.data_parallel_shard_degree'"),
])
def test_a_config_error_is_printed_once_and_read_as_one_from_torchruns_summary(tmp_path, bad, line):
    # Both ranks listed, most often; one when the other was still importing torch as the first's wait for it
    # (CONFIG_ERROR_PEERS_S) ran out on a loaded machine: torchrun stopped it, and a rank it stops is not listed.
    _check_refusal(tmp_path, ["-m", "titan_k3.train", "--model.flavor", "tiny", "--training.device", "cpu", *bad],
                   line, ranks_listed=(1, 2))


def test_a_rank_still_starting_when_its_peer_refuses_leaves_one_refusal(tmp_path):
    """Rank 0 is still in its start-up imports (under the trainer's start-up handlers) when rank 1 refuses and its
    wait for rank 0 runs out: torchrun stops rank 0, which ends as a stop during start-up, and the summary lists
    rank 1 alone: still one line, still read as a refusal, not a crash to relaunch."""
    wrapper = tmp_path / "rank_zero_late.py"
    wrapper.write_text("import os, runpy, time\n"
                       "if os.environ['RANK'] == '0':\n"
                       "    from titan_k3.signals import exit_on_stop_signals\n"
                       "    exit_on_stop_signals()\n"
                       "    time.sleep(300)  # an import that outlasts the peer's wait\n"
                       "runpy.run_module('titan_k3.train', run_name='__main__', alter_sys=True)\n")
    text = _check_refusal(tmp_path, [str(wrapper), "--training.device", "cpu", "--training.stepz", "3"],
                          "error: unknown config key 'training.stepz'", ranks_listed=(1,))
    assert start_up_stop_line(signal.SIGTERM) in text, text


def test_a_crash_shows_its_traceback_in_torchruns_summary(tmp_path):
    """A bug (not a refusal) keeps its traceback: the summary shows it, as torch's @record would."""
    wrapper = tmp_path / "crashes.py"
    wrapper.write_text("import runpy, titan_k3.config\n"
                       "def crash(*a, **k):\n    raise RuntimeError('a bug in the loader')\n"
                       "titan_k3.config.load_job_config = crash\n"
                       "runpy.run_module('titan_k3.train', run_name='__main__', alter_sys=True)\n")
    out = subprocess.run([*TORCHRUN, str(wrapper), "--training.device", "cpu"], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 1, out.stderr
    assert "traceback : Traceback (most recent call last):" in out.stderr, out.stderr
    assert "RuntimeError: a bug in the loader" in out.stderr.split("Root Cause")[1], out.stderr


def test_an_error_of_one_rank_ends_the_job_without_torchruns_sigkill(tmp_path):
    """Rank 1 alone refuses its arguments (a file missing on its host); rank 0 waits in the rendezvous, where Python
    runs no signal handler: torchrun's SIGTERM waited 30 s for its SIGKILL. Now rank 0 ends on it."""
    wrapper = tmp_path / "rank_one_differs.py"
    wrapper.write_text("import os, runpy, sys\n"
                       "if os.environ['RANK'] == '1':\n"
                       f"    sys.argv.append('--data.tokenizer={tmp_path}/missing.json')\n"
                       "runpy.run_module('titan_k3.train', run_name='__main__', alter_sys=True)\n")
    cmd = [*TORCHRUN, str(wrapper), "--model.flavor", "debug", "--training.device", "cpu",
           "--job.dump_folder", str(tmp_path / "runs")]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    text = out.stdout + out.stderr
    errors = [line for line in text.splitlines() if line.startswith("error: ")]
    missing = f"'{tmp_path}/missing.json': no such file or directory"
    assert errors == [f"error: config key 'data.tokenizer' = {missing}"], text
    assert "SIGKILL" not in text and "exitcode  : 2 " in text, text
