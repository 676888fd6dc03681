"""The K3 model and optimizer against the formulas of docs/k3.md, written out again here in float64.

Each reference below is a transcription of the documented equation (no helper of the model's or the kernels' is
called), so a test fails when the code computes something other than what the page says, not merely something other
than it computed before. The layers run on their PyTorch paths (`reference_impl`).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from titan_k3.models.k3.args import FLAVORS, count_params
from titan_k3.models.k3.bundle import K3StepHooks
from titan_k3.models.k3.documents import Documents
from titan_k3.models.k3.impl import reference_impl
from titan_k3.models.k3.kda import KimiDeltaAttention
from titan_k3.models.k3.layers import RMSNorm, SituGluFFN
from titan_k3.models.k3.mla import GatedMLA
from titan_k3.models.k3.model import K3Model
from titan_k3.models.k3.moe import LatentMoE, QuantileBalancedRouter
from titan_k3.optim import build_optimizers, newton_schulz
from titan_k3.optim.spec import ParamSpec

DEBUG = FLAVORS["debug"]
F64 = torch.float64
NORM_EPS = 1e-5  # every RMSNorm (docs/k3.md §1)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randomise_(module: torch.nn.Module, seed: int, std: float = 0.3) -> None:
    """Every parameter to random values (norm weights, A_log, dt_bias and queries too: no identity hides a term)."""
    g = _gen(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * std)


# --- the documented formulas ----------------------------------------------------------------------------------


def rms(x, w=None, eps=NORM_EPS):
    y = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if w is None else y * w


def situ_glu(a, u):
    return 4 * torch.tanh(a / 4) * torch.sigmoid(a) * 25 * torch.tanh(u / 25)


def lin(x, w):
    """x W^T for an nn.Linear weight W [out, in]."""
    return x @ w.T


def causal_depthwise_conv4(x_BTC, w_C1W):
    """y_t = sum_j w[:, W-1-j] x_{t-j}: nn.Conv1d's cross-correlation padded on the left only."""
    W = w_C1W.shape[-1]
    return F.conv1d(F.pad(x_BTC.transpose(1, 2), (W - 1, 0)), w_C1W, groups=x_BTC.shape[-1]).transpose(1, 2)


def kda_by_spec(layer: KimiDeltaAttention, x, lower_bound):
    B, T, _ = x.shape
    H, K = layer.n_heads, layer.head_dim
    q, k, v = (F.silu(causal_depthwise_conv4(lin(x, proj.weight), conv)).view(B, T, H, K)
               for proj, conv in ((layer.q_proj, layer.q_conv), (layer.k_proj, layer.k_conv),
                                  (layer.v_proj, layer.v_conv)))
    q, k = (t / torch.sqrt(t.pow(2).sum(-1, keepdim=True) + 1e-6) for t in (q, k))
    f = lin(lin(x, layer.f_a.weight), layer.f_b.weight).view(B, T, H, K)
    a = torch.exp(layer.A_log)[:, None]
    if lower_bound is None:
        g = -a * F.softplus(f + layer.dt_bias)
    else:
        g = lower_bound * torch.sigmoid(a * (f + layer.dt_bias))
    beta = torch.sigmoid(lin(x, layer.b_proj.weight))
    o = torch.zeros(B, T, H, K, dtype=x.dtype)
    for b in range(B):
        for h in range(H):
            S = torch.zeros(K, K, dtype=x.dtype)
            for t in range(T):
                S = torch.diag(torch.exp(g[b, t, h])) @ S
                S = S + beta[b, t, h] * torch.outer(k[b, t, h], v[b, t, h] - S.T @ k[b, t, h])
                o[b, t, h] = S.T @ (K**-0.5 * q[b, t, h])
    o = rms(o, layer.o_norm) * torch.sigmoid(lin(x, layer.g_proj.weight)).view(B, T, H, K)
    return lin(o.reshape(B, T, H * K), layer.o_proj.weight)


