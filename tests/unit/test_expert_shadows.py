"""kernels.expert_weight_shadows: the experts' compute-dtype copies of their float32 masters stay the masters' casts.

Muon's update pass writes them (its reference path here; the Triton pass in tests/kernels/test_muon_fused.py), the
trainer's hook casts again any master a torch op wrote, the invariant check names a shadow that differs, and the
config refuses the settings where nothing would keep them.
"""

from __future__ import annotations

import pytest
import torch

from titan_k3.config import ConfigError, load_job_config
from titan_k3.invariants import checks as C
from titan_k3.invariants.runner import shadowed_modules
from titan_k3.models.k3.args import FLAVORS
from titan_k3.models.k3.bundle import K3StepHooks
from titan_k3.models.k3.expert_shadows import ExpertShadows
from titan_k3.models.k3.impl import reference_impl, resolve_impl
from titan_k3.models.k3.moe import LatentMoE
from titan_k3.optim import PerHeadMuon

DEBUG = FLAVORS["debug"]
BF16 = torch.bfloat16


def _moe(experts_fn=None, seed: int = 0) -> LatentMoE:
    torch.manual_seed(seed)
    moe = LatentMoE(DEBUG, experts_fn or reference_impl().experts, shadow_dtype=BF16)
    moe.reset_parameters()
    return moe


def _equal_casts(shadows: ExpertShadows) -> bool:
    return all(torch.equal(shadow, master.to(shadow.dtype)) for _, master, shadow in shadows.pairs)


def test_muon_writes_each_shadow_as_its_parameters_cast_and_the_parameters_as_without_shadows():
    """Two per-expert parameters of one block shape, one shadowed: the update passes split by kind, so both
    parameters move exactly as under a Muon with no shadows, the shadow is the new parameter's cast after every
    update, and a skipped update leaves both as they were."""
    gen = torch.Generator().manual_seed(3)
    E, a, b = 3, 8, 12
    ws = [torch.randn(E, a, b, generator=gen) for _ in range(2)]
    twins = [w.clone() for w in ws]
    shadow = torch.zeros(E, a, b, dtype=BF16)
    opt = PerHeadMuon([{"params": ws, "per_expert": True}], lr=0.05)
    plain = PerHeadMuon([{"params": twins, "per_expert": True}], lr=0.05)
    opt.shadows = {ws[1]: shadow}  # the second one: the pass must put the shadowed member first and still match
    for step in range(3):
        grads = [torch.randn(E, a, b, generator=gen) for _ in ws]
        for p, q, g in zip(ws, twins, grads):
            p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        plain.step()
        for p, q in zip(ws, twins):
            assert torch.equal(p, q), step
        assert torch.equal(shadow, ws[1].to(BF16)), step
    before = [w.clone() for w in ws], shadow.clone()
    for p in ws:
        p.grad = torch.randn(E, a, b, generator=gen)
    opt.skip_if = torch.ones((), dtype=torch.bool)
    opt.step()
    assert all(torch.equal(p, q) for p, q in zip(ws, before[0])) and torch.equal(shadow, before[1])


def test_a_master_written_by_a_torch_op_is_cast_again_before_the_next_forward():
    moe = _moe()
    shadows = ExpertShadows(moe)
    assert [name for name, _, _ in shadows.pairs] == ["w1", "w3", "w2"]
    assert shadows.refresh_stale() == 3 and _equal_casts(shadows)  # never written: all three
    assert shadows.refresh_stale() == 0
    with torch.no_grad():
        moe.w3.mul_(1.5)  # a checkpoint load, an initialisation: any torch op moves the version counter
    assert not _equal_casts(shadows)
    assert shadows.refresh_stale() == 1 and _equal_casts(shadows)
    moe.load_state_dict({k: v * 2 for k, v in moe.state_dict().items()})
    assert "w1_shadow" not in moe.state_dict()  # not persistent: a checkpoint holds the masters only
    assert shadows.refresh_stale() == 3 and _equal_casts(shadows)


