"""Which implementation runs each fast path, chosen once at start-up and reported.

Every choice is recorded as a `KernelChoice`; a choice that is not the fast
path the user asked for (or that 'auto' prefers on this device) is a
fallback, which the trainer reports loudly and `--job.strict` turns into an
error. Nothing here falls back later, at run time.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

from kernels.attn_res.mix import MAX_SOURCES
from kernels.attn_res.reference import pseudo_query_mix_reference
from kernels.device import triton_runs_on
from kernels.fused_ce import reference as ce_reference
from kernels.grouped_gemm import reference as gg_reference
from kernels.kda import reference as kda_reference
from kernels.kda.ops import FLOAT32_MAX_WIDTH as KDA_FLOAT32_MAX_WIDTH
from kernels.max_logit.kernel import MAX_WIDTH
from kernels.max_logit.reference import max_logit_per_head_reference
from kernels.router.ops import MAX_EXPERTS, router_scores as triton_router_scores
from kernels.router.reference import top_k_rows_reference
from kernels.short_conv.reference import causal_conv_silu_reference
from titan_k3.models.k3.mla import FLEX, VARLEN
from titan_k3.models.k3.moe import router_logits


@dataclass
class KernelChoice:
    op: str
    requested: str
    chosen: str
    fallback: bool
    reason: str = ""

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class Impl:
    kda: Callable
    experts: Callable
    loss: Callable
    sdpa_backends: list | None
    """MLA's attention: SDPBackend values in order of preference, mla.FLEX for flex_attention and mla.VARLEN for
    flash attention's variable-length kernel (GatedMLA._attend)."""
    attn_res: Callable = pseudo_query_mix_reference
    """Block Attention Residuals' pseudo-query mix(sources, query, eps)."""
    attn_res_sinks: bool = False
    """The residual stream's gradients are summed inside the mixes' backward kernels (kernels.attn_res_grad_in_place):
    the model hands the mixes gradient sinks and handoffs (models/k3/attn_res.py), which only the Triton mix takes."""
    attn_res_norm: bool = False
    """Each mix also applies the RMSNorm of the sublayer (or the final norm) it feeds (kernels.attn_res_norm_in_mix):
    the model hands the mixes their norms (models/k3/model.py), and the sublayers take normalised inputs."""
    router: Callable = top_k_rows_reference
    """The MoE routers' selection top_k_rows(x [T, E], k) -> (values, ids) [T, k] (moe.QuantileBalancedRouter)."""
    router_scores: Callable = router_logits
    """The MoE routers' float32 scores (x [T, D], w [E, D]) -> [T, E], chosen with the selection (kernels.router)."""
    max_logit: Callable = max_logit_per_head_reference
    """QK-Clip's per-head max logit of MLA's masked attention (q, k, scale, pos) -> [H]."""
    conv: Callable = causal_conv_silu_reference
    """KDA's short convolution + SiLU (x [B, T, C], w [C, 1, W], pos [B, T]) -> [B, T, C]."""
    expert_shadows: torch.dtype | None = None
    """The routed experts read copies of their float32 masters in this dtype, kept by the optimizer
    (kernels.expert_weight_shadows: models/k3/expert_shadows.py), in place of casting them each forward; None: cast."""
    choices: list[KernelChoice] = field(default_factory=list)

    @property
    def fallbacks(self) -> list[KernelChoice]:
        return [c for c in self.choices if c.fallback]


def reference_impl() -> Impl:
    """Pure-PyTorch paths everywhere (tests, CPU)."""
    return Impl(
        kda=reads_own_layout(kda_reference.chunk_kda_reference),
        experts=gg_reference.moe_experts,
        loss=ce_reference.linear_cross_entropy,
        sdpa_backends=None,
        attn_res=pseudo_query_mix_reference,
        choices=[
            KernelChoice("kda", "torch", "torch", False),
            KernelChoice("experts", "torch", "torch", False),
            KernelChoice("loss", "torch", "torch", False),
            KernelChoice("attn_res", "torch", "torch", False),
            KernelChoice("router", "torch", "torch", False),
            KernelChoice("max_logit", "torch", "torch", False),
            KernelChoice("conv", "torch", "torch", False),
            KernelChoice("attention", "math", "sdpa-default", False),
        ],
    )


