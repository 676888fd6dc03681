"""SIGTERM, SIGINT (Ctrl-C) and SIGHUP: honoured at the next safe point, never held by a long first update.

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

A rank that waits inside a collective or the process group's rendezvous
(C++ code, where Python runs no signal handler) would hold that stop until
whoever sent it kills the process: torchrun waits 30 s after it signals the
ranks that a peer's error left waiting, then sends SIGKILL. So `StopSignals(
watchdog=True)` (the command line's) also has Python's C-level handler write
each signal to a pipe that a thread reads; a stop before the hand-over that has
not reached the main thread START_UP_GRACE_S seconds later (its handler has
not run) ends the process from that thread, with the same line and status.

Only the first signal counts; later ones are ignored. NOTE: one stop often
arrives twice: Slurm signals every process of the step and torchrun forwards what
it receives; a second signal must not cut the save short.

SIGHUP (the terminal or ssh session that started the run closed; torchrun
forwards it to its workers, which it killed before their save) stops the run as
the others do. A process started with SIGHUP ignored (`nohup`) keeps it ignored,
as it does any stop signal ignored at its start.

Exit statuses (`EXIT_STATUS`): SIGTERM 0, a stop on request that the control
service and torchrun take as a clean end; SIGINT 130 and SIGHUP 129 (128 + the
signal's number, what a shell reports). All after the save, or at once before
the first update.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Callable

EXIT_STATUS = {signal.SIGTERM: 0, signal.SIGINT: 130, signal.SIGHUP: 129}
START_UP_GRACE_S = 5.0
"""Seconds a stop before the first update has to reach the main thread before the watchdog ends the process."""


def start_up_stop_line(signum: int) -> str:
    return f"[stopped] {signal.Signals(signum).name} received during start-up: stopping now, nothing to save"


def exit_on_stop_signals() -> None:
    """Until StopSignals takes over: a stop signal ends the process at once with its EXIT_STATUS.

    For `python -m titan_k3.train`'s imports (seconds; more on a slow shared file system), where nothing exists
    yet to save or close, and a raised StopNow would end as a traceback from the middle of an import.
    """
    def stop(signum: int, _frame) -> None:
        if int(os.environ.get("RANK", 0)) == 0:
            print(start_up_stop_line(signum), flush=True)
        os._exit(EXIT_STATUS[signum])

    for s in StopSignals.SIGNALS:
        if signal.getsignal(s) is not signal.SIG_IGN:
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
    """Handlers for SIGTERM, SIGINT and SIGHUP, installed from the main thread (elsewhere: none, the caller's own
    stay); a signal ignored when the first install comes stays ignored (`nohup`).

    The first signal raises StopNow in the main thread until `hand_over(sink)`, and calls `sink(signum)` after
    it (the loop stops at its next safe point); later signals are ignored.
    signum: the first signal received (None: none).
    watchdog: a stop before the hand-over whose handler has not run START_UP_GRACE_S later (the main thread waits
    in C++ code) ends the process from a thread (module docstring). For a process that is the trainer's own only.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)

    def __init__(self, watchdog: bool = False):
        self.signum: int | None = None
        self._sink: Callable[[int], None] | None = None
        self._previous: dict[int, object] = {}
        self._ignored: set[int] = set()
        self._announced = threading.Lock()
        self._wakeup: int | None = None  # the pipe's write end, while the watchdog reads it
        self.install()
        if watchdog:
            self._start_watchdog()

    def install(self) -> None:
        """(Re)take both signals; the handlers before the first install are what `restore` puts back."""
        if threading.current_thread() is not threading.main_thread():
            return
        for s in self.SIGNALS:
            if s not in self._previous and signal.getsignal(s) is signal.SIG_IGN:
                self._ignored.add(s)
            if s in self._ignored:
                continue
            previous = signal.signal(s, self._handle)
            self._previous.setdefault(s, previous)

    def announce(self, signum: int, say: Callable[[], None] | None = None) -> None:
        """Say a stop before the hand-over once, whichever of the main thread and the watchdog gets there first:
        `say()`, or (None) print the start-up stop's line on rank 0."""
        if not self._announced.acquire(blocking=False):
            return
        if say is not None:
            say()
        elif int(os.environ.get("RANK", 0)) == 0:
            print(start_up_stop_line(signum), flush=True)

    def _start_watchdog(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        read_end, write_end = os.pipe()
        os.set_blocking(write_end, False)
        if signal.set_wakeup_fd(write_end, warn_on_full_buffer=False) != -1:
            # NOTE: another owner of the wakeup fd (an event loop) keeps it; no watchdog then.
            signal.set_wakeup_fd(signal.set_wakeup_fd(-1))
            os.close(read_end)
            os.close(write_end)
            return
        self._wakeup = write_end
        threading.Thread(target=self._watch, args=(read_end,), name="stop-watchdog", daemon=True).start()

    def _watch(self, read_end: int) -> None:
        """The watchdog thread: each byte is a signal's number, written the moment the signal arrives."""
        with os.fdopen(read_end, "rb", buffering=0) as pipe:
            while received := pipe.read(64):
                stops = [s for s in received if s in self.SIGNALS]
                if not stops or self._sink is not None:
                    continue  # after the hand-over the loop stops at its next update's end
                # NOTE: the handler runs at the main thread's next bytecode; while it has not run, the main thread
                # waits in C++. Once it has, the main thread is stopping (or re-raises a swallowed stop: check).
                deadline = time.monotonic() + START_UP_GRACE_S
                while time.monotonic() < deadline and not self._acted_on():
                    time.sleep(0.05)
                if self._acted_on():
                    continue
                self.announce(stops[0])
                os._exit(EXIT_STATUS[signal.Signals(stops[0])])

    def _acted_on(self) -> bool:
        """Whether the main thread took the stop (its handler ran), handed over, or restored the handlers."""
        return self.signum is not None or self._sink is not None or self._wakeup is None

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
        if self._wakeup is not None:
            signal.set_wakeup_fd(-1)
            write_end, self._wakeup = self._wakeup, None
            os.close(write_end)  # the watchdog reads the end of the pipe and returns
