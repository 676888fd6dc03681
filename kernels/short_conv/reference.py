"""Pure-PyTorch causal depthwise convolution + SiLU with document starts: the ground truth and the CPU path.

Legend: B batch, T tokens, C channels, W taps.
"""

import torch
import torch.nn.functional as F

from kernels.device import check_same_device


def check_inputs(x_BTC: torch.Tensor, w_C1W: torch.Tensor, pos_BT: torch.Tensor) -> None:
    """One line naming what is wrong, before any work."""
    if x_BTC.dim() != 3:
        raise ValueError(f"causal_conv_silu: x has shape {tuple(x_BTC.shape)}; expected [B, T, C]")
    B, T, C = x_BTC.shape
    if w_C1W.dim() != 3 or w_C1W.shape[0] != C or w_C1W.shape[1] != 1 or w_C1W.shape[2] < 1:
        raise ValueError(f"causal_conv_silu: w has shape {tuple(w_C1W.shape)}; expected [C={C}, 1, W] (nn.Conv1d layout)")
    if not w_C1W.is_floating_point():
        raise ValueError(f"causal_conv_silu: w is {w_C1W.dtype}; expected a floating dtype")
    integer = not (pos_BT.is_floating_point() or pos_BT.is_complex() or pos_BT.dtype == torch.bool)
    if tuple(pos_BT.shape) != (B, T) or not integer:
        raise ValueError(f"causal_conv_silu: pos is {pos_BT.dtype} of shape {tuple(pos_BT.shape)}; expected integer [B={B}, T={T}]")
    check_same_device("causal_conv_silu", "x", dict(x=x_BTC, w=w_C1W, pos=pos_BT))


def causal_depthwise_conv(x_BTC: torch.Tensor, w_C1W: torch.Tensor, pos_BT: torch.Tensor) -> torch.Tensor:
    """Causal depthwise convolution that never reads across a document start.

    x [B, T, C], w [C, 1, W] (nn.Conv1d layout, tap W-1 is the current token),
    pos [B, T] position inside the document. y_t = sum_j w[:, W-1-j] x_{t-j} over
    j <= pos_t, in x's dtype (w rounded to it).
    """
    width = w_C1W.shape[-1]
    w = w_C1W[:, 0, :].to(x_BTC.dtype)
    y = x_BTC * w[:, width - 1]
    for j in range(1, width):
        shifted = F.pad(x_BTC, (0, 0, j, 0))[:, : x_BTC.shape[1]]
        y = y + shifted * w[:, width - 1 - j] * (pos_BT >= j).unsqueeze(-1).to(x_BTC.dtype)
    return y


def causal_conv_silu_reference(x_BTC: torch.Tensor, w_C1W: torch.Tensor, pos_BT: torch.Tensor) -> torch.Tensor:
    """silu(causal_depthwise_conv(x, w, pos)): [B, T, C] in x's dtype; differentiable in x and w."""
    check_inputs(x_BTC, w_C1W, pos_BT)
    return F.silu(causal_depthwise_conv(x_BTC, w_C1W, pos_BT))
