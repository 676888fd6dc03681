"""MLA's flex_attention path on CUDA, at k3-mini's head widths (q/k 192, v 128): output and gradients against
SDPA's math path on the dense document mask, isolation between documents, a compiled sublayer around it, the
whole model through `kernels.attention = flex`, and no host sync (the checks shared with the varlen path are in
mla_checks.py).
"""

import pytest
import torch
from mla_checks import (
    E, T, assert_documents_isolated, assert_model_matches_math, assert_no_host_sync, docs_of, inputs, math64, rel_rms,
    with_grads,
)
from torch.nn.attention import SDPBackend

from titan_k3.models.k3.args import FLAVORS
from titan_k3.models.k3.mla import FLEX, GatedMLA, compiled_flex_attention

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _flex(docs):
    return lambda q, k, v: compiled_flex_attention(q, k, v, block_mask=docs.block_mask(), scale=E**-0.5)


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "whole-rows"])
# NOTE: no float32: flex's tiles for 192-wide heads (padded to 256) do not fit float32 in shared memory on an
# H200 (279,808 of 232,448 bytes); the config refuses flex without bf16 compute (validate.py).
@pytest.mark.parametrize("dtype, tol", [(torch.float16, 5e-3), (torch.bfloat16, 2e-2)], ids=["fp16", "bf16"])
def test_flex_matches_dense_mask_math(packed, dtype, tol):
    """Output and dq, dk, dv within tol (relative RMS) of float64 math on the dense mask."""
    docs = docs_of(packed)
    q, k, v, do = inputs(dtype)
    out = with_grads(_flex(docs), q, k, v, do)
    ref = with_grads(math64(docs), q, k, v, do)
    for name, x, r in zip(("o", "dq", "dk", "dv"), out, ref):
        assert rel_rms(x, r) < tol, (name, rel_rms(x, r))


def test_no_token_attends_or_sends_gradient_across_a_document():
    """Changing one document's q, k, v leaves every other token's output and gradients unchanged."""
    assert_documents_isolated(_flex)


def test_flex_inside_a_compiled_sublayer_matches_eager_math():
    """Two compiled MLA sublayers share one Documents whose BlockMask was built before them, as under
    parallelize.apply_compile; no graph break, and outputs and parameter gradients match the eager math path (bf16)."""
    args = FLAVORS["k3-mini"]
    torch.manual_seed(0)
    flex = [GatedMLA(args, [FLEX]).cuda() for _ in range(2)]
    math = [GatedMLA(args, [SDPBackend.MATH]).cuda() for _ in range(2)]
    for f, m in zip(flex, math):
        f.reset_parameters()
        m.load_state_dict(f.state_dict())
        f.track_max_logit = m.track_max_logit = False

    def sublayer(layer, x, docs):
        return layer(x, docs)

    compiled = torch.compile(sublayer, fullgraph=True)
    x = torch.randn(2, T, args.dim, device="cuda")
    docs = docs_of(True)
    mask = docs.block_mask()  # built before the compiled sublayers, as K3Model.hidden does
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = compiled(flex[1], compiled(flex[0], x, docs), docs).float()
        ref_docs = docs_of(True)
        ref = math[1](math[0](x, ref_docs), ref_docs).float()
    assert docs.block_mask() is mask
    assert rel_rms(out, ref) < 2e-2
    out.square().sum().backward()
    ref.square().sum().backward()
    for f, m in zip(flex, math):
        for (name, p), r in zip(f.named_parameters(), m.parameters()):
            assert rel_rms(p.grad, r.grad) < 5e-2, name


def test_model_with_flex_attention_matches_math():
    """`kernels.attention = flex` reaches every MLA layer: the same loss and gradients as SDPA's math path."""
    assert_model_matches_math("flex", [FLEX])


def test_block_mask_and_flex_do_not_sync():
    """Building the BlockMask from host boundaries, flex forward and backward: the host never waits for the GPU."""
    assert_no_host_sync(_flex)
