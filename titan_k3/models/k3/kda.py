"""The Kimi Delta Attention layer (docs/k3.md §2.1).

Legend: B batch, T tokens, D model width, H heads, K key width, V value width.
The recurrence itself is `kernels.kda.chunk_kda` (or its PyTorch reference);
this layer owns the projections, the gate and the gated output norm; the
causal convolutions + SiLU are `kernels.short_conv` (or its PyTorch reference). The safe gate, the q/k L2 norm and the beta sigmoid are
passed to the kernel to be fused there.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import nn

from titan_k3.models.k3.args import K3Args
from titan_k3.models.k3.documents import Documents
from titan_k3.models.k3.layers import init_linear, rms_norm


class KimiDeltaAttention(nn.Module):
    def __init__(self, args: K3Args, kda_fn: Callable, conv_fn: Callable):
        super().__init__()
        D, H, K = args.dim, args.kda_heads, args.kda_head_dim
        self.n_heads, self.head_dim, self.eps = H, K, args.norm_eps
        self.gate_lower_bound = args.kda_gate_lower_bound
        self.kda_fn, self.conv_fn = kda_fn, conv_fn
        self.q_proj = nn.Linear(D, H * K, bias=False)
        self.k_proj = nn.Linear(D, H * K, bias=False)
        self.v_proj = nn.Linear(D, H * K, bias=False)
        self.q_conv = nn.Parameter(torch.empty(H * K, 1, args.kda_conv_size))
        self.k_conv = nn.Parameter(torch.empty(H * K, 1, args.kda_conv_size))
        self.v_conv = nn.Parameter(torch.empty(H * K, 1, args.kda_conv_size))
        self.f_a = nn.Linear(D, K, bias=False)
        self.f_b = nn.Linear(K, H * K, bias=False)
        self.A_log = nn.Parameter(torch.empty(H))
        self.dt_bias = nn.Parameter(torch.empty(H, K))
        self.b_proj = nn.Linear(D, H, bias=False)
        self.g_proj = nn.Linear(D, H * K, bias=False)
        self.o_norm = nn.Parameter(torch.empty(K))
        self.o_proj = nn.Linear(H * K, D, bias=False)

    def reset_parameters(self) -> None:
        for lin in (self.q_proj, self.k_proj, self.v_proj, self.f_a, self.f_b, self.b_proj, self.g_proj, self.o_proj):
            init_linear(lin)
        # NOTE: the convolutions are weights of the layer too: truncated normal (std 0.02) like the projections
        # (docs/k3.md §2.1), not nn.Conv1d's uniform(+-1/sqrt(taps)), 14x wider, which they had until the audit.
        for conv in (self.q_conv, self.k_conv, self.v_conv):
            nn.init.trunc_normal_(conv, std=0.02, a=-0.06, b=0.06)
        nn.init.zeros_(self.A_log)
        # dt log-uniform in [1e-3, 1e-1] and dt_bias = softplus^-1(dt) (Mamba-2).
        dt = torch.exp(torch.empty_like(self.dt_bias).uniform_(math.log(1e-3), math.log(1e-1)))
        with torch.no_grad():
            self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
        nn.init.ones_(self.o_norm)

    def forward(self, x_BTD: torch.Tensor, docs: Documents) -> torch.Tensor:
        B, T, _ = x_BTD.shape
        H, K = self.n_heads, self.head_dim
        q = self.conv_fn(self.q_proj(x_BTD), self.q_conv, docs.pos_BT)
        k = self.conv_fn(self.k_proj(x_BTD), self.k_conv, docs.pos_BT)
        v = self.conv_fn(self.v_proj(x_BTD), self.v_conv, docs.pos_BT)
        g_raw = self.f_b(self.f_a(x_BTD))
        beta_logit = self.b_proj(x_BTD)
        shape = (1, B * T) if docs.cu_seqlens is not None else (B, T)
        o, _ = self.kda_fn(
            q.reshape(*shape, H, K), k.reshape(*shape, H, K), v.reshape(*shape, H, K),
            g_raw.reshape(*shape, H, K), beta_logit.reshape(*shape, H),
            cu_seqlens=docs.cu_seqlens_host, chunk_layout=docs.kda_chunks, A_log=self.A_log, dt_bias=self.dt_bias,
            gate_lower_bound=self.gate_lower_bound, use_qk_l2norm=True, beta_is_logit=True,
        )
        o = rms_norm(o.reshape(B, T, H, K), self.o_norm, self.eps)
        o = o * torch.sigmoid(self.g_proj(x_BTD)).view(B, T, H, K)
        return self.o_proj(o.reshape(B, T, H * K))
