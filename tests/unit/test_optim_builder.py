"""build_optimizers / Optimizers: parameter routing, AdamW decay groups, LR, state dicts."""

import copy

import pytest
import torch

from titan_k3.optim import Optimizers, ParamSpec, build_optimizers


def _params(seed=0):
    gen = torch.Generator().manual_seed(seed)
    shapes = {
        "embed.weight": (32, 8),
        "layers.0.attn.wq.weight": (16, 8),       # 2 heads of 8 rows
        "layers.0.attn.wo.weight": (8, 16),
        "layers.0.moe.experts.w1": (4, 8, 12),
        "layers.0.norm.weight": (8,),
        "layers.0.attn.A_log": (2,),
        "layers.0.moe.router.weight": (4, 8),
        "head.weight": (32, 8),
    }
    return {n: torch.nn.Parameter(torch.randn(*s, generator=gen)) for n, s in shapes.items()}


def _spec_of(name, p):
    if name.endswith(("norm.weight", "A_log")):
        return ParamSpec(use_muon=False, weight_decay=False)
    if name.startswith(("embed", "head")) or "router" in name:
        return ParamSpec(use_muon=False)
    if "experts" in name:
        return ParamSpec(use_muon=True, per_expert=True)
    return ParamSpec(use_muon=True, num_heads=2 if name.endswith("wq.weight") else 1)


def _grads(params, seed):
    gen = torch.Generator().manual_seed(seed)
    for p in params.values():
        p.grad = torch.randn(p.shape, generator=gen)


def test_routes_params_and_summarises():
    params = _params()
    opts = build_optimizers(params.items(), _spec_of, lr=1e-3)
    assert set(opts.names["muon"]) == {"layers.0.attn.wq.weight", "layers.0.attn.wo.weight", "layers.0.moe.experts.w1"}
    assert set(opts.names["adamw"]) == set(params) - set(opts.names["muon"])
    summary = opts.param_groups_summary()
    assert summary["muon"] == {"tensors": 3, "numel": 128 + 128 + 384, "no_decay_tensors": 0, "no_decay_numel": 0}
    assert summary["adamw"]["tensors"] == 5 and summary["adamw"]["no_decay_numel"] == 10
    # NOTE: the trainer's start-up line: words, not a Python dict.
    line = opts.summary_line()
    assert line.startswith("muon 3 tensors, 640 parameters; adamw 5 tensors, ") and "{" not in line
    assert line.endswith(f"({summary['adamw']['no_decay_numel']:,} of them in {summary['adamw']['no_decay_tensors']} "
                         "tensors without weight decay)")
    groups = {(g["num_heads"], g["per_expert"]) for g in opts.muon.param_groups}
    assert groups == {(2, False), (1, False), (1, True)}
    sd = opts.state_dict()  # complete before any step, keyed by name
    assert sorted(sd["muon"]["state"]) == sorted(opts.names["muon"])
    assert not any(s["momentum_buffer"].any() for s in sd["muon"]["state"].values())
    adamw = opts.adamw
    assert adamw.defaults["betas"] == (0.9, 0.95) and adamw.defaults["eps"] == 1e-8
    assert adamw.defaults["fused"], "fused on every device: its found_inf input is the trainer's device-side skip"


def test_use_muon_false_sends_everything_to_adamw():
    params = _params()
    opts = build_optimizers(params.items(), _spec_of, lr=1e-3, use_muon=False)
    assert list(opts.optimizers) == ["adamw"]
    assert sorted(opts.names["adamw"]) == sorted(params)


def test_adamw_no_decay_group_is_not_decayed():
    params = _params()
    opts = build_optimizers(params.items(), _spec_of, lr=1.0, weight_decay=0.1)
    wd_of = {id(p): g["weight_decay"] for g in opts.adamw.param_groups for p in g["params"]}
    assert wd_of[id(params["layers.0.norm.weight"])] == 0.0
    assert wd_of[id(params["layers.0.attn.A_log"])] == 0.0
    assert wd_of[id(params["embed.weight"])] == 0.1
    before = {n: p.detach().clone() for n, p in params.items()}
    for p in params.values():
        p.grad = torch.zeros_like(p)  # Adam's step is 0 / (0 + eps) = 0: only decay moves a weight
    opts.adamw.step()
    assert torch.equal(params["layers.0.norm.weight"], before["layers.0.norm.weight"])
    assert torch.equal(params["layers.0.attn.A_log"], before["layers.0.attn.A_log"])
    torch.testing.assert_close(params["embed.weight"], before["embed.weight"] * 0.9)


