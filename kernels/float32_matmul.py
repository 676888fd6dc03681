"""`matmul_float32`: a product the math asks in float32, kept in float32 under autocast, as one torch.library op.

Autocast (the trainer's bf16 on CUDA) casts a matmul's or an einsum's operands to bf16. The products docs/k3.md
asks in float32 outside our Triton kernels (the MoE router's scores, the PyTorch paths of KDA and QK-Clip's max
logit) go through this op instead: its autocast rule casts the operands to float32 and runs it with autocast off,
switched by the dispatcher. NOTE: not an autocast context in the model's code: a compiled graph that enters one
is not cached by AOT autograd, and every start would build it again.
"""

import math

import torch
from torch.utils.flop_counter import register_flop_formula


@torch.library.custom_op("kernels::matmul_float32", mutates_args=())
def matmul_float32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b: [..., M, K] x [..., K, N] of one batch shape and dtype -> [..., M, N] in that dtype, differentiable;
    under autocast in float32 (float64 stays float64)."""
    return a @ b


@matmul_float32.register_fake
def _(a, b):
    return a.new_empty(*a.shape[:-1], b.shape[-1])


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, grad):
    a, b = ctx.saved_tensors
    da = matmul_float32(grad, b.mT) if ctx.needs_input_grad[0] else None
    db = matmul_float32(a.mT, grad) if ctx.needs_input_grad[1] else None
    return da, db


matmul_float32.register_autograd(_backward, setup_context=_setup_context)
matmul_float32.register_autocast("cpu", torch.float32)
matmul_float32.register_autocast("cuda", torch.float32)


@register_flop_formula(torch.ops.kernels.matmul_float32)
def _flops(a_shape, b_shape, *args, **kwargs) -> int:
    """2 M K N per batch element: torch's FlopCounterMode counts the op as the matmul it is (the model's MFU
    formula is checked against that count)."""
    return 2 * math.prod(a_shape) * b_shape[-1]
