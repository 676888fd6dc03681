"""The published K3 checkpoint layout (Hugging Face style) and its mapping to titan_k3's names.

An export directory holds `config.json` (HF keys a Kimi release uses) and the
weights as safetensors shards `model-0000i-of-0000n.safetensors` with
`model.safetensors.index.json` ({"metadata": {"total_size"}, "weight_map"}).
Weights are written in bf16 (or float32 on request) except the Quantile
Balancing bias, kept in float32 like the routing-bias of the releases this
layout follows (a bf16 bias would move the expert choice of near-ties).

Shape legend: E routed experts, L latent width, F expert hidden width.
"""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch

from titan_k3.models.k3.args import K3Args

# ---------------------------------------------------------------------------
# The one mapping table. {i}: layer index, {e}: expert index. "experts" rows split
# one [E, in, out] stack (x @ w[e]) into E nn.Linear weights [out, in] = w[e].T.
# "kda" / "mla" rows apply to that attention kind only: both kinds have an o_proj and a
# g_proj, so the import reads the kind of layer i from config.json.
#
#   titan_k3 name                  published name                                    note
NAME_MAP: list[tuple[str, str, str]] = [
    ("tok_embeddings.weight",         "model.embed_tokens.weight",                       ""),
    ("norm.weight",                   "model.norm.weight",                               ""),
    ("final_mix.query",               "model.final_attn_res.query",                      ""),
    ("output.weight",                 "lm_head.weight",                                  ""),
    ("layers.{i}.attn_norm.weight",   "model.layers.{i}.input_layernorm.weight",         ""),
    ("layers.{i}.ffn_norm.weight",    "model.layers.{i}.post_attention_layernorm.weight", ""),
    ("layers.{i}.attn_mix.query",     "model.layers.{i}.attn_res.query",                 ""),
    ("layers.{i}.ffn_mix.query",      "model.layers.{i}.mlp_res.query",                  ""),
    # Kimi Delta Attention layers
    ("layers.{i}.attn.q_proj.weight", "model.layers.{i}.self_attn.q_proj.weight",        "kda"),
    ("layers.{i}.attn.k_proj.weight", "model.layers.{i}.self_attn.k_proj.weight",        "kda"),
    ("layers.{i}.attn.v_proj.weight", "model.layers.{i}.self_attn.v_proj.weight",        "kda"),
    ("layers.{i}.attn.q_conv",        "model.layers.{i}.self_attn.q_conv1d.weight",      "kda"),
    ("layers.{i}.attn.k_conv",        "model.layers.{i}.self_attn.k_conv1d.weight",      "kda"),
    ("layers.{i}.attn.v_conv",        "model.layers.{i}.self_attn.v_conv1d.weight",      "kda"),
    ("layers.{i}.attn.A_log",         "model.layers.{i}.self_attn.A_log",                "kda"),
    ("layers.{i}.attn.dt_bias",       "model.layers.{i}.self_attn.dt_bias",              "kda"),
    ("layers.{i}.attn.f_a.weight",    "model.layers.{i}.self_attn.f_a_proj.weight",      "kda"),
    ("layers.{i}.attn.f_b.weight",    "model.layers.{i}.self_attn.f_b_proj.weight",      "kda"),
    ("layers.{i}.attn.b_proj.weight", "model.layers.{i}.self_attn.b_proj.weight",        "kda"),
    ("layers.{i}.attn.g_proj.weight", "model.layers.{i}.self_attn.g_proj.weight",        "kda"),
    ("layers.{i}.attn.o_norm",        "model.layers.{i}.self_attn.o_norm.weight",        "kda"),
    ("layers.{i}.attn.o_proj.weight", "model.layers.{i}.self_attn.o_proj.weight",        "kda"),
    # gated NoPE MLA layers
    ("layers.{i}.attn.wq_a.weight",   "model.layers.{i}.self_attn.q_a_proj.weight",      "mla"),
    ("layers.{i}.attn.q_norm.weight", "model.layers.{i}.self_attn.q_a_layernorm.weight", "mla"),
    ("layers.{i}.attn.wq_b.weight",   "model.layers.{i}.self_attn.q_b_proj.weight",      "mla"),
    ("layers.{i}.attn.wkv_a.weight",  "model.layers.{i}.self_attn.kv_a_proj_with_mqa.weight", "mla"),
    ("layers.{i}.attn.kv_norm.weight", "model.layers.{i}.self_attn.kv_a_layernorm.weight", "mla"),
    ("layers.{i}.attn.wkv_b.weight",  "model.layers.{i}.self_attn.kv_b_proj.weight",     "mla"),
    ("layers.{i}.attn.w_gate.weight", "model.layers.{i}.self_attn.g_proj.weight",        "mla"),
    ("layers.{i}.attn.wo.weight",     "model.layers.{i}.self_attn.o_proj.weight",        "mla"),
    # dense FFN layers (the first first_k_dense_replace)
    ("layers.{i}.ffn.w1.weight",      "model.layers.{i}.mlp.gate_proj.weight",           ""),
    ("layers.{i}.ffn.w3.weight",      "model.layers.{i}.mlp.up_proj.weight",             ""),
    ("layers.{i}.ffn.w2.weight",      "model.layers.{i}.mlp.down_proj.weight",           ""),
    # LatentMoE layers
    ("layers.{i}.ffn.router.weight",  "model.layers.{i}.mlp.gate.weight",                ""),
    ("layers.{i}.ffn.router.qb_bias", "model.layers.{i}.mlp.gate.e_score_correction_bias", "float32"),
    ("layers.{i}.ffn.w_down.weight",  "model.layers.{i}.mlp.latent_down_proj.weight",    ""),
    ("layers.{i}.ffn.latent_norm.weight", "model.layers.{i}.mlp.latent_norm.weight",     ""),
    ("layers.{i}.ffn.w_up.weight",    "model.layers.{i}.mlp.latent_up_proj.weight",      ""),
    ("layers.{i}.ffn.w1",             "model.layers.{i}.mlp.experts.{e}.gate_proj.weight", "experts"),  # [E,L,F]
    ("layers.{i}.ffn.w3",             "model.layers.{i}.mlp.experts.{e}.up_proj.weight",   "experts"),  # [E,L,F]
    ("layers.{i}.ffn.w2",             "model.layers.{i}.mlp.experts.{e}.down_proj.weight", "experts"),  # [E,F,L]
    ("layers.{i}.ffn.shared.w1.weight", "model.layers.{i}.mlp.shared_experts.gate_proj.weight", ""),
    ("layers.{i}.ffn.shared.w3.weight", "model.layers.{i}.mlp.shared_experts.up_proj.weight",   ""),
    ("layers.{i}.ffn.shared.w2.weight", "model.layers.{i}.mlp.shared_experts.down_proj.weight", ""),
]


