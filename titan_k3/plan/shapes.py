"""What one K3 layer holds and does, from its shapes alone: parameter groups, FLOPs, saved activations.

Torch-free (the control service plans without torch). Every quantity is a closed form of the module
shapes in titan_k3/models/k3/ (the layer code is the source; tests/unit/test_plan.py checks the parameter
groups against the instantiated model on the meta device and its optimizer hints).

Legend: N tokens of one micro-batch on one rank, T sequence length, D width, H heads, K key width,
L latent width, F expert hidden width, E routed experts, k experts per token, V vocabulary.
Units: parameters are counts, FLOPs are floating-point operations (a multiply-add is 2), activation sizes
are bytes per token.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from titan_k3.models.k3.args import KDA_CHUNK, K3Args, count_params

BF16, FP32 = 2, 4


@dataclass(frozen=True)
class ParamGroups:
    """The model's parameters split the way memory and the optimizers see them (counts)."""

    muon_dense: int
    """Matrices updated by Per-Head Muon outside the routed experts (sharded over the FSDP ranks)."""
    muon_experts: int
    """Routed-expert matrices (Per-Head Muon, one matrix per expert; split over EP, then sharded over efsdp)."""
    adamw: int
    """AdamW parameters other than the routers: embedding, head, norms, convs, gates' A_log/dt_bias, queries."""
    routers: int
    """Router weights: float32, whole on every rank (never sharded), AdamW."""
    embedding: int
    """The input embedding (a lookup: no compute copy in bf16)."""

    @property
    def total(self) -> int:
        return self.muon_dense + self.muon_experts + self.adamw + self.routers

    @property
    def sharded(self) -> int:
        """Everything FSDP shards over the data-parallel shard ranks (all but the routers and experts)."""
        return self.muon_dense + self.adamw

    @property
    def root(self) -> int:
        """The FSDP root's share of `sharded`: the embedding and the head (its final norm and query are a rounding
        error). The trainer never reshards the root between forward and backward (titan_k3/parallel/parallelize.py)."""
        return 2 * self.embedding


@functools.cache
def param_groups(a: K3Args) -> ParamGroups:
    D = a.dim
    muon = adam = routers = experts = 0
    for i in range(a.n_layers):
        if a.is_mla(i):
            H, qk = a.mla_heads, a.qk_nope_dim + a.qk_rope_dim
            muon += (D * a.q_lora_rank + a.q_lora_rank * H * qk + D * (a.kv_lora_rank + a.qk_rope_dim)
                     + a.kv_lora_rank * H * (a.qk_nope_dim + a.v_head_dim) + D * H * a.v_head_dim
                     + H * a.v_head_dim * D)
            adam += a.q_lora_rank + a.kv_lora_rank                               # q_norm, kv_norm
        else:
            H, K = a.kda_heads, a.kda_head_dim
            HK = H * K
            muon += 3 * D * HK + D * K + K * HK + D * H + D * HK + HK * D       # q k v, f_a f_b, beta, gate, out
            adam += 3 * HK * a.kda_conv_size + H + HK + K                       # convs, A_log, dt_bias, o_norm
        if a.is_moe(i):
            routers += a.n_experts * D
            muon += 2 * D * a.latent_dim + 3 * D * a.n_shared_experts * a.expert_hidden
            adam += a.latent_dim                                                 # latent norm
            experts += 3 * a.n_experts * a.latent_dim * a.expert_hidden
        else:
            muon += 3 * D * a.dense_hidden
        adam += 4 * D                                                            # two pre-norms, two queries
    embedding = a.vocab_size * D
    adam += 2 * a.vocab_size * D + 2 * D                                         # embedding, head, final norm + query
    groups = ParamGroups(muon, experts, adam, routers, embedding)
    assert groups.total == count_params(a).total, "param_groups disagrees with count_params"
    return groups


@functools.cache
def largest_block_params(a: K3Args) -> int:
    """Parameters of the largest block (one FSDP unit) outside the routed experts, routers excluded."""
    best = 0
    for i in range(a.n_layers):
        one = a.replace(n_layers=1, full_attention_layers=(0,) if a.is_mla(i) else (),
                        n_dense_layers=0 if a.is_moe(i) else 1)
        p = param_groups(one)
        best = max(best, p.muon_dense + p.adamw - 2 * a.vocab_size * a.dim - 2 * a.dim)
    return best


