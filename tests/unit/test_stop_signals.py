"""SIGTERM and SIGINT on a real `python -m titan_k3.train` process, and the handler's rules in-process.

- SIGTERM while the first update compiles: the process stops at once (exit 0), saving nothing, since
  nothing new exists; a compile must not hold the request past the sender's grace period.
- SIGINT (Ctrl-C) after an update: the update finishes, a checkpoint is saved, exit 130; `[stopped]` once.
  The run read more than one epoch of its corpus, so a data_epochs warning is in events.jsonl and the
  manifest names the dataset. Resumed for two more updates, both clocks count that session's work only.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from titan_k3.metrics.events import EventLog
from titan_k3.signals import EXIT_STATUS, StopNow, StopSignals
from titan_k3.tools.summarize import summarize

REPO = Path(__file__).resolve().parents[2]
SEQ = 64
BASE = ["--job.config_file", "tomls/smoke.toml", "--model.flavor", "debug", "--training.seq_len", str(SEQ),
        "--training.device", "cpu", "--metrics.log_freq", "1", "--kernels.precompile_threads", "0"]


def _default_stops() -> None:
    """In each child before exec: the stop signals at their defaults.

    NOTE: a test run started by `nohup` or with `&` from a script hands its children SIGHUP / SIGINT ignored, and
    the trainer keeps an ignored stop signal ignored (as a shell user expects of nohup); these tests are about a
    process started as a terminal or a scheduler starts one.
    """
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, signal.SIG_DFL)


@pytest.fixture(autouse=True)
def _stops_at_their_defaults_here():
    """The same for this process's own in-process tests (Python maps a default SIGINT to KeyboardInterrupt)."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGHUP)}
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    yield
    for s, handler in saved.items():
        signal.signal(s, handler)


