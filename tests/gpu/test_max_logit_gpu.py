"""kernels.max_logit on CUDA: bf16 at the k3-mini training shape (B8 T4096 H4 E192) against the reference."""

import pytest
import torch

from kernels.max_logit import max_logit_per_head, max_logit_per_head_reference
from titan_k3.models.k3.documents import Documents

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

B, T, H, E = 8, 4096, 4, 192
SCALE = E**-0.5


def _qk(dtype, seed=0, shape=(B, T, H, E)):
    """q, k [B, H, T, E] as MLA passes them: transposed views of [B, T, H, E] tensors."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(*shape, device="cuda", generator=gen).to(dtype).transpose(1, 2) for _ in range(2)]


def _packed_pos(batch, seq, seed=0):
    """Documents.pos_BT of documents of 1 to ~2000 tokens (mean ~1000), every row start a document start."""
    gen = torch.Generator().manual_seed(seed)
    cuts = [0]
    for b in range(batch):
        while cuts[-1] < (b + 1) * seq:
            cuts.append(min((b + 1) * seq, cuts[-1] + int(torch.randint(1, 2000, (1,), generator=gen))))
    return Documents.build(batch, seq, torch.tensor(cuts), torch.device("cuda")).pos_BT


@pytest.mark.parametrize("packed", [False, True], ids=["causal", "packed"])
def test_bf16_training_shape_matches_float32_reference(packed):
    """bf16 products are exact in float32: ours is the float32 reference up to summation order."""
    q, k = _qk(torch.bfloat16)
    pos = _packed_pos(B, T) if packed else None
    got = max_logit_per_head(q, k, SCALE, pos)
    ref = max_logit_per_head_reference(q.float(), k.float(), SCALE, pos)
    assert got.dtype == torch.float32 and got.shape == (H,) and torch.isfinite(got).all()
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_packed_documents_hide_a_huge_logit_across_a_boundary():
    q, k = _qk(torch.bfloat16, seed=1)
    pos = _packed_pos(B, T, seed=1)
    b, i = 3, int((pos[3] == 0).nonzero()[2])  # the third document start of row 3
    q[..., 0], k[..., 0] = 0.0, 0.0  # the planted direction: every other product stays as it was
    q[b, 2, i, 0], k[b, 2, :i, 0] = 50.0, 50.0  # the document's first query, every key of the earlier documents
    got = max_logit_per_head(q, k, SCALE, pos)
    assert got.max() < 100
    ref = max_logit_per_head_reference(q.float(), k.float(), SCALE, pos)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_float32_and_float16_match_float64_reference():
    for dtype in (torch.float32, torch.float16):
        q, k = _qk(dtype, seed=2, shape=(2, 1000, 3, 192))
        pos = _packed_pos(2, 1000, seed=2)
        got = max_logit_per_head(q, k, SCALE, pos)
        ref = max_logit_per_head_reference(q.double(), k.double(), SCALE, pos)
        torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)


def test_deterministic_and_compiles_with_inductor():
    q, k = _qk(torch.bfloat16, seed=3)
    pos = _packed_pos(B, T, seed=3)
    first = max_logit_per_head(q, k, SCALE, pos)
    assert torch.equal(first, max_logit_per_head(q, k, SCALE, pos))
    compiled = torch.compile(lambda q, k, pos: max_logit_per_head(q, k, SCALE, pos) * 1.0, fullgraph=True)
    assert torch.equal(compiled(q, k, pos), first)
