"""The parameter counter: k3-mini and the k3 card, and agreement with the instantiated modules."""

import pytest
import torch

from titan_k3.models.k3.args import FLAVORS, count_params
from titan_k3.models.k3.impl import reference_impl
from titan_k3.models.k3.model import K3Model


def test_k3_mini_matches_the_worklog_replica():
    pc = count_params(FLAVORS["k3-mini"])
    assert abs(pc.total / 1.02e9 - 1) < 0.015
    assert abs(pc.active / 145e6 - 1) < 0.015


def test_k3_reproduces_the_card_active_count():
    assert abs(count_params(FLAVORS["k3"]).active / 104.2e9 - 1) < 0.01


def test_k3_mini_layer_pattern():
    a = FLAVORS["k3-mini"]
    assert a.mla_layers == (3, 7, 11)
    assert [a.is_moe(i) for i in range(a.n_layers)] == [False] + [True] * 11
    assert FLAVORS["k3"].mla_layers[-2:] == (91, 92) and len(FLAVORS["k3"].mla_layers) == 24


@pytest.mark.parametrize("flavor", list(FLAVORS))
def test_counter_equals_instantiated_model(flavor):
    args = FLAVORS[flavor]
    with torch.device("meta"):
        model = K3Model(args, reference_impl())
    total = sum(p.numel() for p in model.parameters())
    pc = count_params(args)
    assert total == pc.total
    experts = sum(p.numel() for n, p in model.named_parameters() if n.endswith((".w1", ".w3", ".w2")) and p.ndim == 3)
    assert pc.inactive_experts == experts * (args.n_experts - args.top_k) // args.n_experts
