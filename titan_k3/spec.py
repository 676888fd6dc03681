"""The registered model families' named shapes and constants, as plain data (torch-free).

Both sides of a wall read this module: `titan_k3.config` checks a job against
it (a flavor name, the experts that expert parallelism must divide, the KDA
chunk that sequence lengths must divide) without importing any model, and
each model family builds its own argument objects from it
(`titan_k3/models/k3/args.py`: `FLAVORS = {name: K3Args(**shape)}`). Adding a
family adds its table here and its folder under `titan_k3/models/`, whose
`ModelSpec` the registry checks against this table (docs/architecture.md §3).

Legend of the K3 fields: docs/k3.md §3.
"""

from __future__ import annotations

from typing import Any

KDA_CHUNK = 64
"""Tokens per chunk of the chunked KDA kernels: sequence lengths must be a multiple of it (docs/k3.md §2.1)."""

K3_FLAVORS: dict[str, dict[str, Any]] = {
    # Unit tests: seconds on a CPU.
    "debug": dict(
        dim=64, n_layers=4, vocab_size=512, kda_heads=2, kda_head_dim=32,
        mla_heads=2, q_lora_rank=32, kv_lora_rank=32, qk_nope_dim=16, qk_rope_dim=8, v_head_dim=16,
        dense_hidden=128, n_experts=8, top_k=2, latent_dim=32, expert_hidden=32,
        n_shared_experts=1, attn_res_block_size=2,
    ),
    # The embedded CPU smoke run (vocab comes from the tokenizer).
    "tiny": dict(
        dim=192, n_layers=6, vocab_size=8192, kda_heads=3, kda_head_dim=64,
        mla_heads=3, q_lora_rank=96, kv_lora_rank=64, qk_nope_dim=32, qk_rope_dim=16, v_head_dim=64,
        dense_hidden=512, n_experts=16, top_k=4, latent_dim=96, expert_hidden=128,
        n_shared_experts=1, attn_res_block_size=2,
    ),
    # The public worklog's 1.02B-total / 145M-active replica.
    "k3-mini": dict(
        dim=512, n_layers=12, vocab_size=163840, kda_heads=4, kda_head_dim=128,
        mla_heads=4, q_lora_rank=128, kv_lora_rank=128, qk_nope_dim=128, qk_rope_dim=64, v_head_dim=128,
        dense_hidden=2560, n_experts=176, top_k=6, latent_dim=256, expert_hidden=544,
        n_shared_experts=1, attn_res_block_size=4,
    ),
    # The full published shape; built on the meta device only (counting, planning, FLOPs).
    # NOTE: MLA heads, the latent and expert widths and the dense hidden are not in the
    # text we follow; these values (MLA heads = KDA heads) reproduce the card's 104.2B
    # active parameters (2.65T total) with the published D, depth, heads, ranks, E and k.
    "k3": dict(
        dim=7168, n_layers=93, vocab_size=163840, kda_heads=96, kda_head_dim=128,
        mla_heads=96, q_lora_rank=1536, kv_lora_rank=512, qk_nope_dim=128, qk_rope_dim=64, v_head_dim=128,
        dense_hidden=18432, n_experts=896, top_k=16, latent_dim=2560, expert_hidden=4096,
        n_shared_experts=2, attn_res_block_size=12,
    ),
}

MODEL_FLAVORS: dict[str, dict[str, dict[str, Any]]] = {"k3": K3_FLAVORS}
"""Model family name (`model.name`) -> its flavors (`model.flavor`) -> the shape's fields."""


def routed_experts(model: str, flavor: str) -> int:
    """Routed experts per MoE layer of a registered flavor (what `parallelism.expert_parallel_degree` must divide)."""
    return MODEL_FLAVORS[model][flavor]["n_experts"]


def experts_per_token(model: str, flavor: str) -> int:
    """Routed experts each token selects (top_k) in a registered flavor."""
    return MODEL_FLAVORS[model][flavor]["top_k"]
