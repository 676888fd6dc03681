"""Without a GPU, Triton kernels run through Triton's CPU interpreter.

NOTE: TRITON_INTERPRET must be set before triton is first imported — and many
modules import it indirectly (torchao, torch._inductor) — so it is set here, in
the suite's root conftest, before any test module is collected.
"""

import os

if not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")
