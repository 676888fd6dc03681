"""The strong public-parts peer: k3-mini as a TorchTitan user would assemble it today, compiled per block.

Same architecture and shapes as our k3-mini (hybrid KDA / gated NoPE MLA
layers, LatentMoE with a sigmoid router and SiTU-GLU experts, a dense layer 0,
Block Attention Residuals, untied 163,840-wide head), built only from public
parts and written here, not taken from titan_k3.models:

- KDA: flash-linear-attention's `chunk_kda` with the safe gate, the gate, the
  q/k L2 norm and the beta sigmoid all fused in its kernels; fla's
  `ShortConvolution` (causal depthwise conv + SiLU); fla's `FusedRMSNormGated`
  for the gated output norm.
- MLA: `F.scaled_dot_product_attention` on cuDNN, plain causal.
- Experts: `torch._grouped_mm` (cuBLAS grouped GEMM) with a sync-free
  permutation (sort + searchsorted, no bincount).
- Head + loss: fla's `FusedLinearCrossEntropyLoss` (chunked, never the full logits).
- bf16 parameters, `torch.optim.AdamW(fused=True)`, per-block `torch.compile`
  (each K3 block is one compile unit, as TorchTitan's `apply_compile` does).

What it leaves out, so the comparison flatters it: no Per-Head Muon, no
Quantile Balancing update (the router bias stays zero), no gradient clipping,
no QK-Clip, no document masks (plain causal attention and KDA over whole rows).

`PeerConfig(parts="fla")` needs CUDA and fla; `parts="torch"` swaps each fla
part for a plain PyTorch equivalent so the model runs on a CPU (the tests'
smoke check only; never a measurement).

    PYTHONPATH=. python benchmarks/train_throughput.py --variants peer-compiled,peer-public-eager,...

Legend: B batch, T tokens, D width, H heads, K head width, E experts, k experts per token, L latent, F expert hidden.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from titan_k3.gc_schedule import ScheduledGC
from titan_k3.models.k3.args import K3Args, get_flavor

GATE_LOWER_BOUND = -5.0


@dataclass(frozen=True)
class PeerConfig:
    flavor: str = "k3-mini"
    vocab_size: int = 163840
    parts: str = "fla"
    """"fla" (CUDA: the public kernels) or "torch" (plain PyTorch, for a CPU smoke check)."""
    compile: bool = True
    compile_mode: str | None = None
    """torch.compile's mode for every block: None (default), or "reduce-overhead", its CUDA graphs (cudagraph trees)
    around each compiled region: what a user whose step is host-bound would try first."""
    lr: float = 3e-3
    seed: int = 0
    head_grad_fp32: bool = True
    """fla's linear cross-entropy adds the head's weight gradient up over its chunks in float32 (its default, the
    precision ours keeps); False adds it up in the weights' bf16 (`accumulate_grad_in_fp32=False`): no float32
    copies of each chunk's logits and inputs and a bf16 product instead of a TF32 one, a rounding per chunk."""
    gc_every: int = 50
    """Python's automatic garbage collection off while the peer trains, a generation-1 pass every gc_every updates,
    as TorchTitan's `training.gc_freq` (and our trainer's `training.gc_every`, the same default) schedule it: a
    host-bound step pauses with the host (0: the automatic collector)."""


def situ_glu(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """SiTU-GLU in float32: 4 tanh(g/4) sigmoid(g) * 25 tanh(u/25)."""
    g, u = g.float(), u.float()
    return 4 * torch.tanh(g / 4) * torch.sigmoid(g) * 25 * torch.tanh(u / 25)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return (F.rms_norm(x.float(), (x.shape[-1],), None, eps) * w.float()).to(x.dtype)


class Norm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)


