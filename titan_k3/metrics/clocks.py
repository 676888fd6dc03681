"""Two clocks: the training clock (batch fetch + forward/backward/step) and the session clock (wall time).

Evaluation, checkpointing and reporting run outside `training()` and so count
only on the session clock. `now` is injectable so tests can drive the clocks.
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
    def __init__(self, now: Callable[[], float] = time.perf_counter, start: float | None = None):
        self.now = now
        self.session_start = now() if start is None else start
        self.training_seconds = 0.0

    @contextmanager
    def training(self):
        t0 = self.now()
        try:
            yield
        finally:
            self.training_seconds += self.now() - t0

    @property
    def session_seconds(self) -> float:
        return self.now() - self.session_start