def test_set_lr_reaches_every_group():
    opts = build_optimizers(_params().items(), _spec_of, lr=1e-3)
    opts.set_lr(2e-4)
    assert opts.lr == 2e-4
    assert {g["lr"] for o in opts.optimizers.values() for g in o.param_groups} == {2e-4}
    with pytest.raises(ValueError, match="lr"):
        opts.set_lr(float("nan"))


def test_eager_state_changes_nothing_and_matches_lazy_adamw():
    params = _params()
    before = {n: p.detach().clone() for n, p in params.items()}
    opts = build_optimizers(params.items(), _spec_of, lr=1e-2, use_muon=False)
    assert all(torch.equal(params[n], before[n]) for n in params)
    assert all(p.grad is None for p in params.values())
    sd = opts.state_dict()["adamw"]
    assert sorted(sd["state"]) == sorted(params)
    assert all(float(s["step"]) == 0 for s in sd["state"].values())

    lazy_params = {n: torch.nn.Parameter(b.clone()) for n, b in before.items()}
    groups = [{"params": [lazy_params[n] for n in opts.names["adamw"] if not n.endswith(("norm.weight", "A_log"))]},
              {"params": [lazy_params[n] for n in opts.names["adamw"] if n.endswith(("norm.weight", "A_log"))],
               "weight_decay": 0.0}]
    lazy = torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True)
    for seed in range(2):
        _grads(params, seed)
        _grads(lazy_params, seed)
        opts.step()
        lazy.step()
    assert all(torch.equal(params[n], lazy_params[n]) for n in params)


def test_state_dict_round_trip_reproduces_next_step_bitwise():
    params = _params()
    opts = build_optimizers(params.items(), _spec_of, lr=1e-2)
    for seed in range(2):
        _grads(params, seed)
        opts.step()
        opts.zero_grad()
    saved = copy.deepcopy(opts.state_dict())
    saved_params = {n: p.detach().clone() for n, p in params.items()}
    assert set(saved) == {"muon", "adamw"}
    assert "layers.0.attn.wq.weight" in saved["muon"]["state"]

    _grads(params, 7)
    opts.step()

    params2 = {n: torch.nn.Parameter(t.clone()) for n, t in saved_params.items()}
    opts2 = build_optimizers(params2.items(), _spec_of, lr=0.5)
    opts2.load_state_dict(copy.deepcopy(saved))
    assert opts2.lr == 1e-2
    _grads(params2, 7)
    opts2.step()
    for n in params:
        assert torch.equal(params[n], params2[n]), n


def test_load_state_dict_rejects_other_optimizer_or_model():
    params = _params()
    opts = build_optimizers(params.items(), _spec_of, lr=1e-2)
    only_adamw = build_optimizers(_params().items(), _spec_of, lr=1e-2, use_muon=False)
    with pytest.raises(ValueError, match="use_muon"):
        opts.load_state_dict(only_adamw.state_dict())
    fewer = build_optimizers([(n, p) for n, p in _params().items() if n != "head.weight"], _spec_of, lr=1e-2)
    with pytest.raises(ValueError, match="head.weight"):
        opts.load_state_dict(fewer.state_dict())


def test_rejects_bad_specs_naming_the_param():
    params = _params()
    with pytest.raises(ValueError, match="layers.0.norm.weight"):
        build_optimizers([("layers.0.norm.weight", params["layers.0.norm.weight"])],
                         lambda n, p: ParamSpec(use_muon=True), lr=1e-3)
    with pytest.raises(ValueError, match="does not divide"):
        build_optimizers([("w", params["layers.0.attn.wq.weight"])],
                         lambda n, p: ParamSpec(use_muon=True, num_heads=3), lr=1e-3)
    with pytest.raises(ValueError, match="same tensor"):
        build_optimizers([("a", params["head.weight"]), ("b", params["head.weight"])], _spec_of, lr=1e-3)
    with pytest.raises(ValueError, match="ParamSpec"):
        build_optimizers(params.items(), lambda n, p: {"use_muon": True}, lr=1e-3)
    assert isinstance(build_optimizers(params.items(), _spec_of, lr=1e-3), Optimizers)