class GluFFN(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1, self.w3 = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.w2(situ_glu(self.w1(x), self.w3(x)).to(x.dtype))


# --- KDA ---------------------------------------------------------------------------------------------------------


def _naive_kda(q, k, v, g_raw, beta_logit, A_log, dt_bias, scale):
    """The recurrence token by token in float32 (the "torch" parts; CPU smoke only). [B, T, H, K] -> [B, T, H, K]."""
    q, k = F.normalize(q.float(), dim=-1, eps=1e-6), F.normalize(k.float(), dim=-1, eps=1e-6)
    v, beta = v.float(), torch.sigmoid(beta_logit.float())
    H, K = q.shape[2], q.shape[3]
    g = GATE_LOWER_BOUND * torch.sigmoid(A_log.float().exp().view(H, 1) * (g_raw.float() + dt_bias.float().view(H, K)))
    S = q.new_zeros(q.shape[0], H, K, v.shape[-1])
    out = []
    for t in range(q.shape[1]):
        S = S * g[:, t].exp().unsqueeze(-1)
        kt = k[:, t]
        S = S + beta[:, t, :, None, None] * kt.unsqueeze(-1) * (v[:, t] - torch.einsum("bhkv,bhk->bhv", S, kt)).unsqueeze(-2)
        out.append(torch.einsum("bhkv,bhk->bhv", S, scale * q[:, t]))
    return torch.stack(out, dim=1)


class TorchShortConv(nn.Module):
    """Causal depthwise conv of width W, then SiLU ([B, T, C] -> [B, T, C]); the "torch" stand-in for fla's."""

    def __init__(self, channels: int, width: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, width))
        nn.init.uniform_(self.weight, -1 / math.sqrt(width), 1 / math.sqrt(width))

    def forward(self, x):
        y = F.conv1d(x.transpose(1, 2), self.weight.to(x.dtype), padding=self.weight.shape[-1] - 1, groups=x.shape[-1])
        return (F.silu(y[..., : x.shape[1]].transpose(1, 2)), None)


class PeerKDA(nn.Module):
    def __init__(self, a: K3Args, parts: str):
        super().__init__()
        D, H, K = a.dim, a.kda_heads, a.kda_head_dim
        self.H, self.K, self.parts = H, K, parts
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(D, H * K, bias=False) for _ in range(3))
        if parts == "fla":
            from fla.modules import FusedRMSNormGated, ShortConvolution

            self.q_conv, self.k_conv, self.v_conv = (ShortConvolution(H * K, a.kda_conv_size, activation="silu")
                                                     for _ in range(3))
            self.o_norm = FusedRMSNormGated(K, activation="sigmoid", eps=a.norm_eps)
        else:
            self.q_conv, self.k_conv, self.v_conv = (TorchShortConv(H * K, a.kda_conv_size) for _ in range(3))
            self.o_norm = Norm(K, a.norm_eps)
        self.f_a, self.f_b = nn.Linear(D, K, bias=False), nn.Linear(K, H * K, bias=False)
        self.A_log = nn.Parameter(torch.zeros(H))
        dt = torch.exp(torch.empty(H * K).uniform_(math.log(1e-3), math.log(1e-1)))
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))
        self.b_proj, self.g_proj = nn.Linear(D, H, bias=False), nn.Linear(D, H * K, bias=False)
        self.o_proj = nn.Linear(H * K, D, bias=False)

    def forward(self, x):
        B, T, _ = x.shape
        H, K = self.H, self.K
        q, k, v = (conv(proj(x))[0].view(B, T, H, K) for conv, proj in
                   ((self.q_conv, self.q_proj), (self.k_conv, self.k_proj), (self.v_conv, self.v_proj)))
        g_raw, beta_logit = self.f_b(self.f_a(x)).view(B, T, H, K), self.b_proj(x)
        o = _kda_core(self.parts, q, k, v, g_raw, beta_logit, self.A_log, self.dt_bias, K ** -0.5)
        gate = self.g_proj(x).view(B, T, H, K)
        if self.parts == "fla":
            o = self.o_norm(o, gate)
        else:
            o = self.o_norm(o.to(x.dtype)) * torch.sigmoid(gate)
        return self.o_proj(o.reshape(B, T, H * K).to(x.dtype))


