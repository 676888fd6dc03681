"""The service's configuration checkers (`service.admission.TrainerCheck`): a check that hangs is refused in one
line and its process killed; checkers exit when the service is killed outright. Either way no process is left;
a stop leaves nothing to warn of either."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from service_harness import HERE, REPO, gone, hang_check, pid_check
from service.admission import Submission, TrainerCheck
from service.settings import Settings
from titan_k3.config import load_job_config


def _submission(pid_file) -> Submission:
    # NOTE: the stand-in checks read the file for their pid from the TOML text.
    return Submission(run_id="r", toml_text=str(pid_file), overrides={}, nproc_per_node=1, gpus=0,
                      cfg=load_job_config([]))


def test_a_hung_check_is_refused_in_one_line_and_its_process_killed(tmp_path):
    check = TrainerCheck(Settings(state_dir=tmp_path, gpus=0, cpus=1, check_timeout=5.0), check=hang_check)
    try:
        assert check(_submission(tmp_path / "pid")) == "the trainer's configuration check took longer than 5 s"
        hung = int((tmp_path / "pid").read_text())
        assert gone(hung, 10), f"the hung checker {hung} still runs"
        check.check = pid_check  # the next check gets a fresh pool
        assert check(_submission(tmp_path / "pid2")) is None
        assert int((tmp_path / "pid2").read_text()) != hung
    finally:
        check.close()
    assert gone(int((tmp_path / "pid2").read_text()), 10)


def test_checkers_exit_when_the_service_is_killed(tmp_path):
    """A service killed with SIGKILL cannot shut its pool down: its checkers must notice and exit."""
    script = textwrap.dedent(f"""
        import os, signal
        from pathlib import Path
        from service_harness import pid_check
        from service.admission import Submission, TrainerCheck
        from service.settings import Settings
        from titan_k3.config import load_job_config
        check = TrainerCheck(Settings(state_dir=Path({str(tmp_path)!r}), gpus=0, cpus=1), check=pid_check)
        sub = Submission(run_id="r", toml_text={str(tmp_path / "pid")!r}, overrides={{}}, nproc_per_node=1, gpus=0,
                         cfg=load_job_config([]))
        assert check(sub) is None
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(HERE), str(HERE.parent)])}  # + ports.py
    # NOTE: output to a file, not a pipe: a checker that outlived the service would hold a pipe open.
    with open(tmp_path / "service.log", "w") as log:
        service = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, stdout=log, stderr=log,
                                 timeout=120)
    assert service.returncode == -9, (tmp_path / "service.log").read_text()[-2000:]
    checker = int((tmp_path / "pid").read_text())
    assert gone(checker, 10), f"checker {checker} outlived the killed service"


def test_a_service_stopped_after_checking_leaves_nothing_and_warns_of_nothing(make_service):
    """SIGTERM after a checked run: the checkers' pool is shut down with its queues released (a pool left to the
    interpreter's exit had multiprocessing warn of leaked semaphores; before the fix about one stop in three)."""
    svc = make_service("leak", fake=True)
    assert svc.create(recipe="smoke", name="checked", overrides={"training.steps": 3}).status_code == 201
    svc.wait_state("checked", ("finished",))
    svc.close()
    log = svc.log_path.read_text()
    assert "Application shutdown complete" in log and "leaked" not in log, log[-2000:]