def _triton_fn(module: str, name: str) -> tuple[Callable | None, str]:
    try:
        fn = getattr(importlib.import_module(module), name, None)
    except Exception as e:  # an import error is a reason to report, not to crash here
        return None, f"{module} failed to import: {type(e).__name__}: {e}"
    if fn is None:
        return None, f"{module}.{name} is not built yet"
    return fn, ""


def _pick(op: str, requested: str, on_cuda: bool, fast: tuple[str, str, str],
          reference: Callable) -> tuple[Callable, KernelChoice]:
    """requested in (auto, triton, torch): the Triton function or the reference, with the reason (`auto` takes the
    Triton kernel where it can run)."""
    if requested == "torch":
        return reference, KernelChoice(op, requested, "torch", False, "asked for")
    fn, why = _triton_fn(fast[0], fast[1])
    if requested == "auto" and not on_cuda:
        return reference, KernelChoice(op, requested, "torch", True, "no CUDA device: the Triton kernel needs a GPU")
    if not on_cuda and not triton_runs_on("cpu"):
        # NOTE: refuse now rather than fail at the first forward, after the run directory exists.
        raise ValueError(f"config key 'kernels.{op}' = '{requested}': the Triton kernel needs a CUDA device "
                         "(or TRITON_INTERPRET=1 for Triton's CPU interpreter)")
    if fn is None:
        return reference, KernelChoice(op, requested, "torch", True, why)
    return fn, KernelChoice(op, requested, fast[2], False)


def reads_own_layout(kda: Callable) -> Callable:
    """A KDA path that finds the documents in cu_seqlens itself, called like ours: the model's `chunk_layout` (the
    chunk table our Triton kernels take, Documents.kda_chunks) is not an input of it."""

    @functools.wraps(kda)
    def call(*args, chunk_layout=None, **kwargs):
        return kda(*args, **kwargs)

    return call


def fla_chunk_kda(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
                  chunk_layout=None, A_log=None, dt_bias=None, gate_lower_bound=-5.0, use_qk_l2norm=False,
                  beta_is_logit=False):
    """flash-linear-attention's chunk_kda behind our chunk_kda signature (its in-kernel gate and L2 norm).

    chunk_layout (our kernels' chunk table) is not read: fla builds its own from cu_seqlens.
    """
    from fla.ops.kda import chunk_kda

    if cu_seqlens is not None:
        cu_seqlens = cu_seqlens.to(q.device)  # fla reads document boundaries from the device

    if beta_is_logit:
        beta = torch.sigmoid(beta.float()).to(q.dtype)
    gate = {}
    if A_log is not None:
        gate = dict(A_log=A_log.float(), dt_bias=dt_bias.float().reshape(-1), use_gate_in_kernel=True,
                    safe_gate=gate_lower_bound is not None, lower_bound=gate_lower_bound)
    return chunk_kda(q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                     use_qk_l2norm_in_kernel=use_qk_l2norm, cu_seqlens=cu_seqlens, **gate)