def _regex(template: str) -> re.Pattern:
    return re.compile("^" + re.escape(template).replace(r"\{i\}", r"(?P<i>\d+)").replace(r"\{e\}", r"(?P<e>\d+)") + "$")


_OURS = [(_regex(ours), hf, note) for ours, hf, note in NAME_MAP]
_THEIRS = [(_regex(hf), ours, note) for ours, hf, note in NAME_MAP]


def to_hf(name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor, str]]:
    """titan_k3 (name, tensor) -> [(published name, tensor, note)]; ValueError for an unmapped name."""
    for pattern, hf, note in _OURS:
        m = pattern.match(name)
        if m is None:
            continue
        hf = hf.replace("{i}", m.groupdict().get("i") or "")
        if note == "experts":
            return [(hf.replace("{e}", str(e)), tensor[e].t().contiguous(), note) for e in range(tensor.shape[0])]
        return [(hf, tensor, note)]
    raise ValueError(f"no published name for parameter {name!r}: add it to NAME_MAP in {__file__}")


def from_hf(weights: dict[str, torch.Tensor], mla_layers: set[int]) -> dict[str, torch.Tensor]:
    """Published names -> titan_k3 state dict (expert matrices stacked back to [E, in, out]).

    `mla_layers`: 0-based indices of the MLA layers (the others are KDA).
    """
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, torch.Tensor]] = {}
    for name, tensor in weights.items():
        for pattern, ours, note in _THEIRS:
            m = pattern.match(name)
            if m is None:
                continue
            layer = m.groupdict().get("i")
            if note in ("kda", "mla") and (int(layer) in mla_layers) != (note == "mla"):
                continue
            ours = ours.replace("{i}", layer or "")
            if note == "experts":
                experts.setdefault(ours, {})[int(m.group("e"))] = tensor.t()
            else:
                out[ours] = tensor
            break
        else:
            raise ValueError(f"unknown tensor {name!r} in the export: no titan_k3 name maps to it")
    for ours, by_index in experts.items():
        if sorted(by_index) != list(range(len(by_index))):
            raise ValueError(f"{ours}: experts {sorted(by_index)} are not 0..{len(by_index) - 1}")
        out[ours] = torch.stack([by_index[e] for e in range(len(by_index))]).contiguous()
    return out


# ---------------------------------------------------------------------------
# config.json


