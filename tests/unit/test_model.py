"""The K3 model: causality, document isolation, gradient accumulation, optimizer hints."""

import pytest
import torch

from titan_k3.models.k3.args import FLAVORS
from titan_k3.models.k3.impl import reference_impl
from titan_k3.models.k3.model import K3Model


def build(seed=0, **overrides):
    torch.manual_seed(seed)
    model = K3Model(FLAVORS["debug"].replace(**overrides), reference_impl())
    model.init_weights(seed)
    # Give the zero-initialised pseudo-queries some weight so their paths are exercised.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("query"):
                p.normal_(0, 0.5)
    return model.double()


def test_future_tokens_never_change_the_past():
    model = build().eval()
    x = torch.randint(0, 512, (2, 80))
    y = x.clone()
    y[:, 50:] = torch.randint(0, 512, (2, 30))
    with torch.no_grad():
        h1, h2 = model.hidden(x), model.hidden(y)
    torch.testing.assert_close(h1[:, :50], h2[:, :50], rtol=0, atol=1e-10)
    assert (h1[:, 50:] - h2[:, 50:]).abs().max() > 1e-3


def test_documents_never_see_each_other():
    """Changing document B (anywhere) leaves documents A and C unchanged, through KDA, convs, MLA and MoE."""
    model = build().eval()
    T = 96
    cu = torch.tensor([0, 30, 61, 96, 96 + 40, 192])  # row 0: A | B | C ; row 1: D | E
    x = torch.randint(0, 512, (2, T))
    y = x.clone()
    y[0, 30:61] = torch.randint(0, 512, (31,))
    with torch.no_grad():
        h1, h2 = model.hidden(x, cu), model.hidden(y, cu)
    untouched = torch.ones(2, T, dtype=torch.bool)
    untouched[0, 30:61] = False
    torch.testing.assert_close(h1[untouched], h2[untouched], rtol=0, atol=1e-10)
    # A document packed after another gives exactly what it gives alone.
    with torch.no_grad():
        alone = model.hidden(x[:1, 61:96])
    torch.testing.assert_close(h1[0, 61:96], alone[0], rtol=1e-9, atol=1e-9)


def test_loss_matches_materialised_logits():
    model = build().eval()
    x = torch.randint(0, 512, (2, 64))
    labels = torch.randint(0, 512, (2, 64))
    labels[0, :5] = -100
    out = model(x, labels)
    logits = model(x)
    ref = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum", ignore_index=-100)
    torch.testing.assert_close(out.loss_sum.double(), ref, rtol=1e-6, atol=1e-6)
    assert int(out.n_valid) == 128 - 5


def test_grad_accumulation_4x1_equals_1x4():
    """With QB frozen, four microbatches of one sequence equal one microbatch of four."""
    a, b = build(1), build(1)
    for m in (a, b):
        for r in m.moe_routers().values():
            r.update_enabled = False
    x = torch.randint(0, 512, (4, 64))
    labels = torch.randint(0, 512, (4, 64))
    labels[1, 10:20] = -100
    n = (labels != -100).sum()
    out = a(x, labels)
    (out.loss_sum / n).backward()
    for i in range(4):
        out = b(x[i : i + 1], labels[i : i + 1])
        (out.loss_sum / n).backward()
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        if pa.grad is None:
            assert pb.grad is None, name
            continue
        torch.testing.assert_close(pa.grad, pb.grad, rtol=1e-9, atol=1e-12, msg=name)


def test_optimizer_hints_follow_the_spec():
    model = K3Model(FLAVORS["debug"], reference_impl())
    hints = model.optim_hints()
    a = FLAVORS["debug"]
    assert hints["layers.0.attn.q_proj.weight"] == dict(use_muon=True, num_heads=a.kda_heads, per_expert=False, weight_decay=True)
    assert hints["layers.3.attn.wq_b.weight"]["num_heads"] == a.mla_heads
    assert hints["layers.3.attn.wkv_b.weight"]["num_heads"] == a.mla_heads
    assert hints["layers.1.ffn.w1"] == dict(use_muon=True, num_heads=1, per_expert=True, weight_decay=True)
    for name in ("tok_embeddings.weight", "output.weight", "layers.1.ffn.router.weight", "layers.0.attn.q_conv"):
        assert hints[name]["use_muon"] is False and hints[name]["weight_decay"] is True, name
    for name in ("layers.0.attn.A_log", "layers.0.attn.dt_bias", "layers.0.attn_norm.weight", "layers.1.ffn_mix.query",
                 "norm.weight", "layers.3.attn.q_norm.weight", "layers.1.ffn.latent_norm.weight", "layers.0.attn.o_norm"):
        assert hints[name] == dict(use_muon=False, num_heads=1, per_expert=False, weight_decay=False), name
    assert hints["layers.1.ffn.w_down.weight"]["use_muon"] and hints["layers.1.ffn.w_down.weight"]["num_heads"] == 1


@pytest.mark.parametrize("lb", [-5.0, None])
def test_kda_gate_variants_train(lb):
    model = build(kda_gate_lower_bound=lb).train()
    x = torch.randint(0, 512, (1, 64))
    out = model(x, x)
    out.loss_sum.backward()
    assert torch.isfinite(model.layers["0"].attn.A_log.grad).all()
    assert model.layers["0"].attn.dt_bias.grad.abs().sum() > 0
