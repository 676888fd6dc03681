#!/usr/bin/env python3
"""torchrun for orchestrators that signal the launcher: a stop reaches the ranks, and exits 0.

    k3_torchrun.py [torchrun arguments] -m titan_k3.train [trainer arguments]
    (in the image: k3-torchrun ...)

Kubernetes signals a container's main process and Slurm signals a step's processes. torchrun,
signalled itself, forwards SIGTERM to its workers, SIGKILLs those still running after its
shutdown timeout (fixed at 30 s in torch 2.11; TORCH_ELASTIC_SHUTDOWN_TIMEOUT in 2.13) and
exits 1 even when every rank saved, so the orchestrator records a failure. This wrapper runs
torchrun as a child and, on SIGTERM, SIGINT or SIGUSR1, sends SIGTERM to torchrun's workers
(the ranks) instead. Each rank finishes its update, saves a checkpoint and exits 0 (one rank's
stop stops them all after the same update), torchrun sees a worker group that succeeded and
exits 0, and so does this wrapper: its status is torchrun's. No timeout of torchrun applies,
so the save has whatever the orchestrator grants (terminationGracePeriodSeconds, Slurm's lead).

SIGUSR1 is for Slurm, where a signal to a step reaches every process in it: torchrun and the
ranks start with SIGUSR1 ignored, so only this wrapper acts on it (srun itself turns SIGTERM
into SIGKILL for its tasks, so the batch script forwards a stop as SIGUSR1).
A stop before torchrun has started its workers (rendezvous) goes to torchrun itself, which
then exits non-zero: nothing had been trained.

Linux only (reads /proc); standard library only, so it runs before anything is installed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


def children(pid: int) -> list[int]:
    """Pids of the live processes whose parent is `pid`."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # the process exited while we listed /proc
            continue
        # NOTE: field 2 (the command name) may hold spaces and ')'; state and ppid follow the last ')'.
        state, ppid = text[text.rindex(")") + 2:].split()[:2]
        if int(ppid) == pid and state != "Z":
            found.append(int(stat.parent.name))
    return found


def _ignore_usr1() -> None:
    """In torchrun's process before exec: SIGUSR1 stays ignored there and in the ranks it starts."""
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if argv else 2
    # NOTE: a session of its own, so a terminal's Ctrl-C (sent to the foreground group) reaches
    # torchrun only through this wrapper's handler, never directly.
    torchrun = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *argv],
                                preexec_fn=_ignore_usr1, start_new_session=True)

    def stop(signum: int, _frame) -> None:
        ranks = children(torchrun.pid)
        targets = ranks or [torchrun.pid]
        who = "the ranks" if ranks else "torchrun (no ranks started yet)"
        print(f"k3-torchrun: {signal.Signals(signum).name} received: SIGTERM to {who} {targets}",
              file=sys.stderr, flush=True)
        for pid in targets:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:  # it exited between the listing and the signal
                pass

    for s in STOP_SIGNALS:
        signal.signal(s, stop)
    rc = torchrun.wait()
    # A child killed by signal N reads as -N here; a shell reports it as 128 + N.
    return rc if rc >= 0 else 128 - rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