# NOTE: fla's op runs outside the compiled graph (one graph break per KDA block): its Triton kernels autotune
# and check their inputs in Python, which dynamo does not trace; this is how fla's layers are compiled in practice.
@torch.compiler.disable
def _kda_core(parts, q, k, v, g_raw, beta_logit, A_log, dt_bias, scale):
    if parts == "torch":
        return _naive_kda(q, k, v, g_raw, beta_logit, A_log, dt_bias, scale)
    from fla.ops.kda import chunk_kda

    o, _ = chunk_kda(q, k, v, g_raw, beta_logit, scale=scale, use_qk_l2norm_in_kernel=True,
                     use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, safe_gate=True,
                     lower_bound=GATE_LOWER_BOUND, A_log=A_log, dt_bias=dt_bias)
    return o


# --- MLA ---------------------------------------------------------------------------------------------------------


class PeerMLA(nn.Module):
    def __init__(self, a: K3Args, parts: str):
        super().__init__()
        D, H = a.dim, a.mla_heads
        self.H, self.N, self.R, self.V, self.C = H, a.qk_nope_dim, a.qk_rope_dim, a.v_head_dim, a.kv_lora_rank
        self.parts = parts
        self.wq_a, self.q_norm = nn.Linear(D, a.q_lora_rank, bias=False), Norm(a.q_lora_rank, a.norm_eps)
        self.wq_b = nn.Linear(a.q_lora_rank, H * (self.N + self.R), bias=False)
        self.wkv_a, self.kv_norm = nn.Linear(D, self.C + self.R, bias=False), Norm(self.C, a.norm_eps)
        self.wkv_b = nn.Linear(self.C, H * (self.N + self.V), bias=False)
        self.w_gate, self.wo = nn.Linear(D, H * self.V, bias=False), nn.Linear(H * self.V, D, bias=False)

    def forward(self, x):
        B, T, _ = x.shape
        H, N, R, V = self.H, self.N, self.R, self.V
        q = self.wq_b(self.q_norm(self.wq_a(x))).view(B, T, H, N + R)
        c, kr = self.wkv_a(x).split([self.C, R], dim=-1)
        k_nope, v = self.wkv_b(self.kv_norm(c)).view(B, T, H, N + V).split([N, V], dim=-1)
        k = torch.cat([k_nope, kr[:, :, None, :].expand(B, T, H, R)], dim=-1)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if self.parts == "fla":
            from torch.nn.attention import SDPBackend, sdpa_kernel

            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=(N + R) ** -0.5)
        else:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=(N + R) ** -0.5)
        o = o.transpose(1, 2) * torch.sigmoid(self.w_gate(x)).view(B, T, H, V)
        return self.wo(o.reshape(B, T, H * V))


# --- LatentMoE ---------------------------------------------------------------------------------------------------


def _experts_grouped_mm(z_SL, w1_EFL, w3_EFL, w2_ELF, offs_E):
    """Rows grouped by expert through the three expert matrices (cuBLAS grouped GEMM, bf16 CUDA).

    The weights are stored transposed ([E, out, in]) so that their [E, in, out] views are the column-major
    operand torch._grouped_mm wants, with no copy per call.
    """
    g = torch._grouped_mm(z_SL, w1_EFL.transpose(1, 2), offs=offs_E)
    u = torch._grouped_mm(z_SL, w3_EFL.transpose(1, 2), offs=offs_E)
    return torch._grouped_mm(situ_glu(g, u).to(z_SL.dtype), w2_ELF.transpose(1, 2), offs=offs_E)


def _experts_loop(z_SL, w1_EFL, w3_EFL, w2_ELF, offs_E):
    """The same with a Python loop over experts (the "torch" parts; CPU smoke only)."""
    out, start = [], 0
    for e, end in enumerate(offs_E.tolist()):
        z = z_SL[start:end]
        out.append((situ_glu(z @ w1_EFL[e].t(), z @ w3_EFL[e].t()).to(z.dtype)) @ w2_ELF[e].t())
        start = end
    return torch.cat(out)


