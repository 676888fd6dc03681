"""MLA's flash variable-length path on CUDA, at k3-mini's head widths (q/k 192, v 128): output and gradients
against float64 math on the dense document mask, isolation between documents, compiled sublayers around it with
changing document counts, the whole model through `kernels.attention = varlen`, and no host sync (the checks
shared with the flex path are in mla_checks.py).
"""

import pytest
import torch
from mla_checks import (
    CU, E, T, assert_documents_isolated, assert_model_matches_math, assert_no_host_sync, docs_of, inputs, math64,
    rel_rms, with_grads,
)
from torch.nn.attention import SDPBackend

from titan_k3.models.k3.args import FLAVORS
from titan_k3.models.k3.mla import VARLEN, GatedMLA, document_varlen_attention

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _varlen(docs):
    return lambda q, k, v: document_varlen_attention(q, k, v, docs.cu_seqlens_i32, E**-0.5)


@pytest.mark.parametrize("dtype, tol", [(torch.float16, 5e-3), (torch.bfloat16, 2e-2)], ids=["fp16", "bf16"])
def test_varlen_matches_dense_mask_math(dtype, tol):
    """Output and dq, dk, dv within tol (relative RMS) of float64 math on the dense mask; ragged documents of 1 to
    720 tokens."""
    docs = docs_of(True)
    q, k, v, do = inputs(dtype)
    out = with_grads(_varlen(docs), q, k, v, do)
    ref = with_grads(math64(docs), q, k, v, do)
    for name, x, r in zip(("o", "dq", "dk", "dv"), out, ref):
        assert x.shape == r.shape, name
        assert rel_rms(x, r) < tol, (name, rel_rms(x, r))


def test_no_token_attends_or_sends_gradient_across_a_document():
    """Changing one document's q, k, v leaves every other token's output and gradients unchanged."""
    assert_documents_isolated(_varlen)


def test_varlen_inside_compiled_sublayers_with_changing_document_counts():
    """Compiled MLA sublayers over three batches of 10, 4 and 7 documents: one recompile at most (the document
    count is dynamic), no graph break, and outputs and parameter gradients match the eager math path (bf16)."""
    import torch._dynamo.testing

    args = FLAVORS["k3-mini"]
    torch.manual_seed(0)
    var, math = GatedMLA(args, [VARLEN]).cuda(), GatedMLA(args, [SDPBackend.MATH]).cuda()
    var.reset_parameters()
    math.load_state_dict(var.state_dict())
    var.track_max_logit = math.track_max_logit = False
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    compiled = torch.compile(lambda layer, x, docs: layer(x, docs), fullgraph=True, backend=counter)
    batches = [CU, torch.tensor([0, 500, 1000, 1999, 2000]), torch.tensor([0, 3, 1000, 1001, 1500, 1502, 1990, 2000])]
    for cu in batches:
        x = torch.randn(2, T, args.dim, device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = compiled(var, x, docs_of(True, cu)).float()
            ref = math(x, docs_of(True, cu)).float()
        assert rel_rms(out, ref) < 2e-2
        var.zero_grad(), math.zero_grad()
        out.square().sum().backward()
        ref.square().sum().backward()
        for (name, p), r in zip(var.named_parameters(), math.parameters()):
            assert rel_rms(p.grad, r.grad) < 5e-2, name
    assert counter.frame_count <= 2, counter.frame_count


def test_model_with_varlen_attention_matches_math():
    """`kernels.attention = varlen` reaches every MLA layer: the same loss and gradients as SDPA's math path."""
    assert_model_matches_math("varlen", [VARLEN, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION])


def test_documents_and_varlen_do_not_sync():
    """Building the documents from host boundaries, varlen forward and backward: the host never waits for the GPU."""
    assert_no_host_sync(_varlen)
