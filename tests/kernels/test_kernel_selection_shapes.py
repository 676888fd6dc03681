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


def _choice(impl, op):
    return next(c for c in impl.choices if c.op == op)


def test_routers_wider_than_the_triton_top_k_are_refused_or_reported():
    wide = get_flavor("debug").replace(n_experts=MAX_EXPERTS + 1)
    with pytest.raises(ValueError, match=rf"'kernels.router' = 'triton': .*rank {MAX_EXPERTS + 1} experts"):
        resolve_k3_kernels(load_job_config(["--kernels.router", "triton"]).kernels, CUDA, wide)
    impl = resolve_k3_kernels(load_job_config([]).kernels, CUDA, wide)
    assert impl.router is top_k_rows_reference and _choice(impl, "router").fallback
    assert f"at most {MAX_EXPERTS}" in _choice(impl, "router").reason
    asked_torch = resolve_k3_kernels(load_job_config(["--kernels.router", "torch"]).kernels, CUDA, wide)
    assert not _choice(asked_torch, "router").fallback
    fits = resolve_k3_kernels(load_job_config([]).kernels, CUDA, get_flavor("debug").replace(n_experts=MAX_EXPERTS))
    assert fits.router is top_k_rows


def test_a_model_without_moe_layers_is_not_refused_for_its_router():
    dense = get_flavor("debug").replace(n_experts=MAX_EXPERTS + 1)
    dense = dense.replace(n_dense_layers=dense.n_layers)
    impl = resolve_k3_kernels(load_job_config(["--kernels.router", "triton"]).kernels, CUDA, dense)
    assert impl.router is top_k_rows


def test_mla_heads_wider_than_the_triton_max_logit_are_refused_or_reported():
    wide = get_flavor("debug").replace(qk_nope_dim=MAX_WIDTH, qk_rope_dim=16)
    with pytest.raises(ValueError, match=rf"'kernels.max_logit' = 'triton': .*width of {MAX_WIDTH + 16}"):
        resolve_k3_kernels(load_job_config(["--kernels.max_logit", "triton"]).kernels, CUDA, wide)
    impl = resolve_k3_kernels(load_job_config([]).kernels, CUDA, wide)
    assert impl.max_logit is max_logit_per_head_reference and _choice(impl, "max_logit").fallback
    fits = get_flavor("debug").replace(qk_nope_dim=MAX_WIDTH - 16, qk_rope_dim=16)
    assert resolve_k3_kernels(load_job_config([]).kernels, CUDA, fits).max_logit is not max_logit_per_head_reference


def test_fla_kda_without_cuda_or_the_interpreter_is_refused_before_its_import(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="'kernels.kda' = 'fla': .*need a CUDA device"):
        resolve_k3_kernels(load_job_config(["--kernels.kda", "fla"]).kernels, torch.device("cpu"), get_flavor("debug"))


def test_mla_heads_wider_than_flash_attention_are_refused_or_reported():
    from titan_k3.models.k3.impl import FLASH_MAX_WIDTH
    from titan_k3.models.k3.mla import VARLEN

    wide = get_flavor("debug").replace(qk_nope_dim=FLASH_MAX_WIDTH, qk_rope_dim=16)  # q, k and v padded to 272
    for asked in ("varlen", "flash"):
        with pytest.raises(ValueError, match=rf"'kernels.attention' = '{asked}': .*width of {FLASH_MAX_WIDTH + 16}"):
            bf16 = ["--training.compute_dtype", "bfloat16"]  # flash's own condition, checked first
            resolve_k3_kernels(load_job_config(["--kernels.attention", asked, *bf16]).kernels, CUDA, wide)
    impl = resolve_k3_kernels(load_job_config([]).kernels, CUDA, wide)
    assert VARLEN not in impl.sdpa_backends and _choice(impl, "attention").fallback
    narrow_v = get_flavor("debug").replace(v_head_dim=FLASH_MAX_WIDTH + 1)  # the value side sets the width too
    assert _choice(resolve_k3_kernels(load_job_config([]).kernels, CUDA, narrow_v), "attention").fallback
    fits = get_flavor("debug").replace(qk_nope_dim=FLASH_MAX_WIDTH - 16, qk_rope_dim=16)
    assert VARLEN in resolve_k3_kernels(load_job_config([]).kernels, CUDA, fits).sdpa_backends
    on_cpu = resolve_k3_kernels(load_job_config(["--kernels.attention", "math"]).kernels, torch.device("cpu"), wide)
    assert not _choice(on_cpu, "attention").fallback
