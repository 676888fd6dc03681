"""debug.crash_at_step: off by default, announced when on, and an exit with status 3 after exactly that update."""

import subprocess
import sys

from titan_k3.config import JobConfig, load_job_config
from titan_k3.run_faults import RunFaults


def test_off_by_default_and_announced_when_on():
    assert RunFaults.from_debug(JobConfig().debug).active() == {}
    cfg = load_job_config(["--debug.crash_at_step", "4"])
    assert RunFaults.from_debug(cfg.debug).active() == {"debug.crash_at_step": 4}


def test_exits_with_status_3_after_that_update_only():
    code = ("from titan_k3.run_faults import RunFaults\n"
            "f = RunFaults(crash_at_step=2)\n"
            "for step in (1, 2, 3):\n"
            "    print('update', step, flush=True)\n"
            "    f.after_update(step)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 3
    assert done.stdout.splitlines() == ["update 1", "update 2", "debug.crash_at_step = 2: exiting with status 3"]
