"""Kernel tests run Triton kernels through its CPU interpreter when no GPU is present.

NOTE: TRITON_INTERPRET must be set before triton is first imported, so this
module sets it before anything imports torch or triton.
"""

import os

if not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")
