"""Kernel selection against the model's shapes: a Triton kernel that cannot serve them is refused where
kernels.<op> = 'triton' asked for it and reported as a fallback under 'auto', at start-up, not at the first
forward (or the first QK-Clip) after the run directory exists."""

import pytest
import torch

from kernels.max_logit.kernel import MAX_WIDTH
from kernels.max_logit.reference import max_logit_per_head_reference
from kernels.router.ops import MAX_EXPERTS, top_k_rows
from kernels.router.reference import top_k_rows_reference
from titan_k3.config import load_job_config
from titan_k3.models.k3.args import get_flavor
from titan_k3.models.k3.bundle import resolve_k3_kernels

CUDA = torch.device("cuda")  # resolving touches no GPU
F32 = torch.float32  # training.compute_dtype's default


def _choice(impl, op):
    return next(c for c in impl.choices if c.op == op)


def test_routers_wider_than_the_triton_top_k_are_refused_or_reported():
    wide = get_flavor("debug").replace(n_experts=MAX_EXPERTS + 1)
    with pytest.raises(ValueError, match=rf"'kernels.router' = 'triton': .*rank {MAX_EXPERTS + 1} experts"):
        resolve_k3_kernels(load_job_config(["--kernels.router", "triton"]).kernels, CUDA, wide, F32)
    impl = resolve_k3_kernels(load_job_config([]).kernels, CUDA, wide, F32)
    assert impl.router is top_k_rows_reference and _choice(impl, "router").fallback
    assert f"at most {MAX_EXPERTS}" in _choice(impl, "router").reason
    asked_torch = resolve_k3_kernels(load_job_config(["--kernels.router", "torch"]).kernels, CUDA, wide, F32)
    assert not _choice(asked_torch, "router").fallback
    fits = get_flavor("debug").replace(n_experts=MAX_EXPERTS)
    fits = resolve_k3_kernels(load_job_config([]).kernels, CUDA, fits, F32)
    assert fits.router is top_k_rows


def test_a_model_without_moe_layers_is_not_refused_for_its_router():
    dense = get_flavor("debug").replace(n_experts=MAX_EXPERTS + 1)
    dense = dense.replace(n_dense_layers=dense.n_layers)
    impl = resolve_k3_kernels(load_job_config(["--kernels.router", "triton"]).kernels, CUDA, dense, F32)
    assert impl.router is top_k_rows


def test_mla_heads_wider_than_the_triton_max_logit_are_refused_or_reported():
    wide = get_flavor("debug").replace(qk_nope_dim=MAX_WIDTH, qk_rope_dim=16)
    with pytest.raises(ValueError, match=rf"'kernels.max_logit' = 'triton': .*width of {MAX_WIDTH + 16}"):
        resolve_k3_kernels(load_job_config(["--kernels.max_logit", "triton"]).kernels, CUDA, wide, F32)
    impl = resolve_k3_kernels(load_job_config([]).kernels, CUDA, wide, F32)
    assert impl.max_logit is max_logit_per_head_reference and _choice(impl, "max_logit").fallback
    fits = get_flavor("debug").replace(qk_nope_dim=MAX_WIDTH - 16, qk_rope_dim=16)
    impl = resolve_k3_kernels(load_job_config([]).kernels, CUDA, fits, F32)
    assert impl.max_logit is not max_logit_per_head_reference


def test_fla_kda_without_cuda_or_the_interpreter_is_refused_before_its_import(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="'kernels.kda' = 'fla': .*need a CUDA device"):
        resolve_k3_kernels(load_job_config(["--kernels.kda", "fla"]).kernels, torch.device("cpu"),
                           get_flavor("debug"), F32)


