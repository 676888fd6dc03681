"""How the trainer's command line reports a failure: one line per torchrun job, and in torchrun's failure summary.

A refusal of the input (`error: <what, where>`) is printed once per job however many ranks raise it (`first_to_report`,
through torchrun's key-value store), written to each rank's error file for torchrun's summary (`write_error_file`), and
ends a rank with CONFIG_ERROR_EXIT so that the control service does not relaunch it (`exit_on_config_error`). The
trainer's standard streams keep taking writes after their reader has gone (`OutlivesItsReader`).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import signal
import sys
import time
from datetime import timedelta

import torch.distributed as dist

from titan_k3.config.check import CONFIG_ERROR_EXIT
from titan_k3.signals import StopSignals


def first_to_report(line: str, wait_s: float = 0.0) -> bool:
    """Whether this rank is the first of its torchrun job to report `line` (True outside torchrun).

    wait_s: how long to wait, at most, for every rank of the job to have reported the same line before answering.

    NOTE: every rank validates the same arguments, so a bad key would print one line per rank. The ranks count each
    line in torchrun's own key-value store (on MASTER_ADDR:MASTER_PORT from before the workers start, kept by
    torchrun's agent) and the first to count it prints it: a line only some ranks raise, a file missing on one host,
    is still printed by its rank. Where the store cannot answer, every rank prints.
    """
    world = int(os.environ.get("WORLD_SIZE", 1))
    if world == 1 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return True
    key = f"titan_k3/reported/{os.environ.get('TORCHELASTIC_RESTART_COUNT', 0)}/{hashlib.sha1(line.encode()).hexdigest()}"
    try:
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                              timeout=timedelta(seconds=10))
        first = store.add(key, 1) == 1
        deadline = time.monotonic() + wait_s
        while store.add(key, 0) < world and time.monotonic() < deadline:
            time.sleep(0.02)
        return first
    except (KeyError, ValueError, RuntimeError):  # RuntimeError: torch's DistStoreError and connection failures
        return True


def report_error(e: BaseException, wait_s: float = 0.0) -> None:
    """`error: <e>` on stderr, one line, once per torchrun job (`first_to_report`), and in every rank's error file."""
    line = "error: " + " ".join(str(e).split())
    write_error_file(line)
    if first_to_report(line, wait_s):
        print(line, file=sys.stderr, flush=True)


CONFIG_ERROR_PEERS_S = 2.0
"""Seconds a rank refusing its configuration waits, at most, for the job's other ranks to refuse it too."""


def exit_on_config_error(e: BaseException) -> None:
    """The command line's end on a configuration error: `error: <e>` and status CONFIG_ERROR_EXIT, on every rank.

    NOTE: once one rank has exited, torchrun sends SIGTERM to the others. A rank still on its way to the same refusal
    then ended as a stop (status 0, and a [stopped] line) or, in the interpreter's shutdown, by the signal itself
    (-15): torchrun's failure summary no longer said every rank refused its configuration, which is how the control
    service knows not to relaunch it. So the ranks wait for each other (CONFIG_ERROR_PEERS_S), take no stop signal
    from here on, and end at once; there is nothing to save or close before any work.
    """
    for s in StopSignals.SIGNALS:
        signal.signal(s, signal.SIG_IGN)
    report_error(e, wait_s=CONFIG_ERROR_PEERS_S)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(CONFIG_ERROR_EXIT)


def write_error_file(line: str) -> None:
    """`line` as this rank's failure in torchrun's failure summary: its `traceback :` field shows it in place of a
    link to torch's documentation.

    NOTE: torchrun's agent names a file per worker in TORCHELASTIC_ERROR_FILE and reads it when the worker fails. The
    JSON is the one torch.distributed.elastic's ErrorHandler.record_exception writes, less the `py_callstack` the
    summary would show in its place (a mistake in the input has no traceback worth showing); torch 2.11 and 2.13 read
    it alike. Unwritable, the summary shows torch's link, and the `error:` line still says what went wrong.
    """
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    failure = {"message": {"message": line, "extraInfo": {"timestamp": str(int(time.time()))}}}
    try:
        with open(path, "w") as f:
            json.dump(failure, f)
    except OSError:
        pass


class OutlivesItsReader:
    """A standard stream that keeps taking writes after its reader has gone (`| head`, a `| tee` that was killed, a
    closed terminal): its file descriptor then points to /dev/null, and the run trains on, or saves on the SIGHUP of
    its closed terminal (stdout.log keeps every line).

    NOTE: Python ignores SIGPIPE, so a write to a closed pipe raises BrokenPipeError wherever the trainer prints:
    a training run ended with a traceback at its next log line, without its stop's checkpoint.
    """

    def __init__(self, stream):
        self.stream = stream

    def write(self, text: str) -> int:
        try:
            return self.stream.write(text)
        except OSError as e:
            self._to_devnull(e)
            return len(text)

    def flush(self) -> None:
        try:
            self.stream.flush()
        except OSError as e:
            self._to_devnull(e)

    def _to_devnull(self, e: OSError) -> None:
        if e.errno not in (errno.EPIPE, errno.EIO):  # EIO: the terminal it wrote to has closed (SIGHUP's)
            raise e
        os.dup2(os.open(os.devnull, os.O_WRONLY), self.stream.fileno())

    def __getattr__(self, name: str):
        return getattr(self.stream, name)
