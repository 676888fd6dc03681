"""Per-Head Muon's passes, fused: the momentum step (with the Nesterov direction), the update, the NS scaling.

`nesterov_momentum_(grad, buf, out, momentum, nesterov)` and
`decay_add_(param, update, decay, alpha)` run one Triton pass each on CUDA;
their `_multi_` forms cover a list of tensors in one launch (and can skip the
update on a device flag, `skip_if`). `ns_scale_` applies Newton–Schulz's
per-matrix normalisation to the small Gram-side matrices. `triton_=True` runs
a pass in Triton's CPU interpreter, for tests; `reference` holds the PyTorch
versions, which are also the CPU path.
"""

from kernels.muon import reference
from kernels.muon.fused import (
    Table,
    decay_add_,
    decay_add_multi_,
    decay_add_table,
    momentum_table,
    nesterov_momentum_,
    nesterov_momentum_multi_,
    ns_scale_,
    send_tables,
)

__all__ = [
    "Table",
    "decay_add_",
    "decay_add_multi_",
    "decay_add_table",
    "momentum_table",
    "nesterov_momentum_",
    "nesterov_momentum_multi_",
    "ns_scale_",
    "reference",
    "send_tables",
]
