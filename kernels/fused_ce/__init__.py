"""Fused linear cross-entropy over a large vocabulary without materialising full logits.

`linear_cross_entropy(h, weight, targets, ignore_index=-100) -> (loss_sum, n_valid)`;
`reference` holds the pure-PyTorch versions (chunked, and naive ground truth).
"""

from kernels.fused_ce import reference

__all__ = ["reference"]
