"""Per-attempt wrapper: `python -m service.child EXIT_FILE -- CMD...`.

It runs CMD in its own process group (the service starts this wrapper as a
session leader) and records CMD's exit status in EXIT_FILE. The record is
what lets a restarted service learn how a run it re-adopted ended, since a
process that is not our child cannot be waited on.

The wrapper outlives SIGTERM (the service signals the whole group on stop and
the trainer needs time to checkpoint); SIGKILL ends it like everything else.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys


def _write_exit(path: str, code: int) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(f"{code}\n")
    os.replace(tmp, path)


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print("usage: python -m service.child EXIT_FILE -- CMD...", file=sys.stderr)
        return 2
    exit_path, cmd = argv[0], argv[2:]
    # NOTE: a handler, not SIG_IGN: an ignored signal stays ignored across exec, a handler is reset.
    signal.signal(signal.SIGTERM, lambda *_: None)
    signal.signal(signal.SIGINT, lambda *_: None)
    proc = subprocess.Popen(cmd)
    code = proc.wait()
    _write_exit(exit_path, code)
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
