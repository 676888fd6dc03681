"""A configuration error under the real torchrun (2 CPU ranks): one `error:` line, every rank exits 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("bad", [
    ["--training.stepz", "3"],  # the TOML / CLI validation
    ["--parallelism.data_parallel_shard_degree", "3"],  # the mesh, refused before the process group
])
def test_a_config_error_is_printed_once_and_every_rank_exits_2(tmp_path, bad):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone",
           "--monitor-interval", "0.2", "-m", "titan_k3.train", "--training.device", "cpu",
           "--job.dump_folder", str(tmp_path), *bad]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    errors = [line for line in (out.stdout + out.stderr).splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and bad[0][2:] in errors[0], out.stdout + out.stderr
    assert out.returncode != 0
    # torchrun's summary lists the failed ranks; each exited with the configuration error's status.
    assert (out.stderr.count("exitcode  : 2 ") >= 1 and "exitcode  : 1 " not in out.stderr), out.stderr
    assert not list(tmp_path.iterdir())


def test_an_error_of_one_rank_ends_the_job_without_torchruns_sigkill(tmp_path):
    """Rank 1 alone refuses its arguments (a file missing on its host); rank 0 waits in the rendezvous, where Python
    runs no signal handler: torchrun's SIGTERM waited 30 s for its SIGKILL. Now rank 0 ends on it."""
    wrapper = tmp_path / "rank_one_differs.py"
    wrapper.write_text("import os, runpy, sys\n"
                       "if os.environ['RANK'] == '1':\n"
                       f"    sys.argv.append('--data.tokenizer={tmp_path}/missing.json')\n"
                       "runpy.run_module('titan_k3.train', run_name='__main__', alter_sys=True)\n")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone",
           "--monitor-interval", "0.2", str(wrapper), "--model.flavor", "debug", "--training.device", "cpu",
           "--job.dump_folder", str(tmp_path / "runs")]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    text = out.stdout + out.stderr
    errors = [line for line in text.splitlines() if line.startswith("error: ")]
    assert errors == [f"error: config key 'data.tokenizer' = '{tmp_path}/missing.json': no such file or directory"], text
    assert "SIGKILL" not in text and "exitcode  : 2 " in text, text