def mla_by_spec(layer: GatedMLA, x, doc_BT):
    """(output, per-head max of the allowed pre-softmax logits); doc_BT [B, T]: each token's document."""
    B, T, _ = x.shape
    H, N, R, V = layer.n_heads, layer.nope, layer.rope, layer.v_dim
    q = lin(rms(lin(x, layer.wq_a.weight), layer.q_norm.weight), layer.wq_b.weight).view(B, T, H, N + R)
    ckr = lin(x, layer.wkv_a.weight)
    c, kr = ckr[..., :layer.kv_lora], ckr[..., layer.kv_lora:]
    kv = lin(rms(c, layer.kv_norm.weight), layer.wkv_b.weight).view(B, T, H, N + V)
    k = torch.cat([kv[..., :N], kr[:, :, None, :].expand(B, T, H, R)], dim=-1)  # never rotated
    v = kv[..., N:]
    logits = torch.einsum("bihd,bjhd->bhij", q, k) * (N + R) ** -0.5
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    allowed = (j <= i)[None, None] & (doc_BT[:, None, :, None] == doc_BT[:, None, None, :])
    max_logit = logits.masked_fill(~allowed, -math.inf).amax(dim=(0, 2, 3))
    o = torch.einsum("bhij,bjhd->bihd", torch.softmax(logits.masked_fill(~allowed, -math.inf), -1), v)
    o = o * torch.sigmoid(lin(x, layer.w_gate.weight)).view(B, T, H, V)
    return lin(o.reshape(B, T, H * V), layer.wo.weight), max_logit


def ffn_by_spec(ffn: SituGluFFN, x):
    return lin(situ_glu(lin(x, ffn.w1.weight), lin(x, ffn.w3.weight)), ffn.w2.weight)


def latent_moe_by_spec(moe: LatentMoE, x_TD):
    r = moe.router
    s = torch.sigmoid(lin(x_TD, r.weight))
    chosen = torch.topk(s + r.qb_bias.to(F64), r.top_k, dim=-1).indices
    p = s.gather(1, chosen) / s.gather(1, chosen).sum(-1, keepdim=True)
    z = lin(x_TD, moe.w_down.weight)
    y = torch.zeros_like(z)
    for t in range(x_TD.shape[0]):
        for slot in range(r.top_k):
            e = chosen[t, slot]
            # expert weights are stored [E, L, F] / [E, F, L]: z W1_e^T is z @ w1[e]
            y[t] += p[t, slot] * situ_glu(z[t] @ moe.w1[e], z[t] @ moe.w3[e]) @ moe.w2[e]
    return ffn_by_spec(moe.shared, x_TD) + lin(rms(y, moe.latent_norm.weight), moe.w_up.weight), chosen, s


def mix_by_spec(sources, query):
    """sum_n softmax_n(<RMSNorm(v_n), q>) v_n, RMSNorm without a weight."""
    v = torch.stack(sources)
    w = torch.softmax(rms(v) @ query, dim=0)
    return (w[..., None] * v).sum(0)


def newton_schulz_by_spec(G, steps=5):
    a, b, c = 3.4445, -4.7750, 2.0315
    X = G / torch.linalg.matrix_norm(G)
    for _ in range(steps):
        A = X @ X.T
        X = a * X + b * A @ X + c * A @ A @ X
    return X


# --- layers ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("lower_bound", [-5.0, None], ids=["safe-gate", "softplus-gate"])
def test_kda_layer_is_the_documented_equations(lower_bound):
    impl = reference_impl()
    layer = KimiDeltaAttention(DEBUG.replace(kda_gate_lower_bound=lower_bound), impl.kda, impl.conv).double()
    _randomise_(layer, 0)
    x = torch.randn(2, 70, DEBUG.dim, generator=_gen(1), dtype=F64)  # one full 64-token chunk and a ragged tail
    with torch.no_grad():
        got = layer(x, Documents.build(2, 70, None, x.device))
        want = kda_by_spec(layer, x, lower_bound)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("packed", [False, True], ids=["whole-rows", "packed"])
def test_mla_layer_and_its_max_logit_are_the_documented_equations(packed):
    T = 24
    cu = torch.tensor([0, 5, 24, 24 + 17, 48]) if packed else None
    doc = torch.zeros(2, T, dtype=torch.long)
    if packed:
        doc.view(-1)[:] = torch.repeat_interleave(torch.arange(4), cu.diff())
    else:
        doc[1] = 1
    layer = GatedMLA(DEBUG).double().train()
    _randomise_(layer, 2)
    x = torch.randn(2, T, DEBUG.dim, generator=_gen(3), dtype=F64)
    with torch.no_grad():
        got = layer(x, Documents.build(2, T, cu, x.device))
        want, want_max = mla_by_spec(layer, x, doc)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(layer.pop_max_logit(), want_max, rtol=1e-12, atol=1e-12)