def resolve_impl(kernels_cfg, device: torch.device, max_mix_sources: int | None = None, *,
                 router_experts: int | None = None, qk_width: int | None = None,
                 attention_width: int | None = None, kda_width: int | None = None,
                 compute_dtype: torch.dtype = torch.float32) -> Impl:
    """Turn the [kernels] config section into callables, recording each choice.

    The model's shapes are checked here against the Triton kernels' limits, before any work (None: left to the
    kernel's own check at its first call): max_mix_sources, the most sources a residual mix reads
    (`K3Args.max_mix_sources`); router_experts, the experts a router ranks (None without MoE layers); qk_width,
    the query-key width of MLA's heads (None without MLA layers); attention_width, the one width flash attention
    takes MLA's q, k and v at (max of the query-key and value widths); kda_width, the width of KDA's heads (None
    without KDA layers), in compute_dtype, the dtype the layers compute in on a GPU (training.compute_dtype: bf16
    autocast, FSDP2's parameter dtype). A kernel asked for ('triton', or flash attention) that cannot serve them is
    refused; 'auto' falls back to the reference (SDPA's others), reported.
    """
    on_cuda = device.type == "cuda"
    if kernels_cfg.kda == "fla":
        if not on_cuda and not triton_runs_on("cpu"):
            raise ValueError("config key 'kernels.kda' = 'fla': flash-linear-attention's Triton kernels need a CUDA "
                             "device (or TRITON_INTERPRET=1 for Triton's CPU interpreter)")
        try:
            import fla.ops.kda  # noqa: F401
        except ImportError as e:
            raise ValueError(f"config key 'kernels.kda' = 'fla': flash-linear-attention is not importable ({e})") from None
        kda, c_kda = fla_chunk_kda, KernelChoice("kda", "fla", "fla", False)
    else:
        kda_ref = reads_own_layout(kda_reference.chunk_kda_reference)
        kda, c_kda = _pick("kda", kernels_cfg.kda, on_cuda, ("kernels.kda", "chunk_kda", "triton"), kda_ref)
        # NOTE: on a GPU only: Triton's CPU interpreter has no shared memory to exceed.
        if on_cuda and kda_width is not None and compute_dtype == torch.float32 and kda_width > KDA_FLOAT32_MAX_WIDTH:
            kda, c_kda = _unserved(kda, c_kda, kda_ref,
                                   f"the model's KDA heads are {kda_width} wide and training.compute_dtype = "
                                   f"'float32'; the Triton kernel takes float32 heads up to {KDA_FLOAT32_MAX_WIDTH} "
                                   "wide on a GPU: set training.compute_dtype = 'bfloat16' to run it, or kernels.kda = "
                                   "'torch'")
    loss, c_loss = _pick("loss", kernels_cfg.loss, on_cuda, ("kernels.fused_ce", "linear_cross_entropy", "triton"), ce_reference.linear_cross_entropy)
    if kernels_cfg.loss_chunk_rows:
        loss = functools.partial(loss, chunk_rows=kernels_cfg.loss_chunk_rows)
    c_grads = KernelChoice("loss_grads", "bf16", "bf16" if c_loss.chosen == "triton" else "torch", False)
    if kernels_cfg.loss_grad_fp8:
        loss, c_grads = _fp8_loss_grads(loss, c_loss, device), KernelChoice("loss_grads", "fp8", "fp8", False)
    c_rows = _lever("kernels.loss_one_pass", kernels_cfg.loss_one_pass, c_loss, "the fused Triton loss",
                    KernelChoice("loss_rows", "one_pass", "one_pass", False), "two_pass")
    if c_rows.chosen == "one_pass":
        loss = functools.partial(loss, one_pass=True)
    if c_loss.chosen == "triton":
        # NOTE: the trainer checks token ids on the host before they reach the GPU, so the
        # kernel's own range check (a device sync per micro-batch) is skipped; a bad id
        # that got past it would still show as a NaN loss, never as a wrong number.
        loss = functools.partial(loss, check_targets=False)
    if kernels_cfg.experts == "grouped_mm":
        if not on_cuda:
            raise ValueError("config key 'kernels.experts' = 'grouped_mm': torch._grouped_mm needs a CUDA device")
        from kernels.grouped_gemm.torch_grouped_mm import moe_experts_torch_grouped_mm

        experts, c_exp = moe_experts_torch_grouped_mm, KernelChoice("experts", "grouped_mm", "grouped_mm", False)
    else:
        experts, c_exp = _pick(
            "experts", kernels_cfg.experts, on_cuda, ("kernels.grouped_gemm", "moe_experts", "triton"), gg_reference.moe_experts
        )
    c_weights = _lever("kernels.experts_cast_in_kernel", kernels_cfg.experts_cast_in_kernel, c_exp, "our Triton experts",
                       KernelChoice("expert_weights", "cast_in_kernel", "cast_in_kernel", False), "cast_pass")
    if c_weights.chosen == "cast_in_kernel":
        experts = functools.partial(experts, cast_in_kernel=True)
    if kernels_cfg.expert_weight_shadows:
        c_weights = _lever("kernels.expert_weight_shadows", True, c_exp, "our Triton experts",
                           KernelChoice("expert_weights", "shadows", "shadows", False), "cast_pass")
    shadows = compute_dtype if c_weights.chosen == "shadows" and compute_dtype != torch.float32 else None
    # NOTE: under compile too: in the compiled k3-mini step the Triton mix measured 223.0 ms against 236.1 ms for
    # inductor's fusion of the reference (benchmarks/results/train_throughput.md), although the reference
    # compiled on its own beat the kernel in isolation (benchmarks/results/attn_res.md).
    attn_res, c_res = _pick("attn_res", kernels_cfg.attn_res, on_cuda,
                            ("kernels.attn_res", "pseudo_query_mix", "triton"), pseudo_query_mix_reference)
    if max_mix_sources is not None and max_mix_sources > MAX_SOURCES:
        attn_res, c_res = _unserved(attn_res, c_res, pseudo_query_mix_reference,
                                    f"the model's mixes read up to {max_mix_sources} sources; the Triton mix takes at "
                                    f"most {MAX_SOURCES}")
    c_sums = _lever("kernels.attn_res_grad_in_place", kernels_cfg.attn_res_grad_in_place, c_res, "the Triton mix",
                    KernelChoice("attn_res_grads", "in_place", "in_place", False), "autograd")
    c_norms = _lever("kernels.attn_res_norm_in_mix", kernels_cfg.attn_res_norm_in_mix, c_res, "the Triton mix",
                     KernelChoice("pre_norms", "in_mix", "in_mix", False), "in_sublayer")
    router, c_router = _pick("router", kernels_cfg.router, on_cuda, ("kernels.router", "top_k_rows", "triton"),
                             top_k_rows_reference)
    if router_experts is not None and router_experts > MAX_EXPERTS:
        router, c_router = _unserved(router, c_router, top_k_rows_reference,
                                     f"the model's routers rank {router_experts} experts; the Triton top-k holds rows "
                                     f"of at most {MAX_EXPERTS}")
    # NOTE: the scores' kernel goes with the Triton top-k on a GPU only: in Triton's CPU interpreter bf16 products
    # are wrong, and the scores are bf16 products under autocast.
    router_scores = triton_router_scores if c_router.chosen == "triton" and on_cuda else router_logits
    max_logit, c_max = _pick("max_logit", kernels_cfg.max_logit, on_cuda,
                             ("kernels.max_logit", "max_logit_per_head", "triton"), max_logit_per_head_reference)
    if qk_width is not None and qk_width > MAX_WIDTH:
        max_logit, c_max = _unserved(max_logit, c_max, max_logit_per_head_reference,
                                     f"the model's MLA heads have a query-key width of {qk_width}; the Triton max "
                                     f"logit takes at most {MAX_WIDTH}")
    conv, c_conv = _pick("conv", kernels_cfg.conv, on_cuda, ("kernels.short_conv", "causal_conv_silu", "triton"),
                         causal_conv_silu_reference)
    backends, c_attn = _attention_backends(kernels_cfg.attention, on_cuda, attention_width)
    return Impl(kda, experts, loss, backends, attn_res=attn_res, attn_res_sinks=c_sums.chosen == "in_place",
                attn_res_norm=c_norms.chosen == "in_mix", router=router, router_scores=router_scores,
                max_logit=max_logit, conv=conv, expert_shadows=shadows,
                choices=[c_kda, c_exp, c_weights, c_loss, c_grads, c_rows, c_res, c_sums, c_norms, c_router, c_max,
                         c_conv, c_attn])


