"""MLA's document-masked attention on CPU: flex_attention on the documents' BlockMask against SDPA's math path on
the dense mask, isolation between documents, which path each batch takes, and the `kernels.attention` key.

torch runs flex_attention's forward on CPU but refuses its backward there: gradients are compared on CUDA
(tests/gpu/test_mla_flex_gpu.py), and 'flex' is refused on a CPU run.
"""

import itertools

import pytest
import torch
from torch.nn.attention import SDPBackend

from titan_k3.config import load_job_config
from titan_k3.models.k3 import mla
from titan_k3.models.k3.args import FLAVORS
from titan_k3.models.k3.documents import Documents
from titan_k3.models.k3.impl import _attention_backends, resolve_impl
from titan_k3.models.k3.mla import FLEX, GatedMLA

ARGS = FLAVORS["debug"]  # 2 heads, q/k 16 + 8 = 24 wide (not a power of two), values 16
T = 300  # not a multiple of flex's 128-token blocks
LENGTHS = ([1, 15, 64, 200, 20], [200, 64, 15, 1, 20])
CU = torch.tensor([0, *itertools.accumulate(n for row in LENGTHS for n in row)])


def _docs(packed: bool) -> Documents:
    return Documents.build(2, T, CU if packed else None, torch.device("cpu"))


def _layers(seed=0):
    """The same weights behind flex and behind SDPA's math path, float32, in evaluation."""
    torch.manual_seed(seed)
    flex, math = GatedMLA(ARGS, [FLEX]), GatedMLA(ARGS, [SDPBackend.MATH])
    flex.reset_parameters()
    math.load_state_dict(flex.state_dict())
    return flex.eval(), math.eval()


def _qkv(seed=0):
    g = torch.Generator().manual_seed(seed)
    H, E, V = ARGS.mla_heads, ARGS.qk_nope_dim + ARGS.qk_rope_dim, ARGS.v_head_dim
    return (torch.randn(2, H, T, d, generator=g) for d in (E, E, V))


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "whole-rows"])
def test_flex_layer_matches_dense_mask_math(packed):
    """Documents of 1, 15, 64, 200 and 20 tokens in rows of 300, and rows that are one document each."""
    flex, math = _layers()
    x = torch.randn(2, T, ARGS.dim, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out, ref = flex(x, _docs(packed)), math(x, _docs(packed))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


def test_a_token_never_attends_across_a_document():
    """Changing another document's queries, keys and values leaves every output outside it bit for bit the same."""
    flex, _ = _layers()
    q, k, v = _qkv()
    docs = _docs(True)
    other = (slice(0, 1), slice(None), slice(16, 80))  # row 0's 64-token document
    q2, k2, v2 = q.clone(), k.clone(), v.clone()
    for t in (q2, k2, v2):
        t[other] = torch.randn(t[other].shape, generator=torch.Generator().manual_seed(2)) * 10
    with torch.no_grad():
        out, out2 = flex._attend(q, k, v, docs), flex._attend(q2, k2, v2, docs)
    untouched = torch.ones(2, T, dtype=torch.bool)
    untouched[0, 16:80] = False
    assert torch.equal(out.transpose(1, 2)[untouched], out2.transpose(1, 2)[untouched])
    assert (out[other] - out2[other]).abs().max() > 1e-2


@pytest.mark.parametrize("backends, packed, flex_runs", [
    ([FLEX], True, True),
    ([FLEX], False, True),  # asked for flex alone: whole-row batches too, on a causal BlockMask
    ([FLEX, SDPBackend.MATH], True, True),
    ([FLEX, SDPBackend.MATH], False, False),  # flex for packed batches, the SDPA backends for whole rows
    ([SDPBackend.MATH], True, False),
])
def test_flex_runs_where_its_entry_says(monkeypatch, backends, packed, flex_runs):
    calls = []

    def recorder(q, k, v, block_mask, scale):
        calls.append(block_mask)
        return torch.zeros(*q.shape[:-1], v.shape[-1])

    monkeypatch.setattr(mla, "compiled_flex_attention", recorder)
    layer = GatedMLA(ARGS, backends)
    docs = _docs(packed)
    layer._attend(*_qkv(), docs)
    assert len(calls) == flex_runs
    if flex_runs:
        assert calls[0] is docs.block_mask()


def test_flex_is_refused_on_cpu_with_the_key_named():
    cfg = load_job_config(["--kernels.attention", "flex", "--training.compute_dtype", "bfloat16"])
    with pytest.raises(ValueError, match="config key 'kernels.attention' = 'flex'.*no backward on CPU"):
        resolve_impl(cfg.kernels, torch.device("cpu"))


def test_flex_without_bf16_compute_is_refused_with_the_key_named():
    with pytest.raises(ValueError, match="config key 'kernels.attention' = 'flex': needs training.compute_dtype"):
        load_job_config(["--kernels.attention", "flex"])


def test_flex_on_cuda_is_chosen_as_asked_and_auto_is_not_flex():
    """auto prefers flash varlen, then cuDNN + efficient: flex measured no faster in the compiled step."""
    backends, choice = _attention_backends("flex", on_cuda=True)
    assert backends == [FLEX] and choice.chosen == "flex" and not choice.fallback
    backends, choice = _attention_backends("auto", on_cuda=True)
    assert backends == [mla.VARLEN, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
    assert choice.chosen == "varlen+cudnn" and not choice.fallback
    backends, choice = _attention_backends("auto", on_cuda=False)
    assert backends is None and choice.fallback and "no CUDA device" in choice.reason


def test_flex_under_a_compile_backend_other_than_inductor_is_refused():
    """Another backend would run flex's unfused reference inside the compiled sublayers: a silent slow path."""
    with pytest.raises(ValueError, match="'flex' with compile.backend = 'aot_eager'"):
        load_job_config(["--kernels.attention", "flex", "--training.compute_dtype", "bfloat16",
                         "--compile.enable", "true", "--compile.backend", "aot_eager"])
    load_job_config(["--kernels.attention", "flex", "--training.compute_dtype", "bfloat16", "--compile.enable", "true"])
