"""The model registry: what it holds matches the torch-free shape table, and a K3 bundle does its step work."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from titan_k3 import spec as shapes
from titan_k3.config import JobConfig
from titan_k3.data.loader import Batch
from titan_k3.models.model_spec import ModelSpec
from titan_k3.models.registry import get_model_spec, register_model, registered_models


def test_the_registry_and_the_shape_table_name_the_same_families_and_flavors():
    assert registered_models() == sorted(shapes.MODEL_FLAVORS)
    for name in registered_models():
        spec = get_model_spec(name)
        assert sorted(spec.flavors) == sorted(shapes.MODEL_FLAVORS[name])
        for flavor, shape in shapes.MODEL_FLAVORS[name].items():
            args = spec.args(flavor, 0)
            assert {k: getattr(args, k) for k in shape} == shape
            assert spec.routed_experts(args) == shapes.routed_experts(name, flavor)


def test_an_unknown_name_is_refused_in_one_line_naming_the_registered():
    with pytest.raises(ValueError, match=r"^config key 'model.name' = 'llama': no such model; registered: k3$"):
        get_model_spec("llama")


def test_register_refuses_a_duplicate_and_flavors_the_shape_table_lacks():
    k3 = get_model_spec("k3")
    with pytest.raises(ValueError, match="registered already"):
        register_model(k3)
    with pytest.raises(ValueError, match="differ from titan_k3/spec.py"):
        register_model(dataclasses.replace(k3, name="k3-variant"))


def test_the_card_flavor_counts_as_the_published_card():
    spec = get_model_spec("k3")
    card = spec.count_params(spec.args(spec.card_flavor, 0))
    assert abs(card.active / 104.2e9 - 1) < 0.01


def _debug_k3(cfg: JobConfig):
    spec: ModelSpec = get_model_spec("k3")
    args = spec.args("debug", 0)
    impl = spec.resolve_kernels(cfg.kernels, torch.device("cpu"), args, torch.float32)
    torch.manual_seed(0)
    model = spec.build(args, impl, cfg.model)
    model.init_weights(0)
    return spec, args, model.train()


def _batch(args, T=64):
    ids = torch.randint(0, args.vocab_size, (2, T + 1))
    return Batch(input_ids=ids[:, :-1], labels=ids[:, 1:], cu_seqlens=torch.tensor([0, T, 2 * T]), source_tokens={},
                 fingerprints=torch.zeros(2, dtype=torch.int64))


def test_k3_hooks_move_the_balance_bias_after_backward_not_in_the_forward():
    cfg = JobConfig()
    spec, args, model = _debug_k3(cfg)
    hooks = spec.step_hooks(model, cfg, torch.device("cpu"), None)
    routers = list(model.moe_routers().values())
    before = [r.qb_bias.clone() for r in routers]
    out = model(*spec.batch_inputs(_batch(args), torch.device("cpu")))
    out.loss_sum.backward()
    assert all(torch.equal(r.qb_bias, b) for r, b in zip(routers, before))  # deferred: nothing moved yet
    hooks.after_backward()
    assert all(not torch.equal(r.qb_bias, b) for r, b in zip(routers, before))
    assert all(r._pending is None for r in routers)


@pytest.mark.parametrize("skip", [False, True])
def test_k3_hooks_clip_a_head_above_tau_unless_the_update_was_skipped(skip):
    cfg = JobConfig()
    cfg.optimizer.qk_clip_tau = 1e-3  # every logit of a random model is above it
    spec, args, model = _debug_k3(cfg)
    hooks = spec.step_hooks(model, cfg, torch.device("cpu"), None)
    with torch.no_grad():
        model(*spec.batch_inputs(_batch(args), torch.device("cpu")))
    layers = model.mla_layers()
    weights = {i: layer.wq_b.weight.clone() for i, layer in layers.items()}
    hooks.after_step(torch.tensor(skip))
    assert sorted(hooks.qk_clip_max_logits) == sorted(layers)
    for i, layer in layers.items():
        assert (hooks.qk_clip_max_logits[i] > cfg.optimizer.qk_clip_tau).all()
        assert torch.equal(layer.wq_b.weight, weights[i]) == skip
