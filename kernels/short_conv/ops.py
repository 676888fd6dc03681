"""The public `causal_conv_silu`: the Triton kernels as torch.library custom ops, with autograd.

Legend: B batch, T tokens, C channels, W taps.

The forward and backward are custom ops with fake kernels, so `torch.compile` sees two opaque calls
(no graph break); the backward recomputes the pre-activation from x instead of saving it.
"""

import torch
import triton

from kernels.device import triton_runs_on
from kernels.short_conv.reference import check_inputs
from kernels.short_conv.triton_conv import (
    BLOCK_C,
    BLOCK_T,
    DZ_LAUNCH,
    NUM_WARPS,
    conv_silu_bwd_dx_kernel,
    conv_silu_bwd_dz_kernel,
    conv_silu_fwd_kernel,
)

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _grid(n_rows: int, channels: int) -> tuple[int, int]:
    return triton.cdiv(n_rows, BLOCK_T), triton.cdiv(channels, BLOCK_C)


@torch.library.custom_op("k3_short_conv::causal_conv_silu", mutates_args=())
def _conv_op(x: torch.Tensor, w: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """x [B, T, C] contiguous, w [C, 1, W] contiguous, pos [B, T] contiguous -> y [B, T, C]."""
    B, T, C = x.shape
    y = torch.empty_like(x)
    if y.numel() > 0:
        conv_silu_fwd_kernel[_grid(B * T, C)](x, w, pos, y, B * T, C, W=w.shape[-1], BLOCK_T=BLOCK_T,
                                              BLOCK_C=BLOCK_C, num_warps=NUM_WARPS)
    return y


@_conv_op.register_fake
def _(x, w, pos):
    return torch.empty_like(x)


@torch.library.custom_op("k3_short_conv::causal_conv_silu_backward", mutates_args=())
def _conv_backward_op(dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor,
                      pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx [B, T, C] in x's dtype, dw [C, 1, W] in w's dtype)."""
    B, T, C = x.shape
    width = w.shape[-1]
    dx = torch.empty_like(x)
    if x.numel() == 0:
        return dx, torch.zeros_like(w)
    # NOTE: dz in x's dtype: the dx pass reads it once more and rounds its sums to that dtype anyway; float32 dz
    # was twice the bytes of that write and read (the weight gradient takes dz * x in float32 before the rounding).
    dz = torch.empty_like(x)
    rows_per_program = DZ_LAUNCH["BLOCK_T"] * DZ_LAUNCH["TILES"]
    dz_grid = (triton.cdiv(B * T, rows_per_program), triton.cdiv(C, DZ_LAUNCH["BLOCK_C"]))
    # NOTE: one partial weight gradient per program (TILES row tiles), summed here: deterministic, no atomics.
    dw_part = torch.empty(C, width, dz_grid[0], device=x.device, dtype=torch.float32)
    conv_silu_bwd_dz_kernel[dz_grid](x, w, pos, dy.contiguous(), dz, dw_part, B * T, C, W=width,
                                     TAPS=triton.next_power_of_2(width), **DZ_LAUNCH)
    conv_silu_bwd_dx_kernel[_grid(B * T, C)](dz, w, pos, dx, B * T, C, W=width, BLOCK_T=BLOCK_T, BLOCK_C=BLOCK_C,
                                             num_warps=NUM_WARPS)
    return dx, dw_part.sum(-1).unsqueeze(1).to(w.dtype)


@_conv_backward_op.register_fake
def _(dy, x, w, pos):
    return torch.empty_like(x), torch.empty_like(w)


def _setup_context(ctx, inputs, output):
    x, w, pos = inputs
    ctx.save_for_backward(x, w, pos)


def _backward(ctx, dy):
    x, w, pos = ctx.saved_tensors
    dx, dw = _conv_backward_op(dy, x, w, pos)
    return dx, dw, None


_conv_op.register_autograd(_backward, setup_context=_setup_context)


def causal_conv_silu(x_BTC: torch.Tensor, w_C1W: torch.Tensor, pos_BT: torch.Tensor) -> torch.Tensor:
    """silu of the causal depthwise convolution of x by w that never reads across a document start.

    x [B, T, C] (bfloat16, float16 or float32), w [C, 1, W] (nn.Conv1d layout, tap W-1 the current
    token; rounded to x's dtype), pos integer [B, T]: each token's position inside its document
    (`Documents.pos_BT`), tap j of token t reads token t - j iff pos[t] >= j. pos[b, t] <= t: a document
    never spans two rows (`Documents.build` refuses one that would); not checked, as that reads pos on the host,
    and the kernels, which walk the B * T rows as one, would read the previous row's last tokens where the
    reference reads zeros. Returns y [B, T, C] in
    x's dtype; products and sums in float32. Differentiable in x and w; deterministic (no atomics).
    Needs CUDA tensors, or TRITON_INTERPRET=1 on CPU; `kernels.short_conv.causal_conv_silu_reference`
    is the CPU path (and the float64 one).
    """
    check_inputs(x_BTC, w_C1W, pos_BT)
    if x_BTC.dtype not in DTYPES:
        raise ValueError(f"causal_conv_silu needs a bfloat16/float16/float32 x, got {x_BTC.dtype}; float64 runs in "
                         "kernels.short_conv.causal_conv_silu_reference")
    for name, t in (("x", x_BTC), ("w", w_C1W), ("pos", pos_BT)):
        if not triton_runs_on(t.device):
            raise ValueError(f"causal_conv_silu: {name} is on {t.device}; the Triton kernels need CUDA tensors (or "
                             "TRITON_INTERPRET=1); use kernels.short_conv.causal_conv_silu_reference on CPU")
    return _conv_op(x_BTC.contiguous(), w_C1W.contiguous(), pos_BT.contiguous())
