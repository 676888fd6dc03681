"""MLA's flash variable-length path on CPU: the layout around the kernel (token-major rows, values padded to the
query width and cut back, the scale, the causal window, int32 boundaries) against SDPA's math path on the dense
document mask, in float64 with gradients, and the `kernels.attention = varlen` key.

Flash attention runs on CUDA only: here `varlen_attn` is replaced by a per-document reference that checks the
kernel's contract (shapes, dtypes, one head width, causal) and computes each document alone. The kernel itself is
compared on CUDA (tests/gpu/test_mla_varlen_gpu.py).
"""

import itertools

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

from titan_k3.config import load_job_config
from titan_k3.models.k3 import mla
from titan_k3.models.k3.args import FLAVORS
from titan_k3.models.k3.documents import Documents
from titan_k3.models.k3.impl import _attention_backends, resolve_impl
from titan_k3.models.k3.mla import VARLEN, GatedMLA

ARGS = FLAVORS["debug"]  # 2 heads, q/k 16 + 8 = 24 wide, values 16: the values are padded
WIDE_V = FLAVORS["tiny"]  # q/k 32 + 16 = 48 wide, values 64: the queries and keys are padded
T = 300
LENGTHS = ([1, 15, 64, 200, 20], [200, 64, 15, 1, 20])
CU = torch.tensor([0, *itertools.accumulate(n for row in LENGTHS for n in row)])


def reference_varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=None, is_causal=None):
    """flash's variable-length contract on CPU: q, k, v [total, H, E] of one width, int32 boundaries, causal."""
    assert q.shape == k.shape == v.shape and q.ndim == 3, (q.shape, k.shape, v.shape)
    assert cu_q.dtype == cu_k.dtype == torch.int32 and torch.equal(cu_q, cu_k)
    assert window_size == (-1, 0) or is_causal is True, (window_size, is_causal)
    lengths = cu_q.diff()
    assert int(lengths.max()) <= max_q == max_k
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    out = torch.empty_like(q)
    for a, b in itertools.pairwise(cu_q.tolist()):
        qd, kd, vd = (t[a:b].transpose(0, 1) for t in (q, k, v))
        out[a:b] = F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=scale).transpose(0, 1)
    return out


@pytest.fixture
def varlen_on_cpu(monkeypatch):
    monkeypatch.setattr(mla, "varlen_attn", reference_varlen_attn)
    monkeypatch.setattr(mla, "VARLEN_DTYPES", (torch.float64,))


def _layers(args=ARGS):
    torch.manual_seed(0)
    var, math = GatedMLA(args, [VARLEN]), GatedMLA(args, [SDPBackend.MATH])
    var.reset_parameters()
    math.load_state_dict(var.state_dict())
    return var.double(), math.double()


@pytest.mark.parametrize("args", [ARGS, WIDE_V], ids=["values-narrower", "values-wider"])
def test_varlen_layer_matches_dense_mask_math_with_gradients(varlen_on_cpu, args):
    """Documents of 1 to 200 tokens: the layer's output and every parameter gradient equal the dense-mask math path."""
    var, math = _layers(args)
    x = torch.randn(2, T, args.dim, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    docs = Documents.build(2, T, CU, torch.device("cpu"))
    assert docs.cu_seqlens_i32.dtype == torch.int32 and torch.equal(docs.cu_seqlens_i32.long(), CU)
    out, ref = var(x, docs), math(x, Documents.build(2, T, CU, torch.device("cpu")))
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    out.square().sum().backward()
    ref.square().sum().backward()
    for (name, p), r in zip(var.named_parameters(), math.parameters()):
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-9, atol=1e-12, msg=name)
    assert docs._mask is None  # the dense [B, 1, T, T] mask is never built on this path


def test_whole_row_batches_run_causal_sdpa_not_varlen(monkeypatch):
    monkeypatch.setattr(mla, "VARLEN_DTYPES", (torch.float64,))
    calls = []
    monkeypatch.setattr(mla, "varlen_attn", lambda *a, **k: calls.append(a) or reference_varlen_attn(*a, **k))
    var, math = _layers()
    x = torch.randn(2, T, ARGS.dim, dtype=torch.float64)
    docs = Documents.build(2, T, None, torch.device("cpu"))
    torch.testing.assert_close(var(x, docs), math(x, docs))
    assert calls == []


def test_scale_is_applied_where_the_kernel_takes_none(monkeypatch):
    """torch 2.10's varlen_attn has no `scale` and uses E ** -0.5: q is scaled to give the layer's own scale."""
    monkeypatch.setattr(mla, "_VARLEN_TAKES_SCALE", False)
    monkeypatch.setattr(mla, "varlen_attn", reference_varlen_attn)
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 2, T, d, generator=g, dtype=torch.float64) for d in (24, 24, 16))
    docs = Documents.build(2, T, CU, torch.device("cpu"))
    out = mla.document_varlen_attention(q, k, v, docs.cu_seqlens_i32, 0.3)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=docs.attention_mask(), scale=0.3)
    torch.testing.assert_close(out, ref)


def test_float32_under_auto_goes_on_to_the_dense_mask(monkeypatch):
    """auto lists varlen first, but flash computes in 16 bits: a float32 batch takes the SDPA backends after it."""
    monkeypatch.setattr(mla, "varlen_attn", lambda *a, **k: pytest.fail("varlen ran on float32"))
    torch.manual_seed(0)
    var, math = GatedMLA(ARGS, [VARLEN, SDPBackend.MATH]), GatedMLA(ARGS, [SDPBackend.MATH])
    var.reset_parameters()
    math.load_state_dict(var.state_dict())
    x = torch.randn(2, T, ARGS.dim)
    torch.testing.assert_close(var(x, Documents.build(2, T, CU, torch.device("cpu"))),
                               math(x, Documents.build(2, T, CU, torch.device("cpu"))))


def test_varlen_is_refused_on_cpu_with_the_key_named():
    cfg = load_job_config(["--kernels.attention", "varlen", "--training.compute_dtype", "bfloat16"])
    with pytest.raises(ValueError, match="config key 'kernels.attention' = 'varlen'.*CUDA only"):
        resolve_impl(cfg.kernels, torch.device("cpu"))


def test_varlen_without_bf16_compute_is_refused_with_the_key_named():
    with pytest.raises(ValueError, match="config key 'kernels.attention' = 'varlen': needs training.compute_dtype"):
        load_job_config(["--kernels.attention", "varlen"])


def test_varlen_on_cuda_keeps_cudnn_for_whole_rows():
    backends, choice = _attention_backends("varlen", on_cuda=True)
    assert backends == [VARLEN, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
    assert choice.chosen == "varlen+cudnn" and not choice.fallback
