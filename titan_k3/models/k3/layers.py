"""Small building blocks shared by the K3 layers: RMSNorm and the SiTU-GLU FFN."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels.grouped_gemm.reference import situ_glu


def upcast(x: torch.Tensor) -> torch.Tensor:
    """float64 stays float64 (tests); anything else computes in float32."""
    return x if x.dtype == torch.float64 else x.float()


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, computed in float32 (or float64), returned in x's dtype."""
    y = F.rms_norm(upcast(x), (x.shape[-1],), None, eps)
    if weight is not None:
        y = y * upcast(weight)
    return y.to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


class SituGluFFN(nn.Module):
    """y = W2 SiTU-GLU(W1 x, W3 x): the dense FFN of layer 0 and the shared experts."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(situ_glu(self.w1(x), self.w3(x)).to(x.dtype))


def init_linear(module: nn.Linear, std: float = 0.02) -> None:
    nn.init.trunc_normal_(module.weight, std=std, a=-3 * std, b=3 * std)
