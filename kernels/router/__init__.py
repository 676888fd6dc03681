"""The router's selection: the k largest biased scores of each token, ties to the lowest expert id.

`top_k_rows(x, k)` is the Triton path (CUDA, or the CPU interpreter under TRITON_INTERPRET=1): one pass per
block of tokens with the row in registers, registered as a torch.library custom op with no autograd (the
router selects under torch.no_grad); `reference.top_k_rows_reference` (same arguments) is the ground truth
and the CPU path.
"""

from kernels.router import reference
from kernels.router.ops import top_k_rows
from kernels.router.reference import top_k_rows_reference

__all__ = ["reference", "top_k_rows", "top_k_rows_reference"]
