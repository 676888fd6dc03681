"""Two clocks: the training clock (batch fetch + forward/backward/step) and the session clock (wall time).

Evaluation, checkpointing and reporting run outside `training()` and so count
only on the session clock. Work that runs inside an update but is not training
(the invariant checks) runs under `outside_training(kind)`: its seconds are its
own (`own_seconds[kind]`), taken off the training clock, and still on the
session clock. `now` is injectable so tests can drive the clocks.

Both clocks belong to this session (this process): a resumed run starts them at
zero, and `session_tokens` counts only the tokens this session trained on, so a
rate is always this session's tokens over this session's seconds (the run's
`tokens_seen`, restored from the checkpoint, would count earlier sessions' work
against this session's time).
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from typing import Callable


def process_start_time() -> float | None:
    """This process's start in epoch seconds, from the kernel (/proc, Linux); None where that is not available.

    NOTE: the kernel's start time counts the interpreter's start and `import torch`, which a clock started in
    the program misses (several seconds of a launch).
    """
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open("/proc/stat") as f:
            boot = next(float(line.split()[1]) for line in f if line.startswith("btime "))
        return boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22 of stat: starttime, in ticks
    except (OSError, ValueError, IndexError, StopIteration):
        return None


class TwoClocks:
    """training_seconds and session_seconds of this session, the tokens it trained on, and when it started.

    started_unix: epoch seconds at the session's start; metrics records carry it as "session_start", so a
    reader tells the sessions of a resumed run apart.
    """

    def __init__(self, now: Callable[[], float] = time.perf_counter, start: float | None = None):
        self.now = now
        self.session_start = now() if start is None else start
        self.started_unix = time.time()
        self.training_seconds = 0.0
        self.session_tokens = 0
        self.own_seconds: dict[str, float] = {}
        """Seconds of this session's work inside updates that is not training, by kind ("invariants")."""
        self._own_total = 0.0
        self._own_since: float | None = None

    def add_tokens(self, n: int) -> None:
        """Count `n` tokens trained on in this session (once per update)."""
        self.session_tokens += n

    @contextmanager
    def training(self):
        """Time on the training clock, less what ran under `outside_training` meanwhile."""
        t0, own0 = self.now(), self._own_total
        try:
            yield
        finally:
            self.training_seconds += self.now() - t0 - (self._own_total - own0)

    @contextmanager
    def outside_training(self, kind: str):
        """Time that is `kind`'s own (own_seconds[kind]), never the training clock's, even inside `training()`."""
        assert self._own_since is None, "outside_training does not nest"
        self._own_since = self.now()
        try:
            yield
        finally:
            seconds = self.now() - self._own_since
            self._own_since = None
            self.own_seconds[kind] = self.own_seconds.get(kind, 0.0) + seconds
            self._own_total += seconds

    @property
    def session_seconds(self) -> float:
        return self.now() - self.session_start
