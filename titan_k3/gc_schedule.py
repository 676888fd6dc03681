"""Python's garbage collector on a schedule: off while updates run, one young-generation pass every N updates.

NOTE: a compiled k3-mini step is host-bound (the host queues kernels barely ahead of the GPU), so every pause
of the host is a pause of the GPU. Python's automatic collector pauses it at points chosen by allocation
counts, and each pass walks the young objects that autograd, FSDP, DTensor and the collectives make every
step. Scheduled, the passes fall between updates at a known rate; reference cycles live at most N updates.
"""

from __future__ import annotations

import gc


class ScheduledGC:
    """Turns automatic collection off for a training run and collects generations 0-1 every `every` updates.

    every = 0 leaves Python's automatic collector as it is. `close` restores the collector's previous state
    (a trainer built inside a longer-lived process, a test run, must not leave it off).
    """

    def __init__(self, every: int):
        if every < 0:
            raise ValueError(f"ScheduledGC: every = {every}; must be >= 0 (0: Python's automatic collection)")
        self.every = every
        self._was_enabled = gc.isenabled()
        if every:
            gc.disable()
            gc.collect(1)

    def before_update(self, update: int) -> None:
        """Collect before update number `update` (1-based) when it is a multiple of `every`."""
        if self.every and update % self.every == 0:
            gc.collect(1)

    def close(self) -> None:
        if self.every and self._was_enabled:
            gc.enable()
        self.every = 0
