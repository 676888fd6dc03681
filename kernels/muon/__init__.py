"""Per-Head Muon's passes, fused: the momentum step (with the Nesterov direction), the update, the NS polynomial.

`nesterov_momentum_multi_(grads, bufs, out, momentum, nesterov)` and
`decay_add_multi_(params, update, decay, alpha)` run one Triton pass each on
CUDA over a list of tensors, in one launch (and can skip the update on a
device flag, `skip_if`). `ns_polynomial` computes a Newton–Schulz step's
a I + b A + c A^2 on the small Gram-side matrices (with the first step's
per-matrix normalisation) in one batched matmul. `triton_=True` runs
a pass in Triton's CPU interpreter, for tests; `reference` holds the PyTorch
versions, which are also the CPU path.
"""

from kernels.muon import reference
from kernels.muon.fused import (
    Table,
    decay_add_multi_,
    decay_add_table,
    momentum_table,
    nesterov_momentum_multi_,
    ns_polynomial,
    send_tables,
)

__all__ = [
    "Table",
    "decay_add_multi_",
    "decay_add_table",
    "momentum_table",
    "nesterov_momentum_multi_",
    "ns_polynomial",
    "reference",
    "send_tables",
]
