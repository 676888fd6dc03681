"""Two clocks: the training clock (batch fetch + forward/backward/step) and the session clock (wall time).

Evaluation, checkpointing and reporting run outside `training()` and so count
only on the session clock. `now` is injectable so tests can drive the clocks.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Callable


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