def _unserved(fn: Callable, choice: KernelChoice, reference: Callable, why: str) -> tuple[Callable, KernelChoice]:
    """The choice for an op whose Triton kernel cannot serve the model's shape (`why`): refused (ValueError naming
    the config key) where kernels.<op> = 'triton' asked for it, the reference as a reported fallback where 'auto'
    picked it; a choice that is not the Triton kernel stays as it is."""
    if choice.chosen != "triton":
        return fn, choice
    if choice.requested == "triton":
        raise ValueError(f"config key 'kernels.{choice.op}' = 'triton': {why}")
    return reference, KernelChoice(choice.op, choice.requested, "torch", True, why)


def _lever(key: str, asked: bool, choice: KernelChoice, what: str, on: KernelChoice, off: str) -> KernelChoice:
    """The kernel report's line for config key `key`, a lever of our Triton kernel for `choice.op` (`what`).

    Not asked: `off`. Asked, with that kernel running: `on`. Asked where the kernel fell back (kernels.<op> = 'auto'
    on a machine it cannot run on, as a GPU recipe run on a CPU): `off` too, as a fallback of its own that job.strict
    refuses, as the kernel's is. Asked of a kernel the config itself turned away (kernels.<op> = 'torch' or 'fla'):
    a ValueError naming both keys, before any work.
    """
    if not asked:
        return KernelChoice(on.op, off, off, False)
    if choice.chosen != "triton" and choice.fallback:
        return KernelChoice(on.op, on.requested, off, True, f"{key} needs {what}; {choice.op} fell back: {choice.reason}")
    _require_triton(key, choice, what)
    return on