def test_the_invariant_check_names_a_shadow_that_is_not_its_masters_cast():
    moe = _moe()
    ExpertShadows(moe).refresh_stale()
    model = torch.nn.ModuleDict({"layer": moe})
    assert [name for name, _ in shadowed_modules(model)] == ["layer"]
    assert moe.shadow_mismatches() == [] and C.check_expert_shadows([]) == []
    with torch.no_grad():
        moe.w2_shadow[0, 0, :3] += 1.0  # written behind the version counter's back
    (line,) = moe.shadow_mismatches()
    assert line.startswith("w2: 3 of ") and "bfloat16 shadow differ" in line
    (v,) = C.check_expert_shadows([f"layer.{line}"])
    assert v.check == "weights.expert_shadows" and v.metric == 1.0 and "layer.w2: 3 of" in v.message
    assert "weights.expert_shadows" in C.CHECKS


def test_the_forward_hands_the_experts_the_shadows_in_place_of_the_masters_casts():
    calls = []

    def experts_fn(z, w1, w3, w2, idx, weights, **kwargs):
        calls.append(kwargs)
        return torch.zeros_like(z)

    moe = _moe(experts_fn)
    moe(torch.randn(1, 5, DEBUG.dim))
    (kwargs,) = calls
    assert [s.data_ptr() for s in kwargs["shadows"]] == [moe.w1_shadow.data_ptr(), moe.w3_shadow.data_ptr(),
                                                         moe.w2_shadow.data_ptr()]
    plain = LatentMoE(DEBUG, experts_fn)
    plain(torch.randn(1, 5, DEBUG.dim))
    assert calls[1] == {} and not plain.shadowed and not shadowed_modules(plain)


def test_the_shadows_need_muon_to_own_every_unsharded_master():
    moe = _moe()
    shadows = ExpertShadows(moe)
    with pytest.raises(ValueError, match=r"'kernels.expert_weight_shadows' = true: w1 is not updated by Per-Head Muon"):
        shadows.check_owned(None)
    with pytest.raises(ValueError, match=r"w3 is not updated by Per-Head Muon"):
        shadows.check_owned(PerHeadMuon([{"params": [moe.w1], "per_expert": True}], lr=0.1))
    shadows.check_owned(PerHeadMuon([{"params": [moe.w1, moe.w3, moe.w2], "per_expert": True}], lr=0.1))


def test_the_step_hooks_give_muon_the_shadows_and_refresh_them_before_a_forward():
    from titan_k3.optim import build_optimizers
    from titan_k3.optim.spec import ParamSpec

    moe = _moe()
    model = torch.nn.ModuleDict({"ffn": moe})
    model.mla_layers, model.moe_routers = dict, lambda: {}
    cfg = load_job_config([])
    hooks = K3StepHooks(model, cfg, torch.device("cpu"), None)
    experts = {"ffn.w1", "ffn.w3", "ffn.w2"}
    optimizers = build_optimizers(model.named_parameters(), lambda name, p: ParamSpec(
        use_muon=name in experts or p.dim() == 2, per_expert=name in experts), lr=0.1)
    hooks.bind_optimizers(optimizers)
    muon = optimizers.optimizers["muon"]
    assert {id(p) for p in muon.shadows} == {id(moe.w1), id(moe.w3), id(moe.w2)}
    hooks.before_forward()
    assert moe.shadow_mismatches() == []
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizers.step()
    assert moe.shadow_mismatches() == []  # Muon's pass wrote them (and moved the counters: its reference path)


@pytest.mark.parametrize("argv, match", [
    (["--kernels.experts_cast_in_kernel", "true"],
     "'kernels.expert_weight_shadows' and 'kernels.experts_cast_in_kernel' are both true"),
    (["--optimizer.name", "adamw"], "needs optimizer.name = 'muon'"),
    (["--training.compute_dtype", "float32"], "needs training.compute_dtype = 'bfloat16'"),
])
def test_the_config_refuses_shadows_that_nothing_would_keep(argv, match):
    with pytest.raises(ConfigError, match=match):
        load_job_config(["--kernels.expert_weight_shadows", "true", "--training.compute_dtype", "bfloat16", *argv])


