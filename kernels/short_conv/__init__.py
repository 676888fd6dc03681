"""KDA's short convolutions: causal depthwise convolution then SiLU, never reading across a document start.

`causal_conv_silu(x, w, pos)` is the Triton path (CUDA, or the CPU interpreter under
TRITON_INTERPRET=1), a torch.library custom op with its backward;
`reference.causal_conv_silu_reference` (same arguments) is the ground truth and the CPU path.
"""

from kernels.short_conv import reference
from kernels.short_conv.ops import causal_conv_silu
from kernels.short_conv.reference import causal_conv_silu_reference

__all__ = ["causal_conv_silu", "causal_conv_silu_reference", "reference"]