def test_latent_moe_routes_on_biased_scores_and_weights_with_unbiased_ones():
    moe = LatentMoE(DEBUG, reference_impl().experts).double().eval()  # eval: Quantile Balancing does not move
    _randomise_(moe, 4)
    x = torch.randn(40, DEBUG.dim, generator=_gen(5), dtype=F64)
    with torch.no_grad():
        moe.router.qb_bias.copy_(torch.linspace(-0.4, 0.4, DEBUG.n_experts))
        got = moe(x[None])[0]
        want, chosen, s = latent_moe_by_spec(moe, x)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)
    # the bias changed some selections (so the test sees where it enters), and is in no weight
    assert not torch.equal(chosen.sort(-1).values, torch.topk(s, DEBUG.top_k, dim=-1).indices.sort(-1).values)
    ids, weights = moe.router(x)
    torch.testing.assert_close(weights, s.gather(1, ids) / s.gather(1, ids).sum(-1, keepdim=True))
    assert moe.shared.w1.weight.shape == (DEBUG.n_shared_experts * DEBUG.expert_hidden, DEBUG.dim)


def test_dense_ffn_is_situ_glu_and_sits_in_layer_zero_only():
    model = K3Model(DEBUG, reference_impl())
    kinds = [(b.is_mla, type(b.attn).__name__, type(b.ffn).__name__) for b in model.layers.values()]
    assert kinds == [(False, "KimiDeltaAttention", "SituGluFFN"), (False, "KimiDeltaAttention", "LatentMoE"),
                     (False, "KimiDeltaAttention", "LatentMoE"), (True, "GatedMLA", "LatentMoE")]
    ffn = model.layers["0"].ffn.double()
    _randomise_(ffn, 6)
    assert ffn.w1.weight.shape == (DEBUG.dense_hidden, DEBUG.dim)
    x = torch.randn(3, 5, DEBUG.dim, generator=_gen(7), dtype=F64) * 8  # large enough that both tanh saturate
    with torch.no_grad():
        torch.testing.assert_close(ffn(x), ffn_by_spec(ffn, x), rtol=1e-12, atol=1e-12)


def test_quantile_balancing_one_update_by_hand():
    """b <- b - eta c, c_j the (1 - k/E) quantile of m_ij = s_ij + b_j - alpha_i, then b <- b - mean(b).

    Exact quantiles here, the code's 1,024-bin histogram there: they agree within a bin's width.
    """
    E, k, D, T = 16, 4, 32, 4096
    for eta in (1.0, 0.5):
        torch.manual_seed(0)
        router = QuantileBalancedRouter(D, E, k, eta=eta)
        router.reset_parameters()
        with torch.no_grad():
            router.weight[:3] += 0.3  # skewed: experts 0-2 too popular
            router.qb_bias.copy_(torch.randn(E, generator=_gen(8)) * 0.05)
            router.qb_bias.sub_(router.qb_bias.mean())
        b0 = router.qb_bias.double().clone()
        x = torch.randn(T, D, generator=_gen(9))
        s = torch.sigmoid(x.double() @ router.weight.detach().double().T)
        biased = s + b0
        alpha = torch.topk(biased, k + 1, dim=-1).values[:, k]
        margins = biased - alpha[:, None]
        c = torch.quantile(margins, 1 - k / E, dim=0)
        want = b0 - eta * c
        want -= want.mean()
        router.train()(x)
        bin_width = 2 * (1 + float(b0.max() - b0.min())) / 1024
        torch.testing.assert_close(router.qb_bias.double(), want, rtol=0, atol=bin_width)
        # the sign: an expert picked by more than k/E of the tokens (c_j > 0) loses bias against one picked by fewer
        rates = (margins > 0).double().mean(0)
        moved = router.qb_bias.double() - b0
        over, under = rates > 1.5 * k / E, rates < 0.5 * k / E
        assert over.any() and under.any() and (c[over] > 0).all() and (c[under] < 0).all()
        assert moved[over].max() < moved[under].min()
        assert abs(float(router.qb_bias.sum())) < 1e-5


