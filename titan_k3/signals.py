"""SIGTERM and SIGINT (Ctrl-C): honoured at the next safe point, never held by a long first update.

A safe point is the end of an update: the checkpointer saves there and the loop
exits (CheckpointManager.after_step, whose stop flag this module sets). Before
this session's first update has finished there is nothing new to save (the state
is the checkpoint the run resumed from, or the seeded start), so a signal then
stops the process at once with `StopNow`: a first update that compiles for
minutes would otherwise hold the request past the grace period of whoever sent
it (torchrun, Slurm and Kubernetes kill after one). Where library code swallows
that StopNow, the trainer raises it again when the first update returns
(`StopSignals.check`), still without a save. NOTE: this early stop is
not agreed between ranks (the ranks may not reach a collective); it relies on
every rank receiving the signal, as torchrun, Slurm, the control service and a
terminal deliver it. After the first update the ranks agree (after_step).

Only the first signal counts; later ones are ignored. NOTE: one stop often
arrives twice: Slurm signals every process of the step and torchrun forwards what
it receives, and a terminal's Ctrl-C reaches torchrun and its workers alike; a
second signal must not cut the save short.

Exit statuses (`EXIT_STATUS`): SIGTERM 0, a stop on request that the control
service and torchrun take as a clean end; SIGINT 130 (128 + 2, what a shell
reports for Ctrl-C). Both after the save, or at once before the first update.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Callable

EXIT_STATUS = {signal.SIGTERM: 0, signal.SIGINT: 130}


def exit_on_stop_signals() -> None:
    """Until StopSignals takes over: a stop signal ends the process at once with its EXIT_STATUS.

    For `python -m titan_k3.train`'s imports (seconds; more on a slow shared file system), where nothing exists
    yet to save or close, and a raised StopNow would end as a traceback from the middle of an import.
    """
    def stop(signum: int, _frame) -> None:
        if int(os.environ.get("RANK", 0)) == 0:
            print(f"[stopped] {signal.Signals(signum).name} received during start-up: stopping now, nothing to save",
                  flush=True)
        os._exit(EXIT_STATUS[signum])

    for s in StopSignals.SIGNALS:
        signal.signal(s, stop)


class StopNow(BaseException):
    """A stop signal before anything needs saving.

    NOTE: a BaseException, as KeyboardInterrupt is, so code that catches Exception (torch.compile's error
    handling among it) lets it through.
    """

    def __init__(self, signum: int):
        super().__init__(f"{signal.Signals(signum).name} received")
        self.signum = signum


class StopSignals:
    """Handlers for SIGTERM and SIGINT, installed from the main thread (elsewhere: none, the caller's own stay).

    The first signal raises StopNow in the main thread until `hand_over(sink)`, and calls `sink(signum)` after
    it (the loop stops at its next safe point); later signals are ignored.
    signum: the first signal received (None: none).
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.signum: int | None = None
        self._sink: Callable[[int], None] | None = None
        self._previous: dict[int, object] = {}
        self.install()

    def install(self) -> None:
        """(Re)take both signals; the handlers before the first install are what `restore` puts back."""
        if threading.current_thread() is not threading.main_thread():
            return
        for s in self.SIGNALS:
            previous = signal.signal(s, self._handle)
            self._previous.setdefault(s, previous)

    def check(self) -> None:
        """Raise StopNow again for a signal received before the hand-over whose StopNow did not stop the process.

        NOTE: Python runs a handler between two bytecodes of the main thread, wherever it is; when that is code that
        reports and drops exceptions (a `__del__` or weakref callback, many of which run while torch.compile
        traces), the StopNow is printed and lost. The trainer calls this once its first update returns, before
        anything of it is kept, so that such a stop still ends the run without a save.
        """
        if self.signum is not None and self._sink is None:
            raise StopNow(self.signum)

    def hand_over(self, sink: Callable[[int], None]) -> None:
        """From now on a (first) signal goes to `sink`: there is an update to save."""
        self._sink = sink

    def _handle(self, signum: int, _frame) -> None:
        if self.signum is not None:
            return
        self.signum = signum
        if self._sink is None:
            raise StopNow(signum)
        self._sink(signum)

    def restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}