class Trainer:
    """`python -m titan_k3.train` in a subprocess; its output collected line by line as it comes."""

    def __init__(self, *args: str):
        self.lines: list[str] = []
        self.proc = subprocess.Popen([sys.executable, "-u", "-m", "titan_k3.train", *BASE, *args], cwd=REPO,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     preexec_fn=_default_stops)
        self._reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True)
        self._reader.start()

    def wait_for(self, text: str, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while not any(text in line for line in self.lines):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                pytest.fail(f"never printed {text!r}:\n{''.join(self.lines[-30:])}")
            time.sleep(0.05)

    def finish(self, timeout: float = 300) -> int:
        rc = self.proc.wait(timeout)
        self._reader.join(timeout)
        return rc

    def printed(self, text: str) -> list[str]:
        return [line for line in self.lines if text in line]


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.slow
def test_sigterm_during_a_compiling_first_update_stops_at_once(tmp_path):
    run = Trainer("--training.steps", "5", "--compile.enable", "true", "--compile.backend", "aot_eager",
                  "--checkpoint.enable", "true", "--job.dump_folder", str(tmp_path), "--job.name", "term")
    run.wait_for("[kernel_report]")  # printed while the trainer builds; the first update follows within a blink
    time.sleep(1.5)  # NOTE: dynamo traces the first update of the debug model for several seconds at least
    run.proc.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    run.wait_for("[stopped]", timeout=30)
    assert time.monotonic() - sent < 30
    assert run.finish() == 0
    (stopped,) = run.printed("[stopped]")
    assert "SIGTERM received before this session's first update finished: stopping now, nothing new to save" in stopped
    assert not run.printed("step      1 |")
    run_dir = tmp_path / "term"
    assert _records(run_dir / "metrics.jsonl") == []
    assert not list((run_dir / "checkpoints").glob("step-*"))
    assert [e["kind"] for e in _records(run_dir / "events.jsonl")].count("stopped") == 1


@pytest.mark.slow
def test_sigint_saves_after_the_update_exits_130_and_the_resumed_session_counts_its_own_work(tmp_path):
    # 20,000 updates of 64 tokens are 1.28M tokens: more than the embedded corpus's 1.09M.
    common = ["--checkpoint.enable", "true", "--checkpoint.interval", "100000", "--job.dump_folder", str(tmp_path),
              "--job.name", "int"]
    run = Trainer("--training.steps", "20000", *common)
    run.wait_for("step      1 |")
    run.proc.send_signal(signal.SIGINT)
    assert run.finish() == EXIT_STATUS[signal.SIGINT] == 130
    (stopped,) = run.printed("[stopped]")
    assert "SIGINT received: stopping after update" in stopped and "with a checkpoint" in stopped
    run_dir = tmp_path / "int"
    saved = int((run_dir / "checkpoints/latest").read_text().strip().removeprefix("step-"))  # a text file: "step-N"
    assert saved >= 1 and (run_dir / f"checkpoints/step-{saved}").is_dir()

    manifest = json.loads((run_dir / "manifest.json").read_text())["dataset"]
    assert manifest["dataset"] == "embedded" and len(manifest["sha256"]) == 64
    assert manifest["run_tokens"] == 20000 * SEQ and manifest["epochs"] == pytest.approx(20000 * SEQ / manifest["tokens"], 1e-3)
    assert sum(manifest["tokens_per_source"].values()) == manifest["tokens"]
    (warning,) = [e for e in _records(run_dir / "events.jsonl") if e["kind"] == "data_epochs"]
    assert warning["epochs"] > 1 and "python -m titan_k3.data.prepare" in warning["message"]
    assert run.printed("[data_epochs]") and run.printed("data: embedded (sha256 ")
    assert run.printed("mesh: world 1 = dp_replicate 1 x dp_shard 1 (one process, no device mesh)")

    again = Trainer("--training.steps", str(saved + 2), *common)
    assert again.finish() == 0, "".join(again.lines[-30:])
    last = _records(run_dir / "metrics.jsonl")[-1]
    assert last["step"] == saved + 2 and last["tokens_seen"] == (saved + 2) * SEQ
    assert last["session_tokens"] == 2 * SEQ  # this session's two updates, not the run's
    assert last["tokens_per_second_session"] == pytest.approx(2 * SEQ / last["session_seconds"])
    _, numbers = summarize(run_dir)
    assert numbers["sessions"] == 2 and numbers["tokens_per_second_session"] == pytest.approx(
        2 * SEQ / last["session_seconds"])


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_stop_during_the_imports_exits_at_once_with_its_status_and_one_line(tmp_path, signum):
    """Ctrl-C in the seconds `import torch` takes printed a KeyboardInterrupt traceback (SIGTERM: killed, -15)."""
    proc = subprocess.Popen([sys.executable, "-u", "-X", "importtime", "-m", "titan_k3.train", *BASE,
                             "--job.dump_folder", str(tmp_path), "--job.name", "early"], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=_default_stops)
    lines = []
    for line in proc.stdout:  # -X importtime: a line as each module is imported
        lines.append(line)
        if line.split("|")[-1].strip() == "torch.version":  # inside `import torch`, after the trainer's first lines
            proc.send_signal(signum)
            break
    out = "".join(lines) + proc.stdout.read()
    assert proc.wait(60) == EXIT_STATUS[signum], out[-3000:]
    assert f"[stopped] {signal.Signals(signum).name} received during start-up: stopping now, nothing to save" in out
    assert "Traceback" not in out and "KeyboardInterrupt" not in out
    assert not (tmp_path / "early").exists()


def test_the_first_signal_raises_before_the_hand_over_and_goes_to_the_sink_after():
    before = signal.getsignal(signal.SIGTERM)
    stop = StopSignals()
    try:
        with pytest.raises(StopNow) as e:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1)  # the handler runs at the next bytecode; never reached
        assert e.value.signum == signal.SIGTERM
        os.kill(os.getpid(), signal.SIGINT)  # a second signal is ignored: no KeyboardInterrupt, no StopNow
        time.sleep(0.05)

        handed = StopSignals()
        got = []
        handed.hand_over(got.append)
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        assert got == [signal.SIGINT] and handed.signum == signal.SIGINT
        handed.restore()
    finally:
        stop.restore()
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_stop_swallowed_before_the_hand_over_is_raised_again_by_check():
    """A StopNow raised inside code that drops exceptions (here a __del__) must not lose the stop."""
    stop = StopSignals()
    try:
        stop.check()  # nothing received: nothing raised

        class Finalised:
            def __del__(self):
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.5)  # the handler raises StopNow here; Python reports it and carries on

        Finalised()
        assert stop.signum == signal.SIGTERM  # received, but nothing stopped
        with pytest.raises(StopNow) as e:
            stop.check()
        assert e.value.signum == signal.SIGTERM
        got = []
        stop.hand_over(got.append)
        stop.check()  # after the hand-over the sink owns the stop: no raise
        assert got == []
    finally:
        stop.restore()