class PeerMoE(nn.Module):
    def __init__(self, a: K3Args, parts: str):
        super().__init__()
        D, L, Fh, E = a.dim, a.latent_dim, a.expert_hidden, a.n_experts
        self.E, self.k, self.eps = E, a.top_k, a.norm_eps
        self.experts = _experts_grouped_mm if parts == "fla" else _experts_loop
        self.router = nn.Parameter(torch.empty(E, D))
        nn.init.trunc_normal_(self.router, std=0.02, a=-0.06, b=0.06)
        self.register_buffer("bias", torch.zeros(E))
        self.w_down, self.w_up = nn.Linear(D, L, bias=False), nn.Linear(L, D, bias=False)
        self.latent_norm = Norm(L, a.norm_eps)
        self.w1, self.w3, self.w2 = (nn.Parameter(torch.empty(*s)) for s in ((E, Fh, L), (E, Fh, L), (E, L, Fh)))
        for w in (self.w1, self.w3, self.w2):
            nn.init.trunc_normal_(w, std=0.02, a=-0.06, b=0.06)
        self.shared = GluFFN(D, a.n_shared_experts * Fh)

    def forward(self, x):
        B, T, D = x.shape
        x_TD = x.reshape(B * T, D)
        s_TE = torch.sigmoid(x_TD.float() @ self.router.float().t())
        idx_TK = torch.topk(s_TE + self.bias, self.k, dim=-1).indices
        w_TK = s_TE.gather(1, idx_TK)
        w_TK = w_TK / w_TK.sum(-1, keepdim=True)
        sorted_S, order_S = torch.sort(idx_TK.reshape(-1), stable=True)
        offs_E = torch.searchsorted(sorted_S, torch.arange(self.E, device=x.device), right=True).to(torch.int32)
        token_S = order_S // self.k
        z_SL = self.w_down(x_TD)[token_S]
        y_SL = self.experts(z_SL, self.w1, self.w3, self.w2, offs_E)
        y_SL = y_SL.float() * w_TK.reshape(-1)[order_S, None]
        y_TL = torch.zeros(B * T, y_SL.shape[1], device=x.device, dtype=torch.float32).index_add_(0, token_S, y_SL)
        return (self.w_up(self.latent_norm(y_TL.to(x.dtype))) + self.shared(x_TD)).view(B, T, D)


# --- the model -----------------------------------------------------------------------------------------------------


def pseudo_query_mix(sources: list[torch.Tensor], query: torch.Tensor, eps: float) -> torch.Tensor:
    """Softmax over sources of <RMSNorm(v_n), q>, mixing the sources; float32 math, result in the sources' dtype."""
    v_NBTD = torch.stack(sources).float()
    scores = (F.rms_norm(v_NBTD, (v_NBTD.shape[-1],), None, eps) * query.float()).sum(-1)
    return (scores.softmax(dim=0).unsqueeze(-1) * v_NBTD).sum(0).to(sources[0].dtype)


class PeerBlock(nn.Module):
    def __init__(self, a: K3Args, layer: int, parts: str):
        super().__init__()
        self.eps = a.norm_eps
        self.attn_query, self.ffn_query = nn.Parameter(torch.zeros(a.dim)), nn.Parameter(torch.zeros(a.dim))
        self.attn_norm, self.ffn_norm = Norm(a.dim, a.norm_eps), Norm(a.dim, a.norm_eps)
        self.attn = PeerMLA(a, parts) if a.is_mla(layer) else PeerKDA(a, parts)
        self.ffn = PeerMoE(a, parts) if a.is_moe(layer) else GluFFN(a.dim, a.dense_hidden)

    def _mix(self, sources, query):
        return sources[0] if len(sources) == 1 else pseudo_query_mix(sources, query, self.eps)

    def forward(self, completed: list[torch.Tensor], partial: torch.Tensor | None):
        """Block Attention Residuals: both sublayers read a mix of the completed blocks and the partial sum."""
        attn_out = self.attn(self.attn_norm(self._mix(completed + ([partial] if partial is not None else []),
                                                      self.attn_query)))
        partial = attn_out if partial is None else partial + attn_out
        return partial + self.ffn(self.ffn_norm(self._mix(completed + [partial], self.ffn_query)))