def test_block_attention_residual_stream_by_hand():
    """Block 0 the embedding, a block closed every attn_res_block_size layers, every sublayer (and the final norm)
    fed the pseudo-query mix of the completed blocks and the open block's partial sum, each sublayer's output added
    to that partial sum. The sublayers themselves are the model's (their own tests pin them)."""
    torch.manual_seed(0)
    model = K3Model(DEBUG, reference_impl())
    model.init_weights(0)
    assert all(p.eq(0).all() for n, p in model.named_parameters() if n.endswith(".query"))
    model = model.double().eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith(".query"):
                p.normal_(0, 0.7)
    ids = torch.randint(0, DEBUG.vocab_size, (2, 16), generator=_gen(10))
    docs = Documents.build(2, 16, None, ids.device)
    with torch.no_grad():
        blocks, partial = [model.tok_embeddings.weight[ids]], None
        for i, block in enumerate(model.layers.values()):
            a = block.attn_sublayer(mix_by_spec(blocks + ([partial] if partial is not None else []),
                                                block.attn_mix.query), docs)
            partial = a if partial is None else partial + a
            partial = partial + block.ffn_sublayer(mix_by_spec(blocks + [partial], block.ffn_mix.query))
            if (i + 1) % DEBUG.attn_res_block_size == 0:
                blocks, partial = blocks + [partial], None
        sources = blocks + ([partial] if partial is not None else [])
        want = rms(mix_by_spec(sources, model.final_mix.query), model.norm.weight)
        got = model.hidden(ids)
    assert len(blocks) == 1 + DEBUG.n_layers // DEBUG.attn_res_block_size
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)


