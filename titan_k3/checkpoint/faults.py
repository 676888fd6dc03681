"""Checkpoint fault injection for tests: each fault is a documented `[debug]` key, off by default.

    debug.kill_in_save_at_step             exit with status 3 inside that update's save, after its files are
                                           written and before the commit (a kill between write and rename)
    debug.checkpoint_write_error_at_step   that update's save: DCP's writer raises OSError(ENOSPC) after writing
                                           its data files, before `.metadata` (a disk that fills during the save,
                                           sync or async)
    debug.checkpoint_free_bytes            the free space a save's space check sees (a full disk without filling
                                           one); -1 measures

The manager asks this object at the three points where a fault can apply;
nothing else in the save path knows about faults. The two save faults fire only
at an update that saves (CheckpointManager.after_step: the schedule, or a stop
signal's save); config validation refuses them where no update saves.
"""

from __future__ import annotations

import errno
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from torch.distributed.checkpoint import FileSystemWriter


@dataclass(frozen=True)
class CheckpointFaults:
    kill_in_save_at_step: int = -1
    write_error_at_step: int = -1
    free_bytes: int = -1

    @classmethod
    def from_debug(cls, debug) -> "CheckpointFaults":
        return cls(kill_in_save_at_step=debug.kill_in_save_at_step,
                   write_error_at_step=debug.checkpoint_write_error_at_step,
                   free_bytes=debug.checkpoint_free_bytes)

    def active(self) -> dict[str, int]:
        """{debug key: value} of the faults that are on."""
        on = {"debug.kill_in_save_at_step": self.kill_in_save_at_step,
              "debug.checkpoint_write_error_at_step": self.write_error_at_step,
              "debug.checkpoint_free_bytes": self.free_bytes}
        return {key: value for key, value in on.items() if value >= 0}

    def free_bytes_at(self, folder: Path) -> int:
        """Free bytes of the file system holding `folder` (debug.checkpoint_free_bytes when set)."""
        return self.free_bytes if self.free_bytes >= 0 else shutil.disk_usage(folder).free

    def storage_writer(self, step: int, path: Path) -> FileSystemWriter | None:
        """The DCP writer for the save of `step`: a failing one under debug.checkpoint_write_error_at_step, else
        None (DCP's own)."""
        return _FullDiskWriter(path) if step == self.write_error_at_step else None

    def kill_before_commit(self, step: int, wait_written: Callable[[], None]) -> None:
        """debug.kill_in_save_at_step: once the files are written (`wait_written`), exit like a kill."""
        if step != self.kill_in_save_at_step:
            return
        wait_written()
        print(f"debug.kill_in_save_at_step = {step}: exiting with status 3 before the commit", flush=True)
        os._exit(3)


class _FullDiskWriter(FileSystemWriter):
    """Writes this rank's data files as DCP does, then fails as a full disk would, before `.metadata`."""

    def write_data(self, plan, planner):
        super().write_data(plan, planner).wait()
        raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} (debug.checkpoint_write_error_at_step)",
                      str(self.path))