class PeerModel(nn.Module):
    def __init__(self, a: K3Args, parts: str, head_grad_fp32: bool = True):
        super().__init__()
        self.a = a
        self.embed = nn.Embedding(a.vocab_size, a.dim)
        nn.init.normal_(self.embed.weight, std=1.0)
        self.layers = nn.ModuleList(PeerBlock(a, i, parts) for i in range(a.n_layers))
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=0.02, a=-0.06, b=0.06)
        self.final_query, self.norm = nn.Parameter(torch.zeros(a.dim)), Norm(a.dim, a.norm_eps)
        self.output = nn.Linear(a.dim, a.vocab_size, bias=False)
        nn.init.trunc_normal_(self.output.weight, std=a.dim ** -0.5)
        if parts == "fla":
            from fla.modules import FusedLinearCrossEntropyLoss

            # NOTE: fla accumulates the head's weight gradient in float32 by default; with float32 matmuls left at
            # full precision that ran as SIMT sgemm, 104 ms of a 273 ms step (first measurement). A user who
            # profiles once turns on TF32 (PeerCompiledTrainer), which keeps the float32 accumulation; one who
            # profiles twice sees the float32 copies and products it costs (PeerConfig.head_grad_fp32).
            self.loss = FusedLinearCrossEntropyLoss(reduction="mean", accumulate_grad_in_fp32=head_grad_fp32)
        else:
            self.loss = lambda h, t, w: F.cross_entropy((h @ w.t()).float().flatten(0, 1), t.flatten())

    def forward(self, input_ids_BT, labels_BT):
        completed, partial = [self.embed(input_ids_BT)], None
        for i, block in enumerate(self.layers):
            partial = block(completed, partial)
            if (i + 1) % self.a.attn_res_block_size == 0:
                completed, partial = completed + [partial], None
        sources = completed + ([partial] if partial is not None else [])
        h = self.norm(pseudo_query_mix(sources, self.final_query, self.a.norm_eps))
        return self.loss(h, labels_BT, self.output.weight)


class PeerCompiledTrainer:
    """One training step of the strong peer: forward, loss, backward, fused AdamW. Documents are ignored."""

    def __init__(self, cfg: PeerConfig = PeerConfig()):
        torch.manual_seed(cfg.seed)
        # TF32 for float32 matmuls (the loss's float32 gradient accumulation, the float32 router): a tuned setting.
        torch.backends.cuda.matmul.allow_tf32 = True
        self.device = torch.device("cuda" if cfg.parts == "fla" else "cpu")
        dtype = torch.bfloat16 if cfg.parts == "fla" else torch.float32
        args = get_flavor(cfg.flavor, cfg.vocab_size)
        self.model = PeerModel(args, cfg.parts, cfg.head_grad_fp32).to(self.device, dtype).train()
        for block in self.model.layers:
            if isinstance(block.attn, PeerKDA):  # fla's gate reads A_log and dt_bias in float32
                block.attn.A_log.data, block.attn.dt_bias.data = block.attn.A_log.float(), block.attn.dt_bias.float()
        if cfg.compile:
            # NOTE: every block's forward is the same code with a different number of residual sources, so each
            # block is its own compile unit (and cache entry), as TorchTitan compiles its transformer blocks.
            torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 4 * args.n_layers)
            for block in self.model.layers:
                block.compile(mode=cfg.compile_mode)
        self.graphs = cfg.compile and cfg.compile_mode == "reduce-overhead"
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.1,
                                     fused=self.device.type == "cuda")
        self.updates = 0
        self.gc_schedule = ScheduledGC(cfg.gc_every)

    def train_step(self, batch) -> torch.Tensor:
        """The mean loss of the batch (a device scalar: no host sync)."""
        self.updates += 1
        self.gc_schedule.before_update(self.updates)
        if self.graphs:
            torch.compiler.cudagraph_mark_step_begin()  # the last step's graph outputs are dead: reuse their memory
        loss = self.model(batch.input_ids.to(self.device, non_blocking=True),
                          batch.labels.to(self.device, non_blocking=True))
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.detach()

    def close(self) -> None:
        """Python's collector back as it was (the benchmark runs other variants in this process after the peer)."""
        self.gc_schedule.close()