def test_structure_no_biases_norm_eps_and_constants():
    model = K3Model(DEBUG, reference_impl())
    assert all(m.bias is None for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert all(m.eps == NORM_EPS for m in model.modules() if isinstance(m, RMSNorm))
    assert all(m.eps == NORM_EPS for n, m in model.named_modules() if n.endswith("_mix"))
    kda, mla = model.layers["0"].attn, model.layers["3"].attn
    assert kda.q_conv.shape == (DEBUG.kda_heads * DEBUG.kda_head_dim, 1, 4) and kda.gate_lower_bound == -5.0
    assert mla.scale == (DEBUG.qk_nope_dim + DEBUG.qk_rope_dim) ** -0.5
    assert model.tok_embeddings.weight.data_ptr() != model.output.weight.data_ptr()  # untied
    assert isinstance(model.layers["1"].ffn.router.qb_bias, torch.Tensor)
    assert "layers.1.ffn.router.qb_bias" in model.state_dict()  # persistent, checkpointed
    assert not any(n.endswith("qb_bias") for n, _ in model.named_parameters())  # never a Parameter
    assert model.layers["1"].ffn.router.qb_bias.dtype == torch.float32


def test_initialisation():
    torch.manual_seed(0)
    model = K3Model(DEBUG.replace(kda_heads=4), reference_impl())
    model.init_weights(0)
    for block in model.layers.values():
        if not block.is_mla:
            attn = block.attn
            assert attn.A_log.eq(0).all()
            dt = F.softplus(attn.dt_bias.double())
            assert dt.min() >= 1e-3 * (1 - 1e-6) and dt.max() <= 1e-1 * (1 + 1e-6)
            log_dt = dt.log()  # log-uniform: the logs spread evenly over [log 1e-3, log 1e-1]
            assert abs(float(log_dt.mean()) - math.log(1e-2)) < 0.3 and float(log_dt.std()) > 1.0
            w = torch.cat([lin_.weight.flatten() for lin_ in (attn.q_proj, attn.k_proj, attn.v_proj, attn.g_proj)])
            assert abs(float(w.std()) / 0.02 - 1) < 0.1 and float(w.abs().max()) <= 0.06
            conv = torch.cat([attn.q_conv.flatten(), attn.k_conv.flatten(), attn.v_conv.flatten()])
            assert abs(float(conv.std()) / 0.02 - 1) < 0.15 and float(conv.abs().max()) <= 0.06
            assert attn.o_norm.eq(1).all()
    for name, p in model.named_parameters():
        if name.endswith(".query"):
            assert p.eq(0).all(), name
        elif name.endswith(("norm.weight", ".o_norm")):
            assert p.eq(1).all(), name
        elif name == "tok_embeddings.weight":
            assert abs(float(p.std()) - 1) < 0.05, name
        elif name == "output.weight":
            std = DEBUG.dim**-0.5
            assert abs(float(p.std()) / std - 1) < 0.1 and float(p.abs().max()) <= 3 * std, name
        elif p.ndim >= 2 and not name.endswith(".dt_bias"):  # projections, FFNs, experts, routers, convolutions
            assert abs(float(p.std()) / 0.02 - 1) < 0.2 and float(p.abs().max()) <= 0.06, name
    assert all(r.qb_bias.eq(0).all() for r in model.moe_routers().values())


# --- flavors -----------------------------------------------------------------------------------------------------


def _split(a):
    return a.n_layers - len(a.mla_layers), len(a.mla_layers)


def test_flavors_have_the_documented_shapes():
    d, t, m, k3 = (FLAVORS[n] for n in ("debug", "tiny", "k3-mini", "k3"))
    assert (d.dim, d.n_layers, _split(d), d.n_experts, d.top_k) == (64, 4, (3, 1), 8, 2)
    assert 128 <= t.dim <= 256 and 4 <= t.n_layers <= 8 and (t.n_experts, t.top_k) == (16, 4)
    assert (m.dim, m.n_layers, _split(m), m.vocab_size, m.top_k, m.n_shared_experts) == (512, 12, (9, 3), 163840, 6, 1)
    assert m.n_experts % 8 == 0 and m.expert_hidden % 32 == 0
    assert (k3.dim, k3.n_layers, len(k3.mla_layers), k3.mla_layers[-2:]) == (7168, 93, 24, (91, 92))
    assert (k3.kda_heads, k3.kda_head_dim, k3.q_lora_rank, k3.kv_lora_rank) == (96, 128, 1536, 512)
    assert (k3.n_experts, k3.top_k, k3.n_shared_experts, k3.attn_res_block_size) == (896, 16, 2, 12)
    for a in FLAVORS.values():
        assert a.mla_layers[-1] == a.n_layers - 1  # the last layer attends globally
        pc = count_params(a)
        moe_layers = a.n_layers - a.n_dense_layers
        inactive = moe_layers * a.n_experts * 3 * a.latent_dim * a.expert_hidden * (a.n_experts - a.top_k) // a.n_experts
        assert pc.active == pc.total - a.vocab_size * a.dim - inactive


# --- optimizer ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(12, 20), (20, 12), (16, 16)])
def test_newton_schulz_is_the_documented_quintic(shape):
    # NOTE: the code divides by ||G||_F + 1e-7; a large G makes that eps invisible at this tolerance.
    G = torch.randn(shape, generator=_gen(11), dtype=F64) * 1e3
    torch.testing.assert_close(newton_schulz(G, dtype=F64), newton_schulz_by_spec(G), rtol=1e-9, atol=1e-9)


# Which optimizer and decay each parameter gets, from the spec's lists (docs/k3.md §6.1, §6.2), by name.
ADAMW_NO_DECAY = (".A_log", ".dt_bias", ".query", "norm.weight", ".o_norm")
ADAMW_DECAY = ("tok_embeddings.weight", "output.weight", "_conv", ".router.weight")


def _blocks_by_spec(name, p):
    """The spec's Muon blocks of parameter `name`: one per head, per expert, or the whole matrix."""
    if p.ndim == 3:
        return list(p.unbind(0))
    heads = {".q_proj.": DEBUG.kda_heads, ".k_proj.": DEBUG.kda_heads, ".v_proj.": DEBUG.kda_heads,
             ".wq_b.": DEBUG.mla_heads, ".wkv_b.": DEBUG.mla_heads}
    h = next((n for key, n in heads.items() if key in name), 1)
    return list(p.chunk(h, dim=0))


def test_one_optimizer_step_of_every_parameter_by_hand():
    """Muon (Nesterov from zero momentum: d = (1 + 0.95) g) on the spec's blocks, each scaled by
    0.2 sqrt(max(rows, cols)); AdamW's first step (g / (|g| + eps)); decoupled decay 0.1 except on norms, A_log,
    dt_bias and pseudo-queries."""
    torch.manual_seed(0)
    model = K3Model(DEBUG, reference_impl()).double()
    model.init_weights(0)
    hints = model.optim_hints()
    lr, wd = 0.01, 0.1
    opts = build_optimizers(model.named_parameters(), lambda n, _p: ParamSpec(**hints[n]), lr=lr, weight_decay=wd,
                            ns_dtype=F64)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    gen = _gen(12)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen, dtype=F64)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    opts.step()
    muon = set(opts.names["muon"])
    for name, p in model.named_parameters():
        p0, g = before[name], grads[name]
        if name.endswith(ADAMW_NO_DECAY) or name.endswith(ADAMW_DECAY) or "norm.weight" in name:
            assert name not in muon, name
            decay = 0.0 if (name.endswith(ADAMW_NO_DECAY) or "norm.weight" in name) else wd
            want = p0 * (1 - lr * decay) - lr * g / (g.abs() + 1e-8)
        else:
            assert name in muon and p.ndim >= 2, name
            update = torch.cat([newton_schulz_by_spec(1.95 * blk) * 0.2 * math.sqrt(max(blk.shape))
                                for blk in _blocks_by_spec(name, g)]).view(g.shape)
            want = p0 * (1 - lr * wd) - lr * update
        torch.testing.assert_close(p.detach(), want, rtol=1e-7, atol=1e-9, msg=name)