def _require_triton(key: str, choice: KernelChoice, what: str) -> None:
    """A ValueError naming config key `key` (a lever of our Triton kernel for `choice.op`, `what`) unless that op
    runs it."""
    if choice.chosen != "triton":
        why = f": {choice.reason}" if choice.reason and choice.reason != "asked for" else ""
        chosen = "the torch reference" if choice.chosen == "torch" else f"'{choice.chosen}'"
        raise ValueError(f"config key '{key}' = true: needs {what}, but this run's {choice.op} is {chosen} "
                         f"(kernels.{choice.op} = '{choice.requested}'{why})")


def _fp8_loss_grads(loss: Callable, c_loss: KernelChoice, device: torch.device) -> Callable:
    """The fused loss with its gradient products in FP8 (kernels.loss_grad_fp8), or a ValueError naming what is
    missing, before any work: the fused Triton loss, on a GPU with FP8 matmuls."""
    from kernels.fused_ce.grad_fp8 import fp8_supported

    key = "config key 'kernels.loss_grad_fp8' = true"
    _require_triton("kernels.loss_grad_fp8", c_loss, "the fused Triton loss")
    if device.type != "cuda" or not fp8_supported(device):
        capability = f" of capability {torch.cuda.get_device_capability(device)}" if torch.cuda.is_available() else ""
        raise ValueError(f"{key}: needs a CUDA GPU with FP8 matmuls (compute capability 8.9 or newer), got {device}"
                         f"{capability}")
    return functools.partial(loss, fp8_grads=True)


FLASH_MAX_WIDTH = 256
"""The widest head flash attention takes (its variable-length kernel and SDPA's flash backend): a wider one stopped
the first forward."""


def _attention_backends(requested: str, on_cuda: bool, width: int | None = None) -> tuple[list | None, KernelChoice]:
    from torch.nn.attention import SDPBackend

    table = {
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "math": SDPBackend.MATH,
    }
    if on_cuda and width is not None and width > FLASH_MAX_WIDTH:
        why = (f"the model's MLA heads take q, k and v at a width of {width} in flash attention; it takes at most "
               f"{FLASH_MAX_WIDTH}")
        if requested in ("varlen", "flash"):
            raise ValueError(f"config key 'kernels.attention' = {requested!r}: {why}")
        if requested == "auto":
            return [table["cudnn"], table["efficient"]], KernelChoice("attention", "auto", "cudnn", True, why)
    if requested == "flex":
        if not on_cuda:
            # NOTE: torch's flex_attention runs forward on CPU but refuses backward there, so a CPU run could
            # not train; refuse now rather than at the first backward, after the run directory exists.
            raise ValueError("config key 'kernels.attention' = 'flex': flex_attention has no backward on CPU "
                             f"(torch {torch.__version__}); use a CUDA device, or 'auto' / 'math' on CPU")
        return [FLEX], KernelChoice("attention", "flex", "flex", False)
    if requested == "varlen":
        if not on_cuda:
            raise ValueError("config key 'kernels.attention' = 'varlen': flash attention's variable-length kernel "
                             "runs on CUDA only; use 'auto' or 'math' on CPU")
        # Whole-row batches (no packed documents) run causal SDPA on cuDNN, the fastest for these head widths.
        return [VARLEN, table["cudnn"], table["efficient"]], KernelChoice("attention", "varlen", "varlen+cudnn", False)
    if requested == "auto":
        if not on_cuda:
            return None, KernelChoice("attention", "auto", "math", True, "no CUDA device: SDPA runs its math path")
        # NOTE: a list of preferences, each batch taking the first that takes it: packed documents in 16-bit go
        # to flash's variable-length kernel (3.2x the dense-mask cuDNN path in isolation, 7.5 ms less per compiled
        # k3-mini step: attention.md, train_throughput.md); whole rows, and float32, to SDPA (cuDNN first).
        # Not flex: 2.6x the dense mask in isolation but no faster in the compiled step (host-bound: its
        # BlockMask is built on the host every forward) and ~13 s more compilation.
        return [VARLEN, table["cudnn"], table["efficient"]], KernelChoice("attention", "auto", "varlen+cudnn", False)
    if requested != "math" and not on_cuda:
        return [table["math"]], KernelChoice("attention", requested, "math", True, "no CUDA device")
    return [table[requested]], KernelChoice("attention", requested, requested, False)
