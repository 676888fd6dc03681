"""Gated NoPE multi-head latent attention (docs/k3.md §2.2).

Legend: B batch, T tokens, D width, H heads, N nope width, R shared ("rope",
never rotated) key width, V value width. Packed documents are masked so no
token attends to another document: by flash attention's variable-length kernel
(each document its own causal sequence: no work across documents), by
scaled_dot_product_attention on a dense [B, 1, T, T] mask, or by
flex_attention on the documents' BlockMask, which skips every block that lies
across documents. The layer records, per head, the largest pre-softmax logit
it produced since the last `pop_max_logit()` (exact, over the causal document
mask): QK-Clip reads it after each optimizer step.
"""

from __future__ import annotations

import inspect
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import sdpa_kernel
from torch.nn.attention.flex_attention import flex_attention
from torch.nn.attention.varlen import varlen_attn

from kernels.max_logit import max_logit_per_head_reference
from titan_k3.models.k3.args import K3Args
from titan_k3.models.k3.documents import Documents
from titan_k3.models.k3.layers import RMSNorm, init_linear

FLEX = "flex"
"""An entry of `GatedMLA.sdpa_backends` next to the SDPBackend ones: packed-document batches attend through flex_attention."""

VARLEN = "varlen"
"""An entry of `GatedMLA.sdpa_backends`: packed-document batches attend through flash attention's variable-length
kernel (`document_varlen_attention`)."""

VARLEN_DTYPES = (torch.bfloat16, torch.float16)
"""What flash attention computes in."""

# NOTE: torch 2.10 spells causal `is_causal=True` and has no `scale`; later versions take a (left, right) window
# and a scale. Resolved once, here.
_VARLEN_PARAMS = inspect.signature(varlen_attn).parameters
_VARLEN_CAUSAL = {"window_size": (-1, 0)} if "window_size" in _VARLEN_PARAMS else {"is_causal": True}
_VARLEN_TAKES_SCALE = "scale" in _VARLEN_PARAMS


def document_varlen_attention(q, k, v, cu_seqlens_i32: torch.Tensor, scale: float) -> torch.Tensor:
    """q, k [B, H, T, E], v [B, H, T, V], cu_seqlens_i32 [N+1] over B*T -> [B, H, T, V], causal per document.

    The B rows are one packed sequence of N documents; flash attention computes each document's causal
    attention alone, so no block across documents is ever loaded (a dense mask computes all T x T scores).
    NOTE: flash takes one head width W = max(E, V) for q, k and v: the narrower side is padded with zeros (zero
    columns change no dot product) and the output cut back to V; the padding's extra work is far less than the
    dense mask's wasted blocks.
    """
    B, H, T, E = q.shape
    V = v.shape[-1]
    W = max(E, V)
    if not _VARLEN_TAKES_SCALE:
        q = q * (scale * W**0.5)  # the kernel's own scale is W ** -0.5

    def rows(t):
        # [B, H, T, d] views of [B, T, H, d] projections -> token-major [B*T, H, W]: a free reshape when contiguous.
        t = t.transpose(1, 2)
        return (F.pad(t, (0, W - t.shape[-1])) if t.shape[-1] < W else t).reshape(B * T, H, W)

    kwargs = dict(_VARLEN_CAUSAL, scale=scale) if _VARLEN_TAKES_SCALE else dict(_VARLEN_CAUSAL)
    o = varlen_attn(rows(q), rows(k), rows(v), cu_seqlens_i32, cu_seqlens_i32, T, T, **kwargs)
    return o[..., :V].view(B, T, H, V).transpose(1, 2)


# NOTE: compiled once, here, as torch's docs ask: eager flex_attention materialises the whole score matrix. Inside a
# compiled sublayer (parallelize.apply_compile) dynamo traces through this wrapper, so the sublayer's graph holds
# the fused kernel (with inductor; another `compile.backend` would run flex's unfused reference, so the config
# refuses that pair); the same call in an eager model compiles on its own.
compiled_flex_attention = torch.compile(flex_attention)