def test_only_rank_zero_echoes_events(tmp_path, capsys):
    """Every rank emits a stop; the trainer's logs echo on rank 0 only, so `[stopped]` prints once."""
    quiet, loud = EventLog(None, echo=False), EventLog(tmp_path / "events.jsonl", echo=True)
    for log in (quiet, loud):
        log.emit("stopped", "SIGTERM received: stopping after update 3", step=3)
    assert capsys.readouterr().out.count("[stopped]") == 1
    assert quiet.counts == loud.counts == {"stopped": 1}


_WAITS_IN_CPP = """
from datetime import timedelta
import torch.distributed as dist
from titan_k3.signals import StopSignals

stop = StopSignals(watchdog={watchdog})
store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=60))
print("waiting", flush=True)
try:
    store.get("never")  # C++ code: Python runs no signal handler until it returns, as in a rendezvous
finally:
    stop.restore()
"""


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_during_start_up_ends_a_process_that_waits_in_cpp(signum):
    """A rank that waits in the process group's rendezvous or a collective (a peer stopped on an error) held
    torchrun's SIGTERM until torchrun's SIGKILL 30 s later; the watchdog ends it START_UP_GRACE_S after the signal."""
    from titan_k3.signals import START_UP_GRACE_S, start_up_stop_line

    proc = subprocess.Popen([sys.executable, "-c", _WAITS_IN_CPP.format(watchdog=True)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=_default_stops)
    assert proc.stdout.readline() == "waiting\n"
    time.sleep(0.5)  # inside store.get
    sent = time.monotonic()
    proc.send_signal(signum)
    assert proc.wait(START_UP_GRACE_S + 20) == EXIT_STATUS[signum]
    assert START_UP_GRACE_S - 0.5 < time.monotonic() - sent < START_UP_GRACE_S + 20
    assert proc.stdout.read() == start_up_stop_line(signum) + "\n"


def test_without_the_watchdog_the_wait_holds_the_stop():
    """What the watchdog is for (and why only the command line's process has it: an embedding one keeps control)."""
    proc = subprocess.Popen([sys.executable, "-c", _WAITS_IN_CPP.format(watchdog=False)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=_default_stops)
    try:
        assert proc.stdout.readline() == "waiting\n"
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(8)
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.slow
def test_sighup_saves_after_the_update_and_exits_129(tmp_path):
    """A closed terminal's SIGHUP (torchrun forwards it to its workers) killed the run without its checkpoint."""
    run = Trainer("--training.steps", "20000", "--checkpoint.enable", "true", "--checkpoint.interval", "100000",
                  "--job.dump_folder", str(tmp_path), "--job.name", "hup")
    run.wait_for("step      1 |")
    run.proc.send_signal(signal.SIGHUP)
    assert run.finish() == EXIT_STATUS[signal.SIGHUP] == 129
    (stopped,) = run.printed("[stopped]")
    assert "SIGHUP received: stopping after update" in stopped and "with a checkpoint" in stopped
    assert (tmp_path / "hup/checkpoints/latest").is_file()


def test_a_stop_signal_ignored_at_the_start_stays_ignored():
    """`nohup python -m titan_k3.train ...`: closing the terminal must not stop the run."""
    before = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        stop = StopSignals()
        stop.install()  # the trainer takes the signals again after the checkpointer's handler
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) == stop._handle
        stop.restore()
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, before)