def test_the_kernel_report_names_the_shadows_and_a_run_without_our_experts_is_refused_or_falls_back():
    cfg = load_job_config(["--kernels.expert_weight_shadows", "true", "--training.compute_dtype", "bfloat16"])
    cpu = torch.device("cpu")
    fell_back = resolve_impl(cfg.kernels, cpu, compute_dtype=BF16)
    (weights,) = [c for c in fell_back.choices if c.op == "expert_weights"]
    assert weights.fallback and weights.chosen == "cast_pass" and "kernels.expert_weight_shadows" in weights.reason
    assert fell_back.expert_shadows is None
    torch_experts = load_job_config(["--kernels.expert_weight_shadows", "true", "--training.compute_dtype", "bfloat16",
                                     "--kernels.experts", "torch"])
    with pytest.raises(ValueError, match=r"'kernels.expert_weight_shadows' = true: needs our Triton experts"):
        resolve_impl(torch_experts.kernels, cpu, compute_dtype=BF16)


def test_under_torchrun_the_shadows_fall_back_to_the_cast_pass_and_job_strict_refuses():
    """Several processes shard the experts (FSDP2, EP), whose all-gather casts them: the run takes the cast pass, says
    why in the kernel report, builds no shadows; job.strict refuses. One process on CUDA gets them."""
    from titan_k3.models.registry import get_model_spec
    from titan_k3.trainer_setup import resolve_kernels

    spec, cuda = get_model_spec("k3"), torch.device("cuda")
    asked = ["--kernels.expert_weight_shadows", "true", "--training.compute_dtype", "bfloat16"]
    args = spec.args("debug", 0)
    one = resolve_kernels(load_job_config(asked), spec, cuda, args, world_size=1)
    assert [(c.chosen, c.fallback) for c in one.choices if c.op == "expert_weights"] == [("shadows", False)]
    assert one.expert_shadows is BF16
    many = resolve_kernels(load_job_config(asked), spec, cuda, args, world_size=8)
    (weights,) = [c for c in many.choices if c.op == "expert_weights"]
    assert (weights.requested, weights.chosen, weights.fallback) == ("shadows", "cast_pass", True)
    assert "one process only; this run has 8" in weights.reason and many.expert_shadows is None
    with pytest.raises(ConfigError, match="job.strict = true and expert_weights falls back to 'cast_pass'"):
        resolve_kernels(load_job_config([*asked, "--job.strict", "true"]), spec, cuda, args, world_size=8)


def test_an_offline_evaluation_of_a_run_with_shadows_builds_experts_that_cast(monkeypatch):
    """No optimizer keeps shadows outside training: `python -m titan_k3.eval` resolves the run's kernels without them
    (with them its experts would read buffers nothing ever wrote)."""
    import dataclasses

    import titan_k3.models.registry as registry
    from titan_k3.eval.offline import build_model

    asked = []
    spec = registry.get_model_spec("k3")

    def resolve(kernels, *args):
        asked.append(kernels.expert_weight_shadows)
        return spec.resolve_kernels(kernels, *args)

    monkeypatch.setattr(registry, "get_model_spec", lambda name: dataclasses.replace(spec, resolve_kernels=resolve))
    cfg = load_job_config(["--kernels.expert_weight_shadows", "true", "--training.compute_dtype", "bfloat16",
                           "--model.flavor", "debug"])
    model, _, _ = build_model(cfg, torch.device("cpu"))
    assert asked == [False] and cfg.kernels.expert_weight_shadows  # the run's own config is left as it was
    assert not any(getattr(m, "shadowed", False) for m in model.modules())
