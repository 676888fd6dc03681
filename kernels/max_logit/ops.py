"""The public `max_logit_per_head`: the Triton kernel as one torch.library custom op, with no autograd.

Legend: B batch, H heads, T tokens, E query/key width.

The op has a fake kernel, so `torch.compile` sees one opaque call (no graph break).
It registers no backward: QK-Clip reads the statistic under torch.no_grad, and a call
on inputs that require grad returns a tensor with no grad_fn.
"""

import torch

from kernels.device import triton_runs_on
from kernels.max_logit.kernel import MAX_WIDTH, max_logit_forward
from kernels.max_logit.reference import check_inputs

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@torch.library.custom_op("max_logit::per_head", mutates_args=())
def _max_logit_op(q: torch.Tensor, k: torch.Tensor, scale: float, pos: torch.Tensor | None) -> torch.Tensor:
    return max_logit_forward(q, k, scale, pos)


@_max_logit_op.register_fake
def _(q, k, scale, pos):
    return q.new_empty(q.shape[1], dtype=torch.float32)


def max_logit_per_head(
    q_BHTE: torch.Tensor, k_BHTE: torch.Tensor, scale: float, pos_BT: torch.Tensor | None = None
) -> torch.Tensor:
    """max over b, i and allowed j of scale * <q[b, h, i], k[b, h, j]>, per head: float32 [H], not differentiable.

    q, k: [B, H, T, E] of one dtype (bfloat16, float16 or float32), E <= 256, any strides (the
    model's `.transpose(1, 2)` of [B, T, H, E] is read in place, not copied); products in the
    inputs' dtype (float32 exactly, not TF32), accumulated in float32. scale: a number > 0.
    pos: integer [B, T] (any strides), each token's position inside its document
    (`Documents.pos_BT`): key j is allowed for query i iff i - pos[b, i] <= j <= i. None: plain
    causal (j <= i). -inf per head when B or T is 0. Sync-free: reads no device value on the host.
    Needs CUDA tensors, or TRITON_INTERPRET=1 on CPU; `kernels.max_logit.max_logit_per_head_reference`
    is the CPU path (and the float64 one).
    """
    check_inputs(q_BHTE, k_BHTE, scale, pos_BT)
    if q_BHTE.dtype not in DTYPES:
        raise ValueError(
            f"max_logit_per_head needs bfloat16/float16/float32 q and k, got {q_BHTE.dtype}; "
            "float64 runs in kernels.max_logit.max_logit_per_head_reference"
        )
    if q_BHTE.shape[-1] > MAX_WIDTH or q_BHTE.shape[-1] == 0:
        raise ValueError(f"max_logit_per_head takes a width E of 1..{MAX_WIDTH}, got q {tuple(q_BHTE.shape)}")
    if not triton_runs_on(q_BHTE.device):
        raise ValueError(
            f"max_logit_per_head runs a Triton kernel and needs CUDA tensors, got device {q_BHTE.device}; "
            "use kernels.max_logit.max_logit_per_head_reference on CPU"
        )
    return _max_logit_op(q_BHTE.detach(), k_BHTE.detach(), float(scale), None if pos_BT is None else pos_BT.detach())
