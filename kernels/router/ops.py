"""The public `top_k_rows` and `router_scores`: the Triton kernels as torch.library custom ops.

Legend: T tokens, D model width, E experts, k selected per token.

Each op has a fake kernel, so `torch.compile` sees one opaque call (no graph break). `top_k_rows` registers no
backward: the router selects under torch.no_grad (its weights' gradient flows through a gather of the
scores at the chosen ids, not through these values). `router_scores` carries the gradient of the product in
x's dtype (autocast's own product, as every other weight's).
"""

import torch

from kernels.device import check_same_device, triton_runs_on
from kernels.router.kernel import top_k_forward
from kernels.router.reference import check_inputs
from kernels.router.scores import scores_forward

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


@torch.library.custom_op("k3_router::scores", mutates_args=())
def _scores_op(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return scores_forward(x, w)


@_scores_op.register_fake
def _(x, w):
    return x.new_empty(x.shape[0], w.shape[0], dtype=torch.float32)


def _scores_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _scores_backward(ctx, ds):
    # NOTE: the product of x's dtype, as autocast's own product would give it (a float32 backward would be two
    # more float32 products of the forward's size, on the CUDA cores).
    x, w = ctx.saved_tensors
    g = ds.to(x.dtype)
    dx = g @ w.to(x.dtype) if ctx.needs_input_grad[0] else None
    dw = (g.t() @ x).to(w.dtype) if ctx.needs_input_grad[1] else None
    return dx, dw


_scores_op.register_autograd(_scores_backward, setup_context=_scores_setup)


def router_scores(x_TD: torch.Tensor, w_ED: torch.Tensor) -> torch.Tensor:
    """The router's scores x w^T as the float32 product: float32 [T, E], under bf16 autocast too (docs/k3.md §2.3).

    x [T, D] bfloat16, float16 or float32 (any row stride); w [E, D] float32 or x's dtype. A 16-bit x runs in the
    Triton kernel (`kernels.router.scores`): a float32 w as three tensor-core products over its pieces in x's
    dtype, summed in float32; float32 x takes torch's float32 product. Differentiable in x and w: the gradient
    is the product's in x's dtype (autocast's own product under bf16), returned in each input's dtype. Needs
    CUDA tensors, or TRITON_INTERPRET=1 on CPU (where bf16 does not run); `titan_k3.models.k3.moe.router_logits`
    is the CPU path.
    """
    for name, t in (("x_TD", x_TD), ("w_ED", w_ED)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.dtype not in DTYPES:
            got = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"router_scores: {name} must be a 2-D bfloat16, float16 or float32 tensor, got {got}")
    if w_ED.shape[1] != x_TD.shape[1]:
        raise ValueError(f"router_scores: w_ED has shape {tuple(w_ED.shape)}; expected [E, D={x_TD.shape[1]}]")
    if w_ED.dtype not in (torch.float32, x_TD.dtype):
        raise ValueError(f"router_scores: w_ED has dtype {w_ED.dtype}; it must be float32 or x's ({x_TD.dtype})")
    if not triton_runs_on(x_TD.device):
        raise ValueError(f"router_scores runs a Triton kernel and needs CUDA tensors, got device {x_TD.device}; "
                         "use titan_k3.models.k3.moe.router_logits on CPU")
    check_same_device("router_scores", "x_TD", dict(x_TD=x_TD, w_ED=w_ED))
    if x_TD.dtype == torch.float32:
        # NOTE: nothing to split: cuBLAS's float32 product is the product asked for, and it beats the kernel's
        # float32 ("ieee") dots (0.17 against 0.30 ms at k3-mini's router, benchmarks/results/router_logits.md).
        # Autocast is held off: it would run this product in bf16, the precision §2.3 rules out.
        with torch.autocast(x_TD.device.type, enabled=False):
            return x_TD @ w_ED.t()
    if x_TD.stride(1) != 1:
        x_TD = x_TD.contiguous()
    return _scores_op(x_TD, w_ED.contiguous())
