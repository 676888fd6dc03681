"""QK-Clip's statistic: the exact largest pre-softmax logit per head of causal, document-masked attention.

`max_logit_per_head(q, k, scale, pos)` is the Triton path (CUDA, or the CPU interpreter
under TRITON_INTERPRET=1), one pass over the allowed key blocks with no score tensor,
registered as a torch.library custom op; `reference.max_logit_per_head_reference` (same
arguments) is the ground truth and the CPU (and float64) path.
"""

from kernels.max_logit import reference
from kernels.max_logit.ops import max_logit_per_head
from kernels.max_logit.reference import max_logit_per_head_reference

__all__ = ["max_logit_per_head", "max_logit_per_head_reference", "reference"]