def layer_expert_params(a: K3Args) -> int:
    """Routed-expert parameters of one MoE layer (all E experts)."""
    return 3 * a.n_experts * a.latent_dim * a.expert_hidden


# ---------------------------------------------------------------------------
# FLOPs per token, forward + backward (backward = 2x forward for every matmul).


def kda_flops(a: K3Args, seq_len: int) -> float:
    D, H, K = a.dim, a.kda_heads, a.kda_head_dim
    HK = H * K
    matmul = 3 * D * HK + D * K + K * HK + D * H + D * HK + HK * D
    C = min(KDA_CHUNK, seq_len)
    kernel = H * (3 * 2 * K * K + 2 * C * (4 * K) + 2 * C * C / 3)
    return 6 * matmul + 3 * kernel


def mla_flops(a: K3Args, seq_len: int) -> float:
    D, H, qk, V = a.dim, a.mla_heads, a.qk_nope_dim + a.qk_rope_dim, a.v_head_dim
    matmul = (D * a.q_lora_rank + a.q_lora_rank * H * qk + D * (a.kv_lora_rank + a.qk_rope_dim)
              + a.kv_lora_rank * H * (a.qk_nope_dim + V) + 2 * D * H * V)
    attention = 2 * H * (qk + V) * (seq_len + 1) / 2
    return 6 * matmul + 3 * attention


def moe_flops(a: K3Args) -> float:
    D, L, F = a.dim, a.latent_dim, a.expert_hidden
    matmul = a.n_experts * D + 2 * D * L + a.top_k * 3 * L * F + 3 * D * a.n_shared_experts * F
    return 6 * matmul


def dense_ffn_flops(a: K3Args) -> float:
    return 6 * 3 * a.dim * a.dense_hidden


def head_flops(a: K3Args) -> float:
    """The fused head + loss: three N x V x D matmuls (logits, dH, dW; the backward only rescales)."""
    return 3 * 2 * a.vocab_size * a.dim


def layer_kinds(a: K3Args) -> dict[str, int]:
    """How many sublayers of each kind the model has: kda, mla, moe, dense_ffn."""
    n_mla = len(a.mla_layers)
    n_moe = sum(a.is_moe(i) for i in range(a.n_layers))
    return {"kda": a.n_layers - n_mla, "mla": n_mla, "moe": n_moe, "dense_ffn": a.n_layers - n_moe}


def kind_flops(a: K3Args, kind: str, seq_len: int) -> float:
    """Forward + backward FLOPs per token of one sublayer of `kind`."""
    return {"kda": lambda: kda_flops(a, seq_len), "mla": lambda: mla_flops(a, seq_len), "moe": lambda: moe_flops(a),
            "dense_ffn": lambda: dense_ffn_flops(a), "head": lambda: head_flops(a)}[kind]()


# ---------------------------------------------------------------------------
# Activations kept from forward to backward, bytes per token, read off the layer code. Compiled sublayers
# recompute cheap pointwise results, so these are upper-bound counts of the tensors each op saves; one
# calibration factor (titan_k3/plan/constants.py) maps them to the measured peaks.


def kda_saved(a: K3Args) -> float:
    D, HK = a.dim, a.kda_heads * a.kda_head_dim
    # mixed input + its norm; q k v before the convs, after conv + SiLU (the kernel's inputs);
    # the gate's low-rank f (K) and HK output, beta (H); kernel output, its norm, the sigmoid gate, o_proj's input.
    return BF16 * (2 * D + 3 * HK + 3 * HK + a.kda_head_dim + HK + a.kda_heads + 4 * HK) + FP32 * HK


def mla_saved(a: K3Args) -> float:
    D, H, qk, V = a.dim, a.mla_heads, a.qk_nope_dim + a.qk_rope_dim, a.v_head_dim
    # mixed input + norm; q's low rank + norm; q; kv low rank + norm; k_nope|v; k (with the shared part);
    # attention output + logsumexp; gate; wo's input.
    return (BF16 * (2 * D + 2 * a.q_lora_rank + H * qk + 2 * a.kv_lora_rank + a.qk_rope_dim
                    + H * (a.qk_nope_dim + V) + H * qk + H * V + H * V + H * V) + FP32 * H)