class GatedMLA(nn.Module):
    def __init__(self, args: K3Args, sdpa_backends: list | None = None, max_logit: Callable = max_logit_per_head_reference):
        super().__init__()
        D, H = args.dim, args.mla_heads
        self.n_heads, self.nope, self.rope, self.v_dim = H, args.qk_nope_dim, args.qk_rope_dim, args.v_head_dim
        self.kv_lora = args.kv_lora_rank
        self.scale = (self.nope + self.rope) ** -0.5
        self.sdpa_backends = sdpa_backends
        self.max_logit_fn = max_logit
        """(q [B, H, T, E], k, scale, pos [B, T] or None) -> float32 [H]: kernels.max_logit or its reference."""
        self.wq_a = nn.Linear(D, args.q_lora_rank, bias=False)
        self.q_norm = RMSNorm(args.q_lora_rank, args.norm_eps)
        self.wq_b = nn.Linear(args.q_lora_rank, H * (self.nope + self.rope), bias=False)
        self.wkv_a = nn.Linear(D, args.kv_lora_rank + self.rope, bias=False)
        self.kv_norm = RMSNorm(args.kv_lora_rank, args.norm_eps)
        self.wkv_b = nn.Linear(args.kv_lora_rank, H * (self.nope + self.v_dim), bias=False)
        self.w_gate = nn.Linear(D, H * self.v_dim, bias=False)
        self.wo = nn.Linear(H * self.v_dim, D, bias=False)
        self.register_buffer("max_logit", torch.full((H,), float("-inf")), persistent=False)
        self.track_max_logit = True

    def reset_parameters(self) -> None:
        for lin in (self.wq_a, self.wq_b, self.wkv_a, self.wkv_b, self.w_gate, self.wo):
            init_linear(lin)
        self.q_norm.reset_parameters()
        self.kv_norm.reset_parameters()
        self.max_logit.fill_(float("-inf"))

    def pop_max_logit(self) -> torch.Tensor:
        """The per-head max logit since the last pop (float32 [H]), and reset it."""
        value = self.max_logit.clone()
        self.max_logit.fill_(float("-inf"))
        return value

    def _attend(self, q, k, v, docs: Documents) -> torch.Tensor:
        """q, k [B, H, T, N+R], v [B, H, T, V] -> [B, H, T, V], causal inside each document.

        With VARLEN among the backends, packed-document batches in 16 bits run flash attention's variable-length
        kernel on the document boundaries (float32 goes on to the SDPA backends listed with it; an explicit
        `kernels.attention = varlen` is refused without bf16 compute). With FLEX, packed-document batches run
        flex_attention on the documents' BlockMask, and batches of whole-row documents the SDPA backends listed
        with it (is_causal), or flex when none is. Otherwise SDPA runs on the listed backends (all of them when the
        list is empty) with the dense mask (is_causal for whole-row documents).
        """
        backends = self.sdpa_backends or []
        if VARLEN in backends and docs.cu_seqlens is not None and q.dtype in VARLEN_DTYPES:
            return document_varlen_attention(q, k, v, docs.cu_seqlens_i32, self.scale)
        sdpa = [b for b in backends if b not in (FLEX, VARLEN)]
        if FLEX in backends and (docs.cu_seqlens is not None or not sdpa):
            # NOTE: contiguous [B, H, T, d] operands: on the model's transposed views flex ran 3.02 ms fwd+bwd
            # against 2.12 ms (attention.md); inductor folds the copies into the projections' epilogues.
            q, k, v = (t.contiguous() for t in (q, k, v))
            return compiled_flex_attention(q, k, v, block_mask=docs.block_mask(), scale=self.scale)
        mask = docs.attention_mask()
        kwargs = dict(attn_mask=mask, is_causal=mask is None, scale=self.scale)
        if sdpa:
            with sdpa_kernel(sdpa):
                return F.scaled_dot_product_attention(q, k, v, **kwargs)
        return F.scaled_dot_product_attention(q, k, v, **kwargs)

    def forward(self, x_BTD: torch.Tensor, docs: Documents) -> torch.Tensor:
        B, T, _ = x_BTD.shape
        H, N, R, V = self.n_heads, self.nope, self.rope, self.v_dim
        q = self.wq_b(self.q_norm(self.wq_a(x_BTD))).view(B, T, H, N + R)
        c, kr = self.wkv_a(x_BTD).split([self.kv_lora, R], dim=-1)
        k_nope, v = self.wkv_b(self.kv_norm(c)).view(B, T, H, N + V).split([N, V], dim=-1)
        k = torch.cat([k_nope, kr[:, :, None, :].expand(B, T, H, R)], dim=-1)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if self.training and self.track_max_logit:
            with torch.no_grad():
                pos = docs.pos_BT if docs.cu_seqlens is not None else None
                self.max_logit.copy_(torch.maximum(self.max_logit, self.max_logit_fn(q, k, self.scale, pos)))
        o = self._attend(q, k, v, docs).transpose(1, 2)
        o = o * torch.sigmoid(self.w_gate(x_BTD)).view(B, T, H, V)
        return self.wo(o.reshape(B, T, H * V))
