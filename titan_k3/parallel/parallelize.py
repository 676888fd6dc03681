"""parallelize: FP8 -> expert parallelism -> activation checkpointing -> per-sublayer compile -> FSDP2.

Applied to a K3Model on the meta device (or any device), before weights are
initialised. Parameter names never change (no wrapper modules): AC and
compile act on each block in place, EP swaps the experts' callable, so
optimizer hints and checkpoints see the same names with or without them.
Every decision that can differ from what was asked (FP8 per linear shape,
compile) is returned as a KernelChoice for the kernel report.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections import Counter
from pathlib import Path

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from kernels.attn_res import pseudo_query_mix_reference
from titan_k3.config import ConfigError
from titan_k3.eval.runner import training_dtype
from titan_k3.models.k3.impl import KernelChoice
from titan_k3.models.k3.moe import routing_recompute
from titan_k3.parallel.dims import ParallelDims
from titan_k3.parallel.expert_parallel import ExpertParallel


def parallelize(model: nn.Module, dims: ParallelDims, mesh, cfg, device: torch.device) -> list[KernelChoice]:
    """Apply every technique the config asks for, in the order of the module docstring.

    `mesh` is None when the run is a plain single process (no FSDP).
    Returns the kernel-report entries; with job.strict any fallback raises ConfigError before any technique applies.
    """
    choices = precision_fallbacks(cfg, device, sharded=mesh is not None)
    if cfg.float8.enable and device.type == "cuda":
        choices += apply_float8(model, cfg.float8)
    if dims.ep > 1:
        apply_ep(model, mesh["ep"], device, cfg.parallelism.expert_dispatch)
    if cfg.activation_checkpoint.mode != "none":
        apply_ac(model, cfg.activation_checkpoint.mode)
    if cfg.compile.enable:
        if cfg.compile.cache_dir:
            use_compile_cache(cfg.compile.cache_dir)
        apply_compile(model, cfg.compile.backend)
        choices.append(KernelChoice("compile", cfg.compile.backend, cfg.compile.backend, False, "per sublayer"))
    if mesh is not None:
        apply_fsdp(model, dims, mesh, param_dtype=training_dtype(cfg),
                   reshard_after_forward=cfg.parallelism.fsdp_reshard_after_forward,
                   average_gradients=cfg.debug.inject_grad_scale == "fsdp_average")
    return choices


def precision_fallbacks(cfg, device: torch.device, sharded: bool) -> list[KernelChoice]:
    """parallelize's fallbacks, which the config and the device decide without the model (--job.validate_only asks
    too): FP8 and bf16 compute without CUDA; job.strict refuses the first (ConfigError).

    `sharded`: the run has a mesh (torchrun with 2+ processes), whose FSDP2 gives the bf16 parameter dtype.
    """
    choices = []
    if cfg.float8.enable and device.type != "cuda":
        choices.append(KernelChoice("float8", cfg.float8.recipe, "bf16", True,
                                    "no CUDA device: torchao FP8 matmuls need an H100-class GPU"))
    if cfg.training.compute_dtype == "bfloat16" and device.type != "cuda" and not sharded:
        # NOTE: bf16 compute is CUDA autocast or FSDP2's parameter dtype; one process without CUDA has neither.
        choices.append(KernelChoice("compute_dtype", "bfloat16", "float32", True,
                                    "one process without CUDA: no bf16 autocast and no FSDP parameter dtype"))
    if cfg.job.strict and choices:
        raise ConfigError(f"job.strict = true and {choices[0].op} falls back to '{choices[0].chosen}': {choices[0].reason}")
    return choices


def apply_float8(model: nn.Module, float8_cfg) -> list[KernelChoice]:
    """On CUDA, torchao FP8 training for the block linears with in and out features >= min_dim; one report line per
    shape (without CUDA, precision_fallbacks reports FP8's fallback)."""
    recipe, min_dim = float8_cfg.recipe, float8_cfg.min_dim
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    decisions: dict[str, bool] = {}

    def wanted(module: nn.Module, fqn: str) -> bool:
        if not isinstance(module, nn.Linear) or not fqn.startswith("layers."):
            return False
        ok = module.in_features >= min_dim and module.out_features >= min_dim and module.in_features % 16 == 0 \
            and module.out_features % 16 == 0
        decisions[fqn] = ok
        return ok

    convert_to_float8_training(model, module_filter_fn=wanted, config=Float8LinearConfig.from_recipe_name(recipe))
    shapes = Counter()
    for fqn, ok in decisions.items():
        lin = model.get_submodule(fqn)
        shapes[(lin.in_features, lin.out_features, ok)] += 1
    return [
        KernelChoice(
            f"float8 {i}x{o} ({n} linears)", recipe, recipe if ok else "bf16", False,
            "" if ok else f"below float8.min_dim = {min_dim} (measured slower: benchmarks/results/fp8.md)",
        )
        for (i, o, ok), n in sorted(shapes.items())
    ]


def apply_ep(model: nn.Module, ep_mesh, device: torch.device, dispatch: str) -> None:
    """Shard every LatentMoE's w1/w3/w2 over the "ep" mesh (Shard(0): whole experts); route with `dispatch`."""
    from torch.distributed.tensor import DTensor, Shard

    ep, rank = ep_mesh.size(), ep_mesh.get_local_rank()
    for block in model.layers.values():
        if not block.is_moe:
            continue
        moe = block.ffn
        for name in ("w1", "w3", "w2"):
            full = getattr(moe, name)
            local = full.detach().chunk(ep, dim=0)[rank]
            moe.register_parameter(name, nn.Parameter(DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False)))
        moe.experts_fn = ExpertParallel(moe.experts_fn, ep_mesh.get_group(), moe.router.n_experts, moe.router.top_k,
                                       device, dispatch)


