"""What the GPU tests of MLA's document-masked attention paths (flex, flash varlen) check alike, at k3-mini's head
widths (q/k 192, v 128) on ragged packed documents: the reference, isolation between documents, the whole model
through `kernels.attention`, and no host sync. Each path's test file passes its attention as `path(docs) ->
fn(q, k, v)`.
"""

import itertools

import torch
import torch.nn.functional as F
from host_sync import run_without_host_sync
from torch.nn.attention import SDPBackend, sdpa_kernel

from titan_k3.models.k3.documents import Documents

H, E, V = 4, 192, 128
T = 1000  # not a multiple of any kernel block (flex's 128-token blocks included)
LENGTHS = ([1, 15, 64, 200, 720], [200, 64, 15, 1, 720])
CU = torch.tensor([0, *itertools.accumulate(n for row in LENGTHS for n in row)])


def rel_rms(x, ref):
    x, ref = x.double(), ref.double()
    return ((x - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()).item()


def docs_of(packed: bool, cu=CU) -> Documents:
    return Documents.build(2, T, cu if packed else None, torch.device("cuda"))


def inputs(dtype, seed=0):
    """q, k [2, H, T, E], v and the output's gradient [2, H, T, V], on CUDA in `dtype`."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    return tuple(torch.randn(2, H, T, d, device="cuda", generator=g).to(dtype) for d in (E, E, V, V))


def with_grads(fn, q, k, v, do):
    """[o, dq, dk, dv] of fn(q, k, v) with the output's gradient `do`."""
    leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v)]
    o = fn(*leaves)
    return [o.detach(), *torch.autograd.grad(o, leaves, do.to(o.dtype))]


def math64(docs):
    """SDPA's math path in float64 on the documents' dense mask: the reference of every path."""
    mask = docs.attention_mask()

    def fn(q, k, v):
        with sdpa_kernel([SDPBackend.MATH]):
            return F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask,
                                                  is_causal=mask is None, scale=E**-0.5)

    return fn


def assert_documents_isolated(path) -> None:
    """Changing one document's q, k, v leaves every other token's output and gradients unchanged.

    NOTE: within the run-to-run noise of the path itself (flash's backward adds dq's key blocks with atomics, so
    two identical runs differ in dq by an ulp or so, 4.9e-4 seen; flex is exact); a leak from the x10 document
    would move the others by far more than that.
    """
    docs = docs_of(True)
    q, k, v, do = inputs(torch.bfloat16)
    other = (slice(0, 1), slice(None), slice(16, 80))  # row 0's 64-token document
    q2, k2, v2 = q.clone(), k.clone(), v.clone()
    for t in (q2, k2, v2):
        t[other] = torch.randn_like(t[other]) * 10
    a, b = with_grads(path(docs), q, k, v, do), with_grads(path(docs), q2, k2, v2, do)
    untouched = torch.ones(2, T, dtype=torch.bool, device="cuda")
    untouched[0, 16:80] = False
    floor = max((x - y).abs().max().item() for x, y in zip(a, with_grads(path(docs), q, k, v, do)))
    for x, y in zip(a, b):
        torch.testing.assert_close(x.transpose(1, 2)[untouched], y.transpose(1, 2)[untouched], rtol=0,
                                   atol=max(2 * floor, 1e-6))
    assert (a[0][other] - b[0][other]).abs().max() > 1e-2


def assert_model_matches_math(attention: str, backends: list) -> None:
    """`kernels.attention = attention` reaches every MLA layer (its backends are `backends`): the same loss and
    attention gradients as SDPA's math path, on the tiny flavor with packed documents, bf16 compute."""
    from titan_k3.config import load_job_config
    from titan_k3.models.k3.args import get_flavor
    from titan_k3.models.k3.impl import resolve_impl
    from titan_k3.models.k3.model import K3Model

    device = torch.device("cuda")
    losses, grads = {}, {}
    for name, expected in ((attention, backends), ("math", [SDPBackend.MATH])):
        impl = resolve_impl(load_job_config(["--kernels.attention", name, "--training.compute_dtype",
                                               "bfloat16"]).kernels, device)
        assert not [c for c in impl.fallbacks if c.op == "attention"]
        model = K3Model(get_flavor("tiny", 8192), impl).to(device)
        model.init_weights(seed=0)
        assert all(layer.sdpa_backends == expected for layer in model.mla_layers().values())
        ids = torch.randint(0, 8192, (2, 256), generator=torch.Generator().manual_seed(0)).to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(ids, ids, torch.tensor([0, 100, 256, 300, 512]))
        out.loss_sum.backward()
        losses[name] = out.loss_sum.item()
        grads[name] = {n: p.grad for n, p in model.named_parameters() if ".attn." in n and p.grad is not None}
    assert abs(losses[attention] - losses["math"]) < 1e-2 * abs(losses["math"])
    for name, g in grads["math"].items():
        assert rel_rms(grads[attention][name], g) < 5e-2, name


def assert_no_host_sync(path) -> None:
    """Building the documents from host boundaries, the path's forward and backward: the host never waits for
    the GPU; the result still matches the reference."""
    q, k, v, do = inputs(torch.bfloat16)

    def step():
        return with_grads(path(Documents.build(2, T, CU, torch.device("cuda"))), q, k, v, do)

    out = run_without_host_sync(step)
    ref = with_grads(math64(docs_of(True)), q, k, v, do)
    for name, x, r in zip(("o", "dq", "dk", "dv"), out, ref):
        assert rel_rms(x, r) < 2e-2, (name, rel_rms(x, r))