def test_qk_clip_after_a_step_brings_each_clipped_head_to_tau():
    """After the step hook, the largest logit of a head that exceeded tau is exactly tau; other heads keep theirs."""
    torch.manual_seed(0)
    model = K3Model(DEBUG, reference_impl()).double()
    model.init_weights(0)
    layer = model.layers["3"].attn
    with torch.no_grad():
        layer.wq_b.weight[: DEBUG.qk_nope_dim + DEBUG.qk_rope_dim] *= 400.0  # head 0 only
        layer.wkv_b.weight.mul_(8.0)
    ids = torch.randint(0, DEBUG.vocab_size, (2, 32), generator=_gen(13))
    cfg = SimpleNamespace(optimizer=SimpleNamespace(qk_clip_tau=100.0), model=SimpleNamespace(qb_update=False),
                          training=SimpleNamespace(compute_dtype="float32"))
    hooks = K3StepHooks(model, cfg, torch.device("cpu"), None)
    model.train()
    with torch.no_grad():
        model.hidden(ids)
    hooks.after_step(torch.tensor(False))
    first = hooks.qk_clip_max_logits[3]
    assert first[0] > 100.0 and first[1] < 100.0, first
    with torch.no_grad():
        model.hidden(ids)
    after = layer.pop_max_logit()
    torch.testing.assert_close(after[0], torch.tensor(100.0, dtype=F64), rtol=1e-9, atol=0)
    torch.testing.assert_close(after[1], first[1], rtol=1e-12, atol=0)


def test_router_scores_stay_float32_under_bf16_autocast():
    """s = sigmoid(W_router x) in float32 (docs/k3.md §2.3), also inside the trainer's bf16 autocast."""
    torch.manual_seed(0)
    router = QuantileBalancedRouter(512, 176, 6)
    router.reset_parameters()
    router.eval()
    x = torch.randn(256, 512, generator=_gen(14)).bfloat16()
    with torch.no_grad():
        want_ids, want_w = router(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ids, w = router(x)
    assert w.dtype == torch.float32
    assert torch.equal(ids, want_ids) and torch.equal(w, want_w)


def test_router_scores_train_float32_values_with_autocasts_gradient():
    """Training under bf16 autocast: the scores are the float32 product, while the router weight's gradient is the
    one autocast's own product gives, as every other weight's (a float32 backward cost two float32 products of the
    forward's size per MoE layer, at a GPU's non-tensor-core float32 rate)."""
    from titan_k3.models.k3.moe import router_logits

    x = torch.randn(64, 96, generator=_gen(30)).bfloat16()
    w = (torch.randn(12, 96, generator=_gen(31)) * 0.05).requires_grad_()
    up = torch.randn(64, 12, generator=_gen(32))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = router_logits(x, w)
    assert got.dtype == torch.float32
    assert torch.equal(got, x.float() @ w.detach().t())
    (got * up).sum().backward()
    w_low = w.detach().clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ((x @ w_low.t()).float() * up).sum().backward()
    assert torch.equal(w.grad, w_low.grad)

    w.grad = None  # no autocast: float32 both ways
    (router_logits(x.float(), w) * up).sum().backward()
    torch.testing.assert_close(w.grad, up.t() @ x.float(), rtol=1e-6, atol=1e-6)