def apply_ac(model: nn.Module, mode: str) -> None:
    """Recompute blocks in backward: every block ("full") or every other one ("selective").

    NOTE: QB-safe: the recompute runs under `routing_recompute`, so each router
    reuses the bias of the original forward and updates nothing a second time.
    """
    for i, block in model.layers.items():
        if mode == "full" or int(i) % 2 == 1:
            block.forward = _checkpointed(block.forward)


def _checkpointed(forward):
    @functools.wraps(forward)
    def run(*args):
        # NOTE: the residual stream appends to its list of sources after the
        # block returns; the recompute must see the list as it was, so pass a copy.
        args = tuple(list(a) if isinstance(a, list) else a for a in args)
        # NOTE: preserve_rng_state=False: the model draws no random numbers, and saving the generators' state per
        # block is host work that a CUDA graph of the step (compile.cuda_graph) could not capture.
        return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=False,
                          context_fn=lambda: (contextlib.nullcontext(), routing_recompute()))

    return run


def use_compile_cache(path: str) -> Path:
    """Point inductor's and Triton's on-disk caches at `path` (created); both read these variables when they compile.

    NOTE: the cache is keyed by the graph, the torch/Triton versions and the
    GPU, so machines of one kind share it safely; a restart then loads kernels
    instead of building them again (most of the start-up, benchmarks/results/
    train_throughput.md).
    """
    root = Path(path).expanduser().resolve()
    (root / "inductor").mkdir(parents=True, exist_ok=True)
    (root / "triton").mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(root / "inductor")
    os.environ["TRITON_CACHE_DIR"] = str(root / "triton")
    return root


def apply_compile(model: nn.Module, backend: str) -> None:
    """torch.compile every block's sublayers and residual mixes in place; graph breaks are reported by CompileWatch.

    NOTE: the compiled units are the attention and FFN sublayers (norm +
    KDA / MLA, norm + dense / MoE FFN) and the reference residual mixes, not whole
    blocks: each kind of sublayer is one graph that inductor compiles once
    (the other layers hit its cache), where whole blocks differed in their
    number of residual sources and each compiled its own. The blocks' eager
    glue stays outside (FSDP2's hooks, activation checkpointing, two adds).
    Every unit of a kind shares one code object, and takes cache entries per
    variant it meets (KDA or MLA, dense or MoE, source counts, training and
    evaluation, static then dynamic shapes, a routing recompute): dynamo's
    default limit (8 entries) would silently run the rest eager, so the limit
    leaves room for all of them, and hitting it anyway raises.
    """
    import torch._dynamo.config as dynamo_config

    per_block = 16  # {train, eval} x {static, dynamic} x {grad, no grad} x {forward, recompute}
    n = len(model.layers)
    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, per_block * n + 8)
    dynamo_config.accumulated_recompile_limit = max(dynamo_config.accumulated_recompile_limit, 4 * per_block * n + 64)
    dynamo_config.fail_on_recompile_limit_hit = True
    for block in model.layers.values():
        block.attn_sublayer = torch.compile(block.attn_sublayer, backend=backend)
        block.ffn_sublayer = torch.compile(block.ffn_sublayer, backend=backend)
    # NOTE: a mix that runs the fused kernel (kernels.attn_res) is one custom op: compiling it would only add
    # start-up time. The PyTorch reference mix is compiled.
    for mix in [m for block in model.layers.values() for m in (block.attn_mix, block.ffn_mix)] + [model.final_mix]:
        if mix.mix is pseudo_query_mix_reference:
            mix.mix_several = torch.compile(mix.mix_several, backend=backend)


