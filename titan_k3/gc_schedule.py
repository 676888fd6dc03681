"""Python's garbage collector on a schedule: off while updates run, one young-generation pass every N updates.

NOTE: a compiled k3-mini step is host-bound (the host queues kernels barely ahead of the GPU), so every pause
of the host is a pause of the GPU. Python's automatic collector pauses it at points chosen by allocation
counts, and each pass walks the young objects that autograd, FSDP, DTensor and the collectives make every
step. Scheduled, the passes fall between updates at a known rate; reference cycles live at most N updates.
"""

from __future__ import annotations

import gc

AFTER_COMPILE = 3  # updates 1 and 2 compile (the forward and backward, then the optimizer's first step)


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
        """Collect before update number `update` (1-based) when it is a multiple of `every`, and before update 3.

        NOTE: with the collector off, everything the first updates allocate (torch.compile's graphs and
        guards: millions of objects) stays in the young generations until the first pass, which then walks it
        all: ~0.7 s inside update `every` on an H200 host (benchmarks/results/scaling.md). One pass before
        update 3, once compilation is done, moves the survivors to the old generation during start-up, where
        the scheduled generation-1 passes never walk them again.
        """
        if self.every and (update % self.every == 0 or update == AFTER_COMPILE):
            gc.collect(1)

    def close(self) -> None:
        if self.every and self._was_enabled:
            gc.enable()
        self.every = 0
