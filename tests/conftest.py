"""Without a GPU, Triton kernels run through Triton's CPU interpreter.

NOTE: TRITON_INTERPRET must be set before triton is first imported — and many
modules import it indirectly (torchao, torch._inductor) — so it is set here, in
the suite's root conftest, before any test module is collected.
"""

import os

if not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_sessionstart(session):
    """Stop the suite at its start, with `kernels.device.check_interpreter`'s one line, where the interpreter it
    would use cannot run (every kernel test would otherwise fail deep inside Triton)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        import pytest

        from kernels.device import triton_runs_on

        try:
            triton_runs_on("cpu")
        except RuntimeError as e:
            pytest.exit(str(e), returncode=1)