def moe_saved(a: K3Args, ep: int = 1, all_gather_dispatch: bool = True) -> float:
    """Per local token. Under EP's all-gather dispatch every rank's expert buffers hold the group's slots (x ep)."""
    D, L, F, k = a.dim, a.latent_dim, a.expert_hidden, a.top_k
    per_slot = BF16 * (L + 2 * F + L)                       # gathered latent row, W1 and W3 outputs, expert output
    slots = k * (ep if all_gather_dispatch else 1)
    router = FP32 * (a.n_experts + 2 * k) + 8 * k           # sigmoid scores, weights, selected scores, ids
    shared = BF16 * 3 * a.n_shared_experts * F
    return BF16 * (2 * D + 3 * L) + router + slots * per_slot + shared


def dense_ffn_saved(a: K3Args) -> float:
    return BF16 * (2 * a.dim + 3 * a.dense_hidden)


def residual_saved(a: K3Args) -> float:
    """Per layer: the two sublayer outputs and the two partial sums the mixes read (bf16 [N, D] each)."""
    return BF16 * 4 * a.dim


def kind_saved(a: K3Args, kind: str, ep: int = 1, all_gather_dispatch: bool = True) -> float:
    return {"kda": lambda: kda_saved(a), "mla": lambda: mla_saved(a),
            "moe": lambda: moe_saved(a, ep, all_gather_dispatch), "dense_ffn": lambda: dense_ffn_saved(a)}[kind]()


@functools.cache
def activation_bytes_per_token(a: K3Args, ep: int = 1, all_gather_dispatch: bool = True) -> float:
    """Every layer's saved activations per token (before the calibration factor), embedding included."""
    total = FP32 * a.dim + a.n_layers * residual_saved(a)
    for kind, n in layer_kinds(a).items():
        total += n * kind_saved(a, kind, ep, all_gather_dispatch)
    return total


@functools.cache
def largest_layer_saved(a: K3Args, ep: int = 1, all_gather_dispatch: bool = True) -> float:
    """Bytes per token of the largest layer (attention + FFN sublayer): what a checkpointed layer recomputes."""
    attn = max(kda_saved(a), mla_saved(a) if a.mla_layers else 0.0)
    return attn + moe_saved(a, ep, all_gather_dispatch) + residual_saved(a)


@functools.cache
def newton_schulz_flops(a: K3Args) -> tuple[float, float]:
    """(FLOPs of 5 Newton–Schulz steps over all Muon blocks of the dense part, of the routed experts).

    Per block [r, c] (r <= c after the wide orientation): each step A = X X^T (2 r^2 c), B = b A + c A^2
    (2 r^3), B X (2 r^2 c).
    """
    def ns(r: int, c: int, count: int) -> float:
        r, c = min(r, c), max(r, c)
        return 5 * count * (4 * r * r * c + 2 * r ** 3)

    D = a.dim
    dense = experts = 0.0
    for i in range(a.n_layers):
        if a.is_mla(i):
            H, qk, V = a.mla_heads, a.qk_nope_dim + a.qk_rope_dim, a.v_head_dim
            dense += (ns(a.q_lora_rank, D, 1) + ns(qk, a.q_lora_rank, H) + ns(a.kv_lora_rank + a.qk_rope_dim, D, 1)
                      + ns(a.qk_nope_dim + V, a.kv_lora_rank, H) + 2 * ns(H * V, D, 1))
        else:
            H, K = a.kda_heads, a.kda_head_dim
            dense += (ns(K, D, 3 * H) + ns(K, D, 1) + ns(H * K, K, 1) + ns(H, D, 1) + 2 * ns(H * K, D, 1))
        if a.is_moe(i):
            dense += 2 * ns(a.latent_dim, D, 1) + 3 * ns(a.n_shared_experts * a.expert_hidden, D, 1)
            experts += ns(a.latent_dim, a.expert_hidden, 3 * a.n_experts)
        else:
            dense += 3 * ns(a.dense_hidden, D, 1)
    return dense, experts
