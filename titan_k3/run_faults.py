"""The run's own [debug] fault, for tests of restarts and resumes: off by default, announced when on.

    debug.crash_at_step    exit with status 3 right after that update (and its save, when one was due), as a
                           killed process would: no clean-up, no final save, no summary

The trainer asks `after_update(step)` once per update; nothing else in the loop knows about it. The
checkpoint's faults live in titan_k3/checkpoint/faults.py, the distributed injections in
titan_k3/parallel/faults.py. Torch-free.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class RunFaults:
    crash_at_step: int = -1

    @classmethod
    def from_debug(cls, debug) -> "RunFaults":
        return cls(crash_at_step=debug.crash_at_step)

    def active(self) -> dict[str, int]:
        """{debug key: value} of the faults that are on."""
        return {"debug.crash_at_step": self.crash_at_step} if self.crash_at_step >= 0 else {}

    def after_update(self, step: int) -> None:
        """debug.crash_at_step: exit with status 3 once update `step` is done."""
        if step != self.crash_at_step:
            return
        print(f"debug.crash_at_step = {step}: exiting with status 3", flush=True)
        sys.stdout.flush()
        os._exit(3)