def test_replicated_params_get_adamw_groups_of_their_own():
    """Routers (replicated under FSDP) never share an AdamW group: fused AdamW cannot mix plain tensors and DTensors,
    and the grouping (which a checkpoint records) must be the same at every world size."""
    params = {"emb": torch.nn.Parameter(torch.randn(4, 3)), "router": torch.nn.Parameter(torch.randn(2, 3)),
              "norm": torch.nn.Parameter(torch.ones(3))}
    specs = {"emb": ParamSpec(use_muon=False), "router": ParamSpec(use_muon=False, replicated=True),
             "norm": ParamSpec(use_muon=False, weight_decay=False)}
    opts = build_optimizers(params.items(), lambda name, _p: specs[name], lr=0.1, weight_decay=0.1)
    groups = [[n for p in g["params"] for n, q in params.items() if q is p] for g in opts.adamw.param_groups]
    assert groups == [["emb"], ["norm"], ["router"]]
    assert [g["weight_decay"] for g in opts.adamw.param_groups] == [0.1, 0.0, 0.1]
    assert opts.names["adamw"] == ["emb", "norm", "router"]


def test_a_device_side_skip_changes_nothing_and_a_kept_step_is_the_plain_step():
    """skip_if=True leaves every parameter and state bit-identical, even with NaN gradients; False is a plain step."""
    params = _params()
    opts = build_optimizers(params.items(), _spec_of, lr=1e-2)
    _grads(params, 0)
    opts.step()  # non-zero momentum and moments, so "unchanged" is not "still zero"
    before = {n: p.detach().clone() for n, p in params.items()}
    state_before = copy.deepcopy(opts.state_dict())
    for p in params.values():
        p.grad = torch.full_like(p, float("nan"))
    opts.step(skip_if=torch.tensor(True))
    for n, p in params.items():
        assert torch.equal(p, before[n]), n
    for key, sd in opts.state_dict().items():
        for name, state in sd["state"].items():
            for k, v in state.items():
                assert torch.equal(v, state_before[key]["state"][name][k]), (key, name, k)
    twin = {n: torch.nn.Parameter(b.clone()) for n, b in before.items()}
    twin_opts = build_optimizers(twin.items(), _spec_of, lr=1e-2)
    twin_opts.load_state_dict(copy.deepcopy(state_before))
    _grads(params, 1)
    _grads(twin, 1)
    opts.step(skip_if=torch.tensor(False))
    twin_opts.step()
    for n in params:
        assert torch.equal(params[n], twin[n]), n


def test_grad_scale_equals_scaling_the_gradients_first():
    """Optimizers.step(grad_scale=c) is a step on c * grad: bitwise for Muon (it multiplies as it reads), to
    rounding for fused AdamW (it divides by 1 / c); the gradients themselves are left as they were."""
    scaled, plain = _params(), _params()
    opts = build_optimizers(scaled.items(), _spec_of, lr=1e-2)
    twin = build_optimizers(plain.items(), _spec_of, lr=1e-2)
    coef = torch.tensor(0.37)
    for seed in range(2):
        _grads(scaled, seed)
        _grads(plain, seed)
        for p in plain.values():
            p.grad.mul_(coef)
        grads = {n: p.grad.clone() for n, p in scaled.items()}
        opts.step(grad_scale=coef)
        twin.step()
        assert all(torch.equal(scaled[n].grad, grads[n]) for n in scaled if n in opts.names["muon"])
    for n in scaled:
        if n in opts.names["muon"]:
            assert torch.equal(scaled[n], plain[n]), n
        else:
            torch.testing.assert_close(scaled[n], plain[n], rtol=1e-6, atol=1e-7, msg=n)