def hf_config(args: K3Args, *, dtype: str = "bfloat16", qb_eta: float | None = None) -> dict[str, Any]:
    """config.json for a K3 export. Layer lists in linear_attn_config are 1-based, as Kimi releases write them."""
    mla = set(args.mla_layers)
    config = {
        "architectures": ["KimiK3ForCausalLM"],
        "model_type": "kimi_k3",
        "torch_dtype": dtype,
        "vocab_size": args.vocab_size,
        "hidden_size": args.dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.mla_heads,
        "num_key_value_heads": args.mla_heads,
        "intermediate_size": args.dense_hidden,
        "rms_norm_eps": args.norm_eps,
        "tie_word_embeddings": False,
        "q_lora_rank": args.q_lora_rank,
        "kv_lora_rank": args.kv_lora_rank,
        "qk_nope_head_dim": args.qk_nope_dim,
        "qk_rope_head_dim": args.qk_rope_dim,
        "v_head_dim": args.v_head_dim,
        "mla_use_nope": True,
        "n_routed_experts": args.n_experts,
        "num_experts_per_tok": args.top_k,
        "moe_intermediate_size": args.expert_hidden,
        "moe_latent_size": args.latent_dim,
        "n_shared_experts": args.n_shared_experts,
        "first_k_dense_replace": args.n_dense_layers,
        "moe_router_bias_update": "quantile_balancing",
        "linear_attn_config": {
            "kda_layers": [i + 1 for i in range(args.n_layers) if i not in mla],
            "full_attn_layers": [i + 1 for i in sorted(mla)],
            "num_heads": args.kda_heads,
            "head_dim": args.kda_head_dim,
            "short_conv_kernel_size": args.kda_conv_size,
            "gate_lower_bound": args.kda_gate_lower_bound,
        },
        "attn_res_block_size": args.attn_res_block_size,
    }
    if qb_eta is not None:
        config["qb_eta"] = qb_eta
    return config


def args_from_hf_config(config: dict[str, Any]) -> K3Args:
    """The K3Args a config.json describes (the inverse of hf_config)."""
    if config.get("model_type") != "kimi_k3":
        raise ValueError(f"config.json model_type {config.get('model_type')!r}: expected 'kimi_k3'")
    lin = config["linear_attn_config"]
    full = tuple(i - 1 for i in lin["full_attn_layers"])
    args = K3Args(
        dim=config["hidden_size"], n_layers=config["num_hidden_layers"], vocab_size=config["vocab_size"],
        kda_heads=lin["num_heads"], kda_head_dim=lin["head_dim"], kda_conv_size=lin["short_conv_kernel_size"],
        kda_gate_lower_bound=lin["gate_lower_bound"], mla_heads=config["num_attention_heads"],
        q_lora_rank=config["q_lora_rank"], kv_lora_rank=config["kv_lora_rank"],
        qk_nope_dim=config["qk_nope_head_dim"], qk_rope_dim=config["qk_rope_head_dim"],
        v_head_dim=config["v_head_dim"], dense_hidden=config["intermediate_size"],
        n_dense_layers=config["first_k_dense_replace"], n_experts=config["n_routed_experts"],
        top_k=config["num_experts_per_tok"], latent_dim=config["moe_latent_size"],
        expert_hidden=config["moe_intermediate_size"], n_shared_experts=config["n_shared_experts"],
        attn_res_block_size=config["attn_res_block_size"], norm_eps=config["rms_norm_eps"],
    )
    # NOTE: keep the default placement as None, so args compare equal to the flavor they came from.
    return args if args.mla_layers == full else args.replace(full_attention_layers=full)


def args_from_dict(d: dict[str, Any]) -> K3Args:
    """K3Args from asdict() output (as meta.json stores it)."""
    known = {f.name for f in fields(K3Args)}
    kw = {k: v for k, v in d.items() if k in known}
    if kw.get("full_attention_layers") is not None:
        kw["full_attention_layers"] = tuple(kw["full_attention_layers"])
    return K3Args(**kw)


# ---------------------------------------------------------------------------
# Reading a DCP checkpoint without a model or a process group


def read_dcp_tensors(path: Path, prefix: str = "", keys: list[str] | None = None) -> dict[str, torch.Tensor]:
    """{DCP key: full tensor} for the tensors of checkpoint dir `path` whose key starts with `prefix`.

    Only the requested tensors are read (`keys` narrows further), so an export can go shard by shard.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    wanted = keys if keys is not None else [k for k in meta if k.startswith(prefix)]
    state = {}
    for k in wanted:
        m = meta[k]
        if isinstance(m, TensorStorageMetadata):
            state[k] = torch.empty(m.size, dtype=m.properties.dtype)
    dcp.load(state, checkpoint_id=str(path), no_dist=True)
    return state


def dcp_tensor_sizes(path: Path, prefix: str = "model.") -> dict[str, tuple[torch.Size, torch.dtype]]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    return {k: (m.size, m.properties.dtype) for k, m in meta.items()
            if k.startswith(prefix) and isinstance(m, TensorStorageMetadata)}