def test_mla_heads_wider_than_flash_attention_are_refused_or_reported():
    from titan_k3.models.k3.impl import FLASH_MAX_WIDTH
    from titan_k3.models.k3.mla import VARLEN

    wide = get_flavor("debug").replace(qk_nope_dim=FLASH_MAX_WIDTH, qk_rope_dim=16)  # q, k and v padded to 272
    for asked in ("varlen", "flash"):
        with pytest.raises(ValueError, match=rf"'kernels.attention' = '{asked}': .*width of {FLASH_MAX_WIDTH + 16}"):
            bf16 = ["--training.compute_dtype", "bfloat16"]  # flash's own condition, checked first
            resolve_k3_kernels(load_job_config(["--kernels.attention", asked, *bf16]).kernels, CUDA, wide,
                               torch.bfloat16)
    impl = resolve_k3_kernels(load_job_config([]).kernels, CUDA, wide, F32)
    assert VARLEN not in impl.sdpa_backends and _choice(impl, "attention").fallback
    narrow_v = get_flavor("debug").replace(v_head_dim=FLASH_MAX_WIDTH + 1)  # the value side sets the width too
    assert _choice(resolve_k3_kernels(load_job_config([]).kernels, CUDA, narrow_v, F32), "attention").fallback
    fits = get_flavor("debug").replace(qk_nope_dim=FLASH_MAX_WIDTH - 16, qk_rope_dim=16)
    assert VARLEN in resolve_k3_kernels(load_job_config([]).kernels, CUDA, fits, F32).sdpa_backends
    on_cpu = resolve_k3_kernels(load_job_config(["--kernels.attention", "math"]).kernels, torch.device("cpu"), wide,
                                F32)
    assert not _choice(on_cpu, "attention").fallback


def test_float32_kda_heads_wider_than_the_triton_kernel_are_refused_or_reported():
    """On a GPU the Triton KDA takes float32 heads up to FLOAT32_MAX_WIDTH wide (its shared memory), bf16 ones to
    256: checked against the run's compute dtype at start-up, not at the first forward after the model compiled."""
    from kernels.kda.ops import FLOAT32_MAX_WIDTH, chunk_kda
    from kernels.kda.reference import chunk_kda_reference

    wide = get_flavor("debug").replace(kda_head_dim=FLOAT32_MAX_WIDTH + 64)
    triton = load_job_config(["--kernels.kda", "triton"]).kernels
    with pytest.raises(ValueError, match=rf"^config key 'kernels.kda' = 'triton': the model's KDA heads are "
                                         rf"{FLOAT32_MAX_WIDTH + 64} wide and training.compute_dtype = 'float32'; .* "
                                         rf"up to {FLOAT32_MAX_WIDTH} wide on a GPU: set training.compute_dtype = "
                                         r"'bfloat16' to run it, or kernels.kda = 'torch'$"):
        resolve_k3_kernels(triton, CUDA, wide, F32)
    impl = resolve_k3_kernels(load_job_config([]).kernels, CUDA, wide, F32)
    kda = _choice(impl, "kda")
    assert impl.kda.__wrapped__ is chunk_kda_reference and (kda.chosen, kda.fallback) == ("torch", True)
    assert f"{FLOAT32_MAX_WIDTH + 64} wide" in kda.reason
    assert resolve_k3_kernels(triton, CUDA, wide, torch.bfloat16).kda is chunk_kda  # bf16 autocast: it fits
    assert not _choice(resolve_k3_kernels(load_job_config([]).kernels, CUDA, wide, torch.bfloat16), "kda").fallback
    fits = get_flavor("debug").replace(kda_head_dim=FLOAT32_MAX_WIDTH)
    assert resolve_k3_kernels(triton, CUDA, fits, F32).kda is chunk_kda
    no_kda = wide.replace(full_attention_layers=tuple(range(wide.n_layers)))  # every layer MLA
    assert resolve_k3_kernels(triton, CUDA, no_kda, F32).kda is chunk_kda


def test_the_run_resolves_kda_in_its_compute_dtype_and_job_strict_refuses_the_fallback():
    """The trainer's (and --job.validate_only's) resolution passes training.compute_dtype on."""
    from kernels.kda.ops import FLOAT32_MAX_WIDTH
    from titan_k3.config import ConfigError
    from titan_k3.models.registry import get_model_spec
    from titan_k3.trainer_setup import resolve_kernels

    spec, wide = get_model_spec("k3"), get_flavor("debug").replace(kda_head_dim=FLOAT32_MAX_WIDTH + 64)
    assert _choice(resolve_kernels(load_job_config([]), spec, CUDA, wide), "kda").fallback
    bf16 = load_job_config(["--training.compute_dtype", "bfloat16"])
    assert _choice(resolve_kernels(bf16, spec, CUDA, wide), "kda").chosen == "triton"
    with pytest.raises(ConfigError, match=r"^job.strict = true and kda falls back to 'torch' \(asked 'auto'\): the "
                                          rf"model's KDA heads are {FLOAT32_MAX_WIDTH + 64} wide"):
        resolve_kernels(load_job_config(["--job.strict", "true"]), spec, CUDA, wide)
