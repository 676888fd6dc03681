"""Per-Head Muon's elementwise passes, fused: the momentum step (with the Nesterov direction) and the update.

`nesterov_momentum_(grad, buf, out, momentum, nesterov)` and
`decay_add_(param, update, decay, alpha)` run one Triton pass each on CUDA
(`triton_=True` runs it in Triton's CPU interpreter, for tests); `reference`
holds the PyTorch versions, which are also the CPU path.
"""

from kernels.muon import reference
from kernels.muon.fused import decay_add_, nesterov_momentum_

__all__ = ["decay_add_", "nesterov_momentum_", "reference"]
