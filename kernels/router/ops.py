"""The public `top_k_rows`: the Triton kernel as one torch.library custom op, with no autograd.

Legend: T tokens, E experts, k selected per token.

The op has a fake kernel, so `torch.compile` sees one opaque call (no graph break). It registers no
backward: the router selects under torch.no_grad (its weights' gradient flows through a gather of the
scores at the chosen ids, not through these values).
"""

import torch

from kernels.device import triton_runs_on
from kernels.router.kernel import top_k_forward
from kernels.router.reference import check_inputs

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_EXPERTS = 8192
"""The widest row the kernel holds in registers (k3 routes over 896 experts)."""


@torch.library.custom_op("k3_router::top_k_rows", mutates_args=())
def _top_k_op(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    return top_k_forward(x, k)


@_top_k_op.register_fake
def _(x, k):
    return x.new_empty(x.shape[0], k), x.new_empty(x.shape[0], k, dtype=torch.int64)


def top_k_rows(x_TE: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest values of each row of x [T, E] and their indices, largest first: ([T, k] in x's dtype,
    int64 [T, k]); ties go to the lowest index; not differentiable.

    x: bfloat16, float16 or float32, E <= MAX_EXPERTS, any row stride. A row holding NaN gets indices that
    exist (in [0, E)) but are otherwise unspecified. Needs CUDA tensors, or TRITON_INTERPRET=1 on CPU;
    `kernels.router.top_k_rows_reference` is the CPU path (and the float64 one).
    """
    check_inputs(x_TE, k)
    if x_TE.dtype not in DTYPES:
        raise ValueError(f"top_k_rows needs bfloat16/float16/float32 x, got {x_TE.dtype}; "
                         "float64 runs in kernels.router.top_k_rows_reference")
    if x_TE.shape[1] > MAX_EXPERTS:
        raise ValueError(f"top_k_rows holds rows of up to {MAX_EXPERTS} experts, got x {tuple(x_TE.shape)}")
    if not triton_runs_on(x_TE.device):
        raise ValueError(f"top_k_rows runs a Triton kernel and needs CUDA tensors, got device {x_TE.device}; "
                         "use kernels.router.top_k_rows_reference on CPU")
    x = x_TE.detach()
    if x.stride(1) != 1:
        x = x.contiguous()
    return _top_k_op(x, k)
