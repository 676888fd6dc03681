"""QK-Clip: every logit of a clipped head shrinks by exactly gamma; nothing else changes."""

import pytest
import torch

from titan_k3.optim import qk_clip_

H, NOPE, ROPE, V, Q_LORA, KV_LORA = 4, 6, 3, 5, 10, 8


def _logits_and_values(w_qb, w_kvb, x_q, c, kr):
    """MLA logits [H, Tq, Tk] and values [H, Tk, V] from the layout in qk_clip.py."""
    q = (x_q @ w_qb.T).view(-1, H, NOPE + ROPE)
    q_nope, q_rope = q[..., :NOPE], q[..., NOPE:]
    kv = (c @ w_kvb.T).view(-1, H, NOPE + V)
    k_nope, v = kv[..., :NOPE], kv[..., NOPE:]
    logits = torch.einsum("qhd,khd->hqk", q_nope, k_nope) + torch.einsum("qhd,kd->hqk", q_rope, kr)
    return logits, v.transpose(0, 1)


def test_clipped_heads_shrink_by_gamma_others_unchanged():
    gen = torch.Generator().manual_seed(0)
    w_qb = torch.randn(H * (NOPE + ROPE), Q_LORA, generator=gen, dtype=torch.float64)
    w_kvb = torch.randn(H * (NOPE + V), KV_LORA, generator=gen, dtype=torch.float64)
    x_q = torch.randn(7, Q_LORA, generator=gen, dtype=torch.float64)
    c = torch.randn(9, KV_LORA, generator=gen, dtype=torch.float64)
    kr = torch.randn(9, ROPE, generator=gen, dtype=torch.float64)
    logits0, v0 = _logits_and_values(w_qb, w_kvb, x_q, c, kr)
    qb0, kvb0 = w_qb.clone(), w_kvb.clone()

    max_logit = torch.tensor([50.0, 400.0, 100.0, 250.0], dtype=torch.float64)
    gamma = qk_clip_(w_qb, w_kvb, max_logit, n_heads=H, nope_dim=NOPE, rope_dim=ROPE, v_dim=V, tau=100.0)
    torch.testing.assert_close(gamma, torch.tensor([1.0, 0.25, 1.0, 0.4], dtype=torch.float64))

    logits1, v1 = _logits_and_values(w_qb, w_kvb, x_q, c, kr)
    torch.testing.assert_close(logits1, logits0 * gamma[:, None, None], rtol=1e-12, atol=1e-12)
    assert torch.equal(v1, v0)
    for h in (0, 2):  # unclipped heads (100 is not > tau): weights bitwise unchanged
        q_rows = slice(h * (NOPE + ROPE), (h + 1) * (NOPE + ROPE))
        kv_rows = slice(h * (NOPE + V), (h + 1) * (NOPE + V))
        assert torch.equal(w_qb[q_rows], qb0[q_rows]) and torch.equal(w_kvb[kv_rows], kvb0[kv_rows])
    # The rope query rows scale by gamma and the nope rows by sqrt(gamma) (not e.g. gamma on both sides).
    h1_rope = slice(1 * (NOPE + ROPE) + NOPE, 2 * (NOPE + ROPE))
    torch.testing.assert_close(w_qb[h1_rope], qb0[h1_rope] * 0.25)
    torch.testing.assert_close(w_kvb[NOPE + V:2 * NOPE + V], kvb0[NOPE + V:2 * NOPE + V] * 0.5)


def test_bf16_weights_are_scaled_in_place():
    w_qb = torch.ones(H * (NOPE + ROPE), Q_LORA, dtype=torch.bfloat16)
    w_kvb = torch.ones(H * (NOPE + V), KV_LORA, dtype=torch.bfloat16)
    qk_clip_(w_qb, w_kvb, torch.full((H,), 400.0), n_heads=H, nope_dim=NOPE, rope_dim=ROPE, v_dim=V)
    assert w_qb.dtype == torch.bfloat16
    assert w_qb[0, 0] == 0.5 and w_qb[NOPE, 0] == 0.25 and w_kvb[NOPE, 0] == 1.0


def test_rejects_mismatched_shapes():
    w_qb = torch.zeros(H * (NOPE + ROPE), Q_LORA)
    w_kvb = torch.zeros(H * (NOPE + V), KV_LORA)
    kw = dict(n_heads=H, nope_dim=NOPE, rope_dim=ROPE, v_dim=V)
    with pytest.raises(ValueError, match="w_qb"):
        qk_clip_(w_qb[:-1], w_kvb, torch.zeros(H), **kw)
    with pytest.raises(ValueError, match="w_kvb"):
        qk_clip_(w_qb, w_kvb[:-1], torch.zeros(H), **kw)
    with pytest.raises(ValueError, match="max_logit_H"):
        qk_clip_(w_qb, w_kvb, torch.zeros(H + 1), **kw)
    with pytest.raises(ValueError, match="tau"):
        qk_clip_(w_qb, w_kvb, torch.zeros(H), tau=0.0, **kw)
