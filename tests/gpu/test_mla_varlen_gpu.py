"""MLA's flash variable-length path on CUDA, at k3-mini's head widths (q/k 192, v 128): output and gradients
against float64 math on the dense document mask, isolation between documents, compiled sublayers around it with
changing document counts, the whole model through `kernels.attention = varlen`, and no host sync.
"""

import itertools

import pytest
import torch
import torch.nn.functional as F
from host_sync import run_without_host_sync
from torch.nn.attention import SDPBackend, sdpa_kernel

from titan_k3.models.k3.args import FLAVORS
from titan_k3.models.k3.documents import Documents
from titan_k3.models.k3.mla import VARLEN, GatedMLA, document_varlen_attention

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

H, E, V = 4, 192, 128
T = 1000  # not a multiple of any kernel block
LENGTHS = ([1, 15, 64, 200, 720], [200, 64, 15, 1, 720])
CU = torch.tensor([0, *itertools.accumulate(n for row in LENGTHS for n in row)])


def _rel_rms(x, ref):
    x, ref = x.double(), ref.double()
    return ((x - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()).item()


def _docs(packed: bool, cu=CU) -> Documents:
    return Documents.build(2, T, cu if packed else None, torch.device("cuda"))


def _inputs(dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(2, H, T, d, device="cuda", generator=g).to(dtype) for d in (E, E, V, V))


def _with_grads(fn, q, k, v, do):
    leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v)]
    o = fn(*leaves)
    return [o.detach(), *torch.autograd.grad(o, leaves, do.to(o.dtype))]


def _varlen(docs):
    return lambda q, k, v: document_varlen_attention(q, k, v, docs.cu_seqlens_i32, E**-0.5)


def _math64(docs):
    mask = docs.attention_mask()

    def fn(q, k, v):
        with sdpa_kernel([SDPBackend.MATH]):
            return F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask,
                                                  is_causal=mask is None, scale=E**-0.5)

    return fn


@pytest.mark.parametrize("dtype, tol", [(torch.float16, 5e-3), (torch.bfloat16, 2e-2)], ids=["fp16", "bf16"])
def test_varlen_matches_dense_mask_math(dtype, tol):
    """Output and dq, dk, dv within tol (relative RMS) of float64 math on the dense mask; ragged documents of 1 to
    720 tokens."""
    docs = _docs(True)
    q, k, v, do = _inputs(dtype)
    out = _with_grads(_varlen(docs), q, k, v, do)
    ref = _with_grads(_math64(docs), q, k, v, do)
    for name, x, r in zip(("o", "dq", "dk", "dv"), out, ref):
        assert x.shape == r.shape, name
        assert _rel_rms(x, r) < tol, (name, _rel_rms(x, r))


def test_no_token_attends_or_sends_gradient_across_a_document():
    """Changing one document's q, k, v leaves every other token's output and gradients unchanged."""
    docs = _docs(True)
    q, k, v, do = _inputs(torch.bfloat16)
    other = (slice(0, 1), slice(None), slice(16, 80))  # row 0's 64-token document
    q2, k2, v2 = q.clone(), k.clone(), v.clone()
    for t in (q2, k2, v2):
        t[other] = torch.randn_like(t[other]) * 10
    a, b = _with_grads(_varlen(docs), q, k, v, do), _with_grads(_varlen(docs), q2, k2, v2, do)
    untouched = torch.ones(2, T, dtype=torch.bool, device="cuda")
    untouched[0, 16:80] = False
    # NOTE: flash's backward adds dq's key blocks with atomics, so two identical runs differ in dq by an ulp or
    # so (4.9e-4 seen); a leak from the x10 document would move the others by far more than that.
    floor = max((x - y).abs().max().item() for x, y in zip(a, _with_grads(_varlen(docs), q, k, v, do)))
    for x, y in zip(a, b):
        torch.testing.assert_close(x.transpose(1, 2)[untouched], y.transpose(1, 2)[untouched], rtol=0,
                                   atol=max(2 * floor, 1e-6))
    assert (a[0][other] - b[0][other]).abs().max() > 1e-2


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
            out = compiled(var, x, _docs(True, cu)).float()
            ref = math(x, _docs(True, cu)).float()
        assert _rel_rms(out, ref) < 2e-2
        var.zero_grad(), math.zero_grad()
        out.square().sum().backward()
        ref.square().sum().backward()
        for (name, p), r in zip(var.named_parameters(), math.parameters()):
            assert _rel_rms(p.grad, r.grad) < 5e-2, name
    assert counter.frame_count <= 2, counter.frame_count


def test_model_with_varlen_attention_matches_math():
    """`kernels.attention = varlen` reaches every MLA layer: the same loss and gradients as SDPA's math path."""
    from titan_k3.config import load_job_config
    from titan_k3.models.k3.args import get_flavor
    from titan_k3.models.k3.impl import resolve_impl
    from titan_k3.models.k3.model import K3Model

    device = torch.device("cuda")
    losses, grads = {}, {}
    for attention in ("varlen", "math"):
        impl = resolve_impl(load_job_config(["--kernels.attention", attention, "--training.compute_dtype",
                                               "bfloat16"]).kernels, device)
        assert not [c for c in impl.fallbacks if c.op == "attention"]
        model = K3Model(get_flavor("tiny", 8192), impl).to(device)
        model.init_weights(seed=0)
        assert all((VARLEN in layer.sdpa_backends) == (attention == "varlen") for layer in model.mla_layers().values())
        ids = torch.randint(0, 8192, (2, 256), generator=torch.Generator().manual_seed(0)).to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(ids, ids, torch.tensor([0, 100, 256, 300, 512]))
        out.loss_sum.backward()
        losses[attention] = out.loss_sum.item()
        grads[attention] = {n: p.grad for n, p in model.named_parameters() if ".attn." in n and p.grad is not None}
    assert abs(losses["varlen"] - losses["math"]) < 1e-2 * abs(losses["math"])
    for name, g in grads["math"].items():
        assert _rel_rms(grads["varlen"][name], g) < 5e-2, name


def test_documents_and_varlen_do_not_sync():
    """Building the documents from host boundaries, varlen forward and backward: the host never waits for the GPU."""
    q, k, v, do = _inputs(torch.bfloat16)

    def step():
        docs = Documents.build(2, T, CU, torch.device("cuda"))
        return _with_grads(_varlen(docs), q, k, v, do)

    out = run_without_host_sync(step)
    ref = _with_grads(_math64(_docs(True)), q, k, v, do)
    for name, x, r in zip(("o", "dq", "dk", "dv"), out, ref):
        assert _rel_rms(x, r) < 2e-2, (name, _rel_rms(x, r))
