"""The K3 decoder: embedding, hybrid KDA/MLA blocks with dense or LatentMoE FFNs, and a fused head + loss.

Legend: B batch, T tokens, D width, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kernels.attn_res.sinks import GradientSink
from titan_k3.models.k3.args import K3Args
from titan_k3.models.k3.attn_res import PseudoQueryMix, ResidualBlocks, residual_layer
from titan_k3.models.k3.documents import Documents, OnHost
from titan_k3.models.k3.impl import Impl
from titan_k3.models.k3.kda import KimiDeltaAttention
from titan_k3.models.k3.layers import RMSNorm, SituGluFFN, init_linear
from titan_k3.models.k3.mla import FLEX, GatedMLA
from titan_k3.models.k3.moe import LatentMoE


class K3Block(nn.Module):
    """One layer: two pre-norm sublayers (attention, FFN), each fed by a pseudo-query mix."""

    def __init__(self, args: K3Args, layer: int, impl: Impl, qb_eta: float):
        super().__init__()
        self.layer = layer
        self.is_mla, self.is_moe = args.is_mla(layer), args.is_moe(layer)
        self.attn_mix = PseudoQueryMix(args.dim, impl.attn_res, args.norm_eps)
        self.attn_norm = RMSNorm(args.dim, args.norm_eps)
        self.attn = (GatedMLA(args, impl.sdpa_backends, impl.max_logit) if self.is_mla
                     else KimiDeltaAttention(args, impl.kda, impl.conv))
        self.ffn_mix = PseudoQueryMix(args.dim, impl.attn_res, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn = (LatentMoE(args, impl.experts, qb_eta, impl.router, impl.expert_shadows, impl.router_scores)
                    if self.is_moe else SituGluFFN(args.dim, args.dense_hidden))
        self.norm_in_mix = impl.attn_res_norm
        """The mixes apply attn_norm and ffn_norm (kernels.attn_res_norm_in_mix); the sublayers then skip them."""

    def forward(self, sources: list[torch.Tensor], partial: torch.Tensor | None, docs: Documents,
                sinks: list[GradientSink] | None = None) -> torch.Tensor:
        """sources: completed blocks [B, T, D] each; partial: the open block's sum so far (None: it opens here);
        sinks: the completed blocks' gradient sinks (ResidualBlocks.sinks), or None.

        Returns the open block's sum after this layer, partial + attention output + FFN output [B, T, D]
        (`attn_res.residual_layer`).
        """
        norms = (self.attn_norm, self.ffn_norm) if self.norm_in_mix else (None, None)
        return residual_layer(sources, partial, sinks, self.attn_mix, lambda x: self.attn_sublayer(x, docs),
                              self.ffn_mix, self.ffn_sublayer, *norms)

    # NOTE: the sublayers, not the block, are the units `torch.compile` sees: a
    # block's mixes read a number of residual sources that differs from layer to
    # layer, while every KDA (or MLA, dense, MoE) sublayer is the same graph, so
    # inductor compiles each kind once and the other layers hit its cache.
    def attn_sublayer(self, x_BTD: torch.Tensor, docs: Documents) -> torch.Tensor:
        return self.attn(x_BTD if self.norm_in_mix else self.attn_norm(x_BTD), docs)

    def ffn_sublayer(self, x_BTD: torch.Tensor) -> torch.Tensor:
        return self.ffn(x_BTD if self.norm_in_mix else self.ffn_norm(x_BTD))


@dataclass
class LossOutput:
    loss_sum: torch.Tensor
    """float32 scalar: summed cross-entropy over valid targets."""
    n_valid: torch.Tensor
    """int64 scalar: number of valid targets."""


class K3Model(nn.Module):
    def __init__(self, args: K3Args, impl: Impl, qb_eta: float = 1.0):
        super().__init__()
        self.args, self.impl = args, impl
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        # NOTE: a ModuleDict keyed by layer index keeps parameter names stable
        # when parallelize wraps or replaces blocks (TorchTitan's convention).
        self.layers = nn.ModuleDict({str(i): K3Block(args, i, impl, qb_eta) for i in range(args.n_layers)})
        self.final_mix = PseudoQueryMix(args.dim, impl.attn_res, args.norm_eps)
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.compute_dtype: torch.dtype | None = None
        """bf16 training's compute dtype (None: as the parameters are) for what autocast leaves alone: the
        embedding, block 0 of the residual stream, and the fused head + loss inputs."""

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        if seed is not None:
            torch.manual_seed(seed)
        nn.init.normal_(self.tok_embeddings.weight, std=1.0)
        for module in self.modules():
            if module is not self and hasattr(module, "reset_parameters") and not isinstance(module, (nn.Linear, nn.Embedding)):
                module.reset_parameters()
        for block in self.layers.values():
            if not block.is_moe:
                for lin in (block.ffn.w1, block.ffn.w3, block.ffn.w2):
                    init_linear(lin)
        init_linear(self.output, std=self.args.dim**-0.5)

    def hidden(self, input_ids_BT: torch.Tensor, cu_seqlens: torch.Tensor | OnHost | None = None) -> torch.Tensor:
        """Final normalised hidden states [B, T, D]. cu_seqlens: see Documents.build (on the host, through OnHost)."""
        B, T = input_ids_BT.shape
        docs = Documents.build(B, T, cu_seqlens, input_ids_BT.device)
        if FLEX in (self.impl.sdpa_backends or []):
            docs.block_mask()  # here, eagerly: the compiled MLA sublayers then take it as an input
        embedding = self.tok_embeddings(input_ids_BT)
        if self.compute_dtype is not None:
            # NOTE: as FSDP2's mixed precision hands it over. A float32 block 0 made every mix read and write float32
            # (a mix's output takes its first source's dtype) and its gradient add up in float32 over every mix.
            embedding = embedding.to(self.compute_dtype)
        stream = ResidualBlocks(embedding, self.args.attn_res_block_size, self.impl.attn_res_sinks)
        for i, block in enumerate(self.layers.values()):
            stream.partial = block(stream.completed, stream.partial, docs, stream.sinks)
            stream.end_layer(i)
        if self.impl.attn_res_norm:
            return self.final_mix(stream.sources(), stream.sinks, norm=self.norm)
        return self.norm(self.final_mix(stream.sources(), stream.sinks))

    def forward(
        self, input_ids_BT: torch.Tensor, labels_BT: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | OnHost | None = None,
    ) -> LossOutput | torch.Tensor:
        """With labels: the summed loss and valid count (never full float32 logits); without: logits [B, T, V]."""
        h_BTD = self.hidden(input_ids_BT, cu_seqlens)
        if labels_BT is None:
            return self.output(h_BTD)
        h_ND, w_VD = h_BTD.flatten(0, 1), self.output.weight
        if self.compute_dtype is not None:
            # NOTE: the weight goes in as it is: the loss runs its products in h's dtype and hands a float32
            # weight its gradient in float32 (a cast here cost two passes over [V, D] and a bf16 rounding).
            h_ND = h_ND.to(self.compute_dtype)
        loss_sum, n_valid = self.impl.loss(h_ND, w_VD, labels_BT.flatten())
        return LossOutput(loss_sum, n_valid)

    def moe_routers(self) -> dict[int, nn.Module]:
        return {int(i): b.ffn.router for i, b in self.layers.items() if b.is_moe}

    def mla_layers(self) -> dict[int, GatedMLA]:
        return {int(i): b.attn for i, b in self.layers.items() if b.is_mla}

    def optim_hints(self) -> dict[str, dict]:
        """Per parameter name: how the optimizer should treat it (docs/k3.md §6), as plain dicts.

        Keys: use_muon, num_heads (row blocks orthogonalised on their own),
        per_expert (3-D expert weights: one matrix per expert), weight_decay,
        replicated (whole on every data-parallel rank: the routers).
        """
        a = self.args
        hints: dict[str, dict] = {}
        for name, p in self.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            adam = dict(use_muon=False, num_heads=1, per_expert=False, weight_decay=True)
            if ".router." in name:
                hints[name] = dict(adam, replicated=True)
            elif name.startswith(("tok_embeddings", "output")) or leaf.endswith("_conv"):
                hints[name] = adam
            elif leaf in ("A_log", "dt_bias", "o_norm", "query") or "norm" in name.rsplit(".", 2)[-2] or p.ndim == 1:
                hints[name] = dict(adam, weight_decay=False)
            elif p.ndim == 3:
                hints[name] = dict(use_muon=True, num_heads=1, per_expert=True, weight_decay=True)
            elif any(name.endswith(f".attn.{n}.weight") for n in ("q_proj", "k_proj", "v_proj")):
                hints[name] = dict(use_muon=True, num_heads=a.kda_heads, per_expert=False, weight_decay=True)
            elif any(name.endswith(f".attn.{n}.weight") for n in ("wq_b", "wkv_b")):
                hints[name] = dict(use_muon=True, num_heads=a.mla_heads, per_expert=False, weight_decay=True)
            else:
                hints[name] = dict(use_muon=True, num_heads=1, per_expert=False, weight_decay=True)
        return hints
