"""The router's scores and selection: x W^T in float32, and the k largest biased scores of each token, ties to the
lowest expert id.

`router_scores(x, w)` is the float32 product on the tensor cores (`kernels.router.scores`; the CPU path is
`titan_k3.models.k3.moe.router_logits`). `top_k_rows(x, k)` is the Triton top-k (CUDA, or the CPU interpreter
under TRITON_INTERPRET=1): one pass per block of tokens with the row in registers, registered as a
torch.library custom op with no autograd (the router selects under torch.no_grad);
`reference.top_k_rows_reference` (same arguments) is the ground truth and the CPU path.
"""

from kernels.router import reference
from kernels.router.ops import router_scores, top_k_rows
from kernels.router.reference import top_k_rows_reference

__all__ = ["reference", "router_scores", "top_k_rows", "top_k_rows_reference"]
