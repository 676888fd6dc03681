"""K3 model arguments, the named flavors, and the parameter / FLOP counter.

Torch-free, so tools that plan or count can use it without building a model;
the flavors' shapes are data in titan_k3/spec.py, which config checks read too.
Legend: D model width, H heads, K key width, V value width, E routed experts,
k experts per token, L latent width, F expert hidden width, T sequence length.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from titan_k3.spec import K3_FLAVORS, KDA_CHUNK
from titan_k3.values import is_integer, is_number


# The widest KDA head (K = V) the kernels take: kernels/kda checks it again per call, with the dtype (float32
# on a GPU stops at 128, kernels.kda.ops.FLOAT32_MAX_WIDTH, which the kernel choice checks at start-up against
# training.compute_dtype: models/k3/impl.py).
KDA_MAX_HEAD_DIM = 256


@dataclass(frozen=True)
class K3Args:
    dim: int
    n_layers: int
    vocab_size: int
    # Kimi Delta Attention
    kda_heads: int
    kda_head_dim: int
    kda_conv_size: int = 4
    kda_gate_lower_bound: float | None = -5.0
    # gated NoPE MLA
    mla_heads: int = 4
    q_lora_rank: int = 128
    kv_lora_rank: int = 128
    qk_nope_dim: int = 128
    qk_rope_dim: int = 64
    v_head_dim: int = 128
    # feed-forward
    dense_hidden: int = 2048
    n_dense_layers: int = 1
    n_experts: int = 8
    top_k: int = 2
    latent_dim: int = 256
    expert_hidden: int = 512
    n_shared_experts: int = 1
    # residual stream and norms
    attn_res_block_size: int = 4
    norm_eps: float = 1e-5
    full_attention_layers: tuple[int, ...] | None = None
    """Layer indices that are MLA; None means every 4th layer (i % 4 == 3) plus the last."""

    def __post_init__(self) -> None:
        problem = shape_problem(self)
        if problem:
            raise ValueError(problem)

    @property
    def mla_layers(self) -> tuple[int, ...]:
        if self.full_attention_layers is not None:
            return tuple(sorted(self.full_attention_layers))
        return tuple(i for i in range(self.n_layers) if i % 4 == 3 or i == self.n_layers - 1)

    @property
    def max_mix_sources(self) -> int:
        """The most sources one residual mix reads: the embedding, every completed block, the partial one."""
        return 1 + -(-self.n_layers // self.attn_res_block_size)

    def is_mla(self, layer: int) -> bool:
        return layer in self.mla_layers

    def is_moe(self, layer: int) -> bool:
        return layer >= self.n_dense_layers

    def replace(self, **kw) -> "K3Args":
        return dataclasses.replace(self, **kw)


_SIZES = ("dim", "n_layers", "vocab_size", "kda_heads", "kda_head_dim", "kda_conv_size", "mla_heads", "q_lora_rank",
          "kv_lora_rank", "v_head_dim", "dense_hidden", "n_experts", "top_k", "latent_dim", "expert_hidden",
          "attn_res_block_size")
"""Fields that size a tensor or a loop of every model: integers >= 1 (a 0 built a model whose sublayer adds nothing,
or stopped it on a division by zero or an empty reshape at its first forward)."""

_COUNTS = ("qk_nope_dim", "qk_rope_dim", "n_shared_experts", "n_dense_layers")
"""Fields that may be 0: integers >= 0."""


def shape_problem(a: K3Args) -> str | None:
    """The one line 'field=value: why' of the first field the model cannot be built or run with, or None."""
    for name in _SIZES + _COUNTS:
        value, least = getattr(a, name), 1 if name in _SIZES else 0
        if not is_integer(value) or value < least:
            return f"{name}={value!r}: must be an integer >= {least}"
    if a.kda_head_dim > KDA_MAX_HEAD_DIM:
        return f"kda_head_dim={a.kda_head_dim}: the KDA kernels take head widths 1..{KDA_MAX_HEAD_DIM}"
    if a.qk_nope_dim + a.qk_rope_dim == 0:
        return "qk_nope_dim=0, qk_rope_dim=0: an MLA query-key head needs a width (their sum) of at least 1"
    if a.n_experts < 2:
        return f"n_experts={a.n_experts}: must be >= 2 (the top_k experts of a token leave one out)"
    if a.top_k >= a.n_experts:
        # NOTE: the router ranks the top_k + 1 largest scores and Quantile Balancing measures its margins from the
        # (top_k + 1)-th (docs/k3.md §2.3, §5); top_k = n_experts stopped the first forward there.
        return (f"top_k={a.top_k}: must be in 1..{a.n_experts - 1}, below n_experts={a.n_experts} (routing ranks the "
                "top_k + 1 largest scores)")
    if a.n_dense_layers > a.n_layers:
        return f"n_dense_layers={a.n_dense_layers}: must be at most n_layers={a.n_layers}"
    if not is_number(a.norm_eps, finite=True) or a.norm_eps <= 0:
        return f"norm_eps={a.norm_eps!r}: must be a finite number > 0 (RMSNorm divides by sqrt(mean(x^2) + eps))"
    lb = a.kda_gate_lower_bound
    if lb is not None and (not is_number(lb, finite=True) or lb >= 0):
        return (f"kda_gate_lower_bound={lb!r}: must be None (the softplus gate) or a finite number < 0 (the safe "
                "gate's log decay lies in [bound, 0))")
    layers = a.full_attention_layers
    if layers is not None:
        fine = isinstance(layers, tuple) and all(is_integer(i) and 0 <= i < a.n_layers for i in layers)
        if not fine or len(set(layers)) != len(layers):
            return (f"full_attention_layers={layers!r}: must be a tuple of distinct layer indices in "
                    f"0..{a.n_layers - 1} (an index past the layers made no layer MLA and was counted as one)")
    return None


FLAVORS: dict[str, K3Args] = {name: K3Args(**shape) for name, shape in K3_FLAVORS.items()}
"""The named shapes (their table is titan_k3/spec.py, read by config checks too)."""


def get_flavor(name: str, vocab_size: int = 0) -> K3Args:
    if name not in FLAVORS:
        raise ValueError(f"unknown model flavor '{name}': expected one of {', '.join(FLAVORS)}")
    args = FLAVORS[name]
    return args.replace(vocab_size=vocab_size) if vocab_size else args


# ---------------------------------------------------------------------------
# Counting. Closed forms of the module shapes in model.py; a unit test checks
# them against the instantiated model on the meta device.


def kda_params(a: K3Args) -> int:
    D, H, K = a.dim, a.kda_heads, a.kda_head_dim
    HK = H * K
    proj = 3 * D * HK + 3 * HK * a.kda_conv_size       # q, k, v projections + depthwise convs
    gate = D * K + K * HK + H + HK                       # low-rank f, A_log, dt_bias
    return proj + gate + D * H + D * HK + K + HK * D     # beta, output gate, o-norm, W_o


def mla_params(a: K3Args) -> int:
    D, H = a.dim, a.mla_heads
    qk = a.qk_nope_dim + a.qk_rope_dim
    q = D * a.q_lora_rank + a.q_lora_rank + a.q_lora_rank * H * qk
    kv = D * (a.kv_lora_rank + a.qk_rope_dim) + a.kv_lora_rank + a.kv_lora_rank * H * (a.qk_nope_dim + a.v_head_dim)
    return q + kv + D * H * a.v_head_dim + H * a.v_head_dim * D


def routed_expert_params(a: K3Args) -> int:
    """All routed experts of one MoE layer."""
    return a.n_experts * 3 * a.latent_dim * a.expert_hidden


def ffn_params(a: K3Args, layer: int) -> int:
    D = a.dim
    if not a.is_moe(layer):
        return 3 * D * a.dense_hidden
    shared = 3 * D * a.n_shared_experts * a.expert_hidden
    latent = D * a.latent_dim + a.latent_dim + a.latent_dim * D
    return a.n_experts * D + latent + routed_expert_params(a) + shared


def layer_params(a: K3Args, layer: int) -> int:
    attn = mla_params(a) if a.is_mla(layer) else kda_params(a)
    norms_and_queries = 4 * a.dim                        # two pre-norms, two attention-residual queries
    return attn + ffn_params(a, layer) + norms_and_queries


@dataclass(frozen=True)
class ParamCount:
    total: int
    embedding: int
    inactive_experts: int

    @property
    def active(self) -> int:
        """Published convention: total - input embedding - inactive routed experts (head counts)."""
        return self.total - self.embedding - self.inactive_experts


def count_params(a: K3Args) -> ParamCount:
    embedding = a.vocab_size * a.dim
    head = a.vocab_size * a.dim
    total = embedding + head + 2 * a.dim + sum(layer_params(a, i) for i in range(a.n_layers))
    n_moe = sum(a.is_moe(i) for i in range(a.n_layers))
    inactive = n_moe * routed_expert_params(a) * (a.n_experts - a.top_k) // a.n_experts
    return ParamCount(total=total, embedding=embedding, inactive_experts=inactive)


def flops_per_token(a: K3Args, seq_len: int) -> float:
    """Training FLOPs (forward + backward) per token; MFU divides tokens/s x this by the peak.

    Terms (a multiply-add is 2 FLOPs; backward costs twice the forward, so x3):
    - 6 * N_active: every matmul weight a token passes through (all layers'
      projections, the k routed + shared experts, the router, the head; the
      input embedding is a lookup and inactive experts are skipped).
    - MLA, per layer and head: scores q.k (2 * (nope + rope)) and value mixing
      (2 * v) against the (T+1)/2 keys a causal query sees on average.
    - KDA, per layer, head and token (chunk C, key width K, value width V):
      the inter-chunk state read, WY correction and state update (3 x 2KV);
      the intra-chunk decayed scores, WY matrices and value mixing
      (2C(2K + 2V)); the unit-triangular C x C solve (2C^2/3).
    tests/unit/test_metrics_units.py checks the total against
    torch.utils.flop_counter on the debug flavor (within 5%).
    """
    dense_flops = 6 * count_params(a).active
    ctx = (seq_len + 1) / 2
    n_mla = len(a.mla_layers)
    qk = a.qk_nope_dim + a.qk_rope_dim
    mla = n_mla * 3 * 2 * a.mla_heads * (qk + a.v_head_dim) * ctx
    K = V = a.kda_head_dim
    C = min(KDA_CHUNK, seq_len)
    kda_fwd = 3 * 2 * K * V + 2 * C * (2 * K + 2 * V) + 2 * C * C / 3
    kda = (a.n_layers - n_mla) * 3 * a.kda_heads * kda_fwd
    return dense_flops + mla + kda