def apply_fsdp(model: nn.Module, dims: ParallelDims, mesh, param_dtype: torch.dtype, reshard_after_forward: bool = True,
               average_gradients: bool = False) -> None:
    """FSDP2 per block and at the root; reduce in float32; no gradient division (the loss is already global).

    average_gradients: the fault injection debug.inject_grad_scale = 'fsdp_average' (FSDP2's own default,
    the classic bug): every FSDP group divides its reduced gradients by its mesh size.

    Under EP the experts' DTensors are already split over "ep". Where the
    expert mesh has more than one rank (efsdp > 1, or HSDP replicas), each MoE
    block's experts are their own FSDP group over it, and the rest of the MoE
    a group over the dense mesh. Where it has one rank (EP = the shard degree,
    no replicas) there is nothing to shard or reduce: the experts stay out of
    FSDP altogether (DTensors over "ep", float32, cast by the MoE's forward),
    so no FSDP hook sits inside the compiled MoE sublayer. Replicated
    parameters (the routers: `optim_hints`) stay out of FSDP as plain float32
    tensors, so routing does not depend on the compute dtype;
    `sum_replicated_grads` sums their gradients.
    NOTE: FSDP hooks inside a compiled sublayer are functions dynamo skips: a
    router's own FSDP group once broke its graph twice, and the expert and
    rest groups under EP broke each MoE sublayer five times (79 compiled calls
    per k3-mini forward instead of 24 on two H200s).
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    mesh_sizes: dict[int, int] = {}

    def shard(modules, mesh, reshard=reshard_after_forward, **kwargs):
        for m in modules if isinstance(modules, list) else [modules]:
            mesh_sizes[id(m)] = mesh.size()
        return fully_shard(modules, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard, **kwargs)

    hints = model.optim_hints()
    replicated = {p for name, p in model.named_parameters() if hints[name].get("replicated", False)}
    dense = dims.dense_mesh(mesh)
    expert_mesh = dims.expert_mesh(mesh) if dims.ep > 1 else None
    unsharded = replicated
    if expert_mesh is not None and expert_mesh.size() == 1:
        unsharded = replicated | {getattr(b.ffn, n) for b in model.layers.values() if b.is_moe for n in ("w1", "w3", "w2")}
    for block in model.layers.values():
        if block.is_moe and expert_mesh is not None and expert_mesh.size() > 1:
            moe = block.ffn
            rest = [m for m in (moe.w_down, moe.latent_norm, moe.w_up, moe.shared) if m is not None]
            shard(rest, mesh=dense)
            shard(moe, mesh=expert_mesh, ignored_params=replicated)
        shard(block, mesh=dense, ignored_params=unsharded)
    # NOTE: the root's parameters (embedding, final mix and norm, head) are used last in forward and first in
    # backward, so the root is never resharded between the two. FSDP2 keeps a root gathered only when
    # reshard_after_forward is left unset: told True, torch 2.13 resharded it and gathered it again for backward
    # (one all-gather of the head more per update), and torch 2.11 left the loss's backward, which saved the
    # gathered head weight, reading a freed storage ('setStorage ... out of bounds for storage of size 0').
    shard(model, mesh=dense, reshard=False, ignored_params=unsharded)
    for module in model.modules():
        if hasattr(module, "set_gradient_divide_factor"):
            _sum_gradients(module, divide_by=float(mesh_sizes[id(module)]) if average_gradients else 1.0)


def set_microbatch_sync(model: nn.Module, last: bool) -> None:
    """Before a micro-batch's backward: reduce gradients (and reshard after backward) only if it is the update's `last`.

    NOTE: the earlier micro-batches sum their gradients into unsharded float32
    buffers and keep the parameters gathered, so an update of A micro-batches
    moves one reduce-scatter and one all-gather per block, not A of each.
    A model without FSDP is left alone.
    """
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(last)
        model.set_reshard_after_backward(last)


def _sum_gradients(module, divide_by: float = 1.0) -> None:
    """Make FSDP sum gradients instead of averaging them (torch 2.11 and 2.13 spell it differently).

    divide_by > 1 is the fault injection of `apply_fsdp(average_gradients=True)`: the sum divided after the reduction.
    """
    if hasattr(module, "set_force_sum_reduction_for_comms"):
        # NOTE: a divide factor alone makes FSDP use PREMUL_SUM, which gloo lacks.
        module.set_force_sum_reduction_for_comms(True)
    module.set_gradient_divide_factor(divide_by)
