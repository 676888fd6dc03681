"""Block Attention Residuals' pseudo-query mix (docs/k3.md §2.4): a fused Triton op and its PyTorch reference.

`pseudo_query_mix(sources, query, eps)` is the Triton path (CUDA, or the CPU
interpreter under TRITON_INTERPRET=1), registered as torch.library custom ops;
`reference.pseudo_query_mix_reference` is the ground truth and the model's CPU
(and float64) path.
"""

from kernels.attn_res import reference
from kernels.attn_res.ops import pseudo_query_mix
from kernels.attn_res.reference import pseudo_query_mix_reference

__all__ = ["pseudo_query_mix", "pseudo_query_mix_reference", "reference"]
