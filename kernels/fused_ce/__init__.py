"""Fused linear cross-entropy over a large vocabulary without materialising full logits.

`linear_cross_entropy(h, weight, targets, ignore_index=-100) -> (loss_sum, n_valid)`
is the fused path (CUDA; Triton's interpreter on CPU); `reference` holds the
pure-PyTorch versions: the chunked one (the CPU path) and the naive ground truth.
"""

from kernels.fused_ce import reference
from kernels.fused_ce.ops import linear_cross_entropy

__all__ = ["linear_cross_entropy", "reference"]
