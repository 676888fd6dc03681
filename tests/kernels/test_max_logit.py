"""kernels.max_logit: the Triton max logit (Triton's interpreter on CPU) against the float64 reference.

Shapes with ragged query blocks, packed documents (made by the model's own `Documents.build`),
transposed q/k views, planted logits the mask must hide, input validation, and torch.compile tracing.
"""

import os

if not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch
from torch._dynamo.utils import counters

from kernels.max_logit import kernel, max_logit_per_head, max_logit_per_head_reference
from titan_k3.models.k3.documents import Documents

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SCALE = 192**-0.5
# Document lengths cycled through within each row (the last one cut at the row's end).
LAYOUTS = {
    "causal": None,
    "mixed": [1, 15, 64, 200],
    "short": [15, 1, 1, 15],
    "long": [200, 64],
}


def documents(B: int, T: int, lengths: list[int] | None, shift: int = 0) -> torch.Tensor | None:
    """pos [B, T] as the model has it (Documents.pos_BT), every row start a document start; None: whole rows."""
    if lengths is None:
        return None
    cuts, lengths = [0], lengths[shift % len(lengths):] + lengths[: shift % len(lengths)]
    for b in range(B):
        end, n = (b + 1) * T, b
        while cuts[-1] < end:
            cuts.append(min(end, cuts[-1] + lengths[n % len(lengths)]))
            n += 1
    return Documents.build(B, T, torch.tensor(cuts), torch.device(DEVICE)).pos_BT


def qk(B, H, T, E, dtype, seed=0):
    """q, k [B, H, T, E] as the model passes them: transposed views of [B, T, H, E] tensors."""
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, T, H, E, generator=gen, dtype=torch.float64).to(DEVICE, dtype).transpose(1, 2)
            for _ in range(2))
    return q, k


def assert_exact(q, k, pos, tol=1e-5):
    """Ours on q, k against the float64 reference on the same (rounded) values: every head within tol relative.

    NOTE: relative to at least a typical logit's size (unit-variance q, k): a maximum near 0 (T = 1) is a sum
    that cancels, where float32 keeps only ~1e-7 of the terms' size.
    """
    got = max_logit_per_head(q, k, SCALE, pos)
    ref = max_logit_per_head_reference(q.double(), k.double(), SCALE, pos)
    assert got.dtype == torch.float32 and got.shape == ref.shape
    err = ((got.double() - ref).abs() / ref.abs().clamp_min(SCALE * q.shape[-1] ** 0.5)).max().item()
    assert err < tol, (got, ref)
    return got


@pytest.fixture
def small_tiles(monkeypatch):
    """16 x 16 tiles: tens of query blocks and key blocks at T ~ 100, so every walk stage runs."""
    monkeypatch.setattr(kernel, "LAUNCH", {"default": dict(BQ=16, BK=16, num_warps=4, num_stages=1)})


@pytest.mark.parametrize("T", [1, 17, 63, 65, 130])
@pytest.mark.parametrize("E", [24, 192])
@pytest.mark.parametrize("layout", ["causal", "mixed"])
def test_float32_matches_float64_reference(T, E, layout):
    q, k = qk(2, 3, T, E, torch.float32, seed=T + E)
    assert_exact(q, k, documents(2, T, LAYOUTS[layout]))


@pytest.mark.parametrize("T, E, layout", [(65, 192, "mixed"), (130, 24, "causal"), (17, 40, "short")])
def test_float16_matches_float64_reference(T, E, layout):
    """float16 products are exact in float32, so float16 is as exact as float32."""
    q, k = qk(2, 2, T, E, torch.float16, seed=T)
    assert_exact(q, k, documents(2, T, LAYOUTS[layout]))


@pytest.mark.parametrize("launch", [dict(BQ=16, BK=16), dict(BQ=32, BK=16), dict(BQ=16, BK=32)],
                         ids=["16x16", "32x16", "16x32"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_many_blocks_and_documents(monkeypatch, launch, layout):
    """Small tiles: blocks skipped before a document, unmasked blocks inside one, masked ones at the ends."""
    monkeypatch.setattr(kernel, "LAUNCH", {"default": dict(**launch, num_warps=4, num_stages=1)})
    T = 257
    for shift in range(2):
        q, k = qk(2, 2, T, 24, torch.float32, seed=shift)
        assert_exact(q, k, documents(2, T, LAYOUTS[layout], shift))


@pytest.mark.parametrize("E", [8, 16, 48, 200, 256])
def test_widths(small_tiles, E):
    """Widths under one tile's minimum, powers of two, and ones cut into two slices."""
    q, k = qk(1, 2, 40, E, torch.float32, seed=E)
    assert_exact(q, k, documents(1, 40, [15, 1, 64]))


def test_width_slices():
    assert kernel.width_slices(192) == (128, 64)
    assert kernel.width_slices(256) == (256, 0)
    assert kernel.width_slices(200) == (128, 128)
    assert kernel.width_slices(24) == (16, 16)
    assert kernel.width_slices(8) == (16, 0)


@pytest.mark.parametrize("layout", ["causal", "mixed"])
def test_planted_logits_outside_the_mask_are_not_reported(small_tiles, layout):
    """Huge logits of one query with every key above its diagonal, or with every key before its document,
    must not count (queries at document starts and ends, second rows, and each query block's first row);
    the same logit with a key inside the mask must. Each plant runs on its own row and head."""
    B, H, T, E = 2, 2, 100, 24
    pos = documents(B, T, LAYOUTS[layout])
    pos_cpu = (pos if pos is not None else torch.arange(T).expand(B, T)).cpu()
    q, k = qk(B, H, T, E, torch.float32, seed=3)
    q[..., 0], k[..., 0] = 0.0, 0.0  # the planted direction: every other product stays as it was
    big = torch.zeros(E, dtype=torch.float32, device=DEVICE)
    big[0] = 100.0  # a logit of 1e4 * SCALE ~ 720

    def planted_max(b, h, i, keys):
        """Ours and the reference on row b, head h, with query i and `keys` set to big."""
        q2, k2 = q[b:b + 1, h:h + 1].clone(), k[b:b + 1, h:h + 1].clone()
        q2[0, 0, i], k2[0, 0, keys] = big, big
        row_pos = None if pos is None else pos[b:b + 1]
        ref = max_logit_per_head_reference(q2.double(), k2.double(), SCALE, row_pos)
        return max_logit_per_head(q2, k2, SCALE, row_pos), ref

    ends = [(b, i) for b in range(B) for i in range(T) if i + 1 == T or pos_cpu[b, i + 1] == 0]
    queries = {(b, i) for b in range(B) for i in range(T) if pos_cpu[b, i] <= 1 or i % 16 == 0} | set(ends)
    first = {(b, i): i - int(pos_cpu[b, i]) for b, i in queries}
    hidden = [(b, (b + i) % H, i, slice(i + 1, T)) for b, i in queries if i + 1 < T]
    hidden += [(b, (b + i) % H, i, slice(0, first[b, i])) for b, i in queries if first[b, i] > 0]
    assert len(hidden) > (15 if layout == "causal" else 40)
    for b, h, i, keys in hidden:
        got, ref = planted_max(b, h, i, keys)
        assert got.item() < 10, (b, h, i, keys, got)
        torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)
    for b, i in ends:  # each document's last query with its own first key, and with itself
        for j in (first[b, i], i):
            got, _ = planted_max(b, (b + j) % H, i, j)
            torch.testing.assert_close(got.item(), 1e4 * SCALE, rtol=1e-6, atol=0.0)


def test_all_negative_logits_ignore_the_padding_of_ragged_blocks(small_tiles):
    """Every logit is -|u|^2 * scale < 0: rows and keys padded past T (zeros) would report 0."""
    B, H, T, E = 2, 3, 37, 24
    u = torch.randn(E, generator=torch.Generator().manual_seed(0))
    k = u.expand(B, T, H, E).transpose(1, 2).to(DEVICE)
    q = (-u).expand(B, T, H, E).transpose(1, 2).to(DEVICE)
    for pos in (None, documents(B, T, [5, 1])):
        got = max_logit_per_head(q, k, SCALE, pos)
        expected = -(u.double() @ u.double()) * SCALE
        torch.testing.assert_close(got.double().cpu(), torch.full((H,), expected, dtype=torch.float64),
                                   rtol=1e-5, atol=0.0)


def test_none_is_one_document_per_row():
    B, T = 2, 70
    q, k = qk(B, 2, T, 24, torch.float32, seed=4)
    whole_rows = Documents.build(B, T, None, torch.device(DEVICE)).pos_BT  # an expanded arange: stride 0
    assert whole_rows.stride(0) == 0
    assert torch.equal(max_logit_per_head(q, k, SCALE, None), max_logit_per_head(q, k, SCALE, whole_rows))


def test_strided_views_are_read_in_place(small_tiles):
    """q a slice of a wider projection, k as MLA builds it (a head-broadcast rope part), pos int32 and strided."""
    B, T, H, E = 2, 50, 3, 24
    gen = torch.Generator().manual_seed(5)
    wide = torch.randn(B, T, H, 2 * E, generator=gen).to(DEVICE)
    q = wide[..., 5:5 + E].transpose(1, 2)
    k_nope = torch.randn(B, T, H, 16, generator=gen).to(DEVICE)
    kr = torch.randn(B, T, 8, generator=gen).to(DEVICE)
    k = torch.cat([k_nope, kr[:, :, None, :].expand(B, T, H, 8)], dim=-1).transpose(1, 2)
    pos = documents(B, T, [15, 1, 64])
    pos32 = torch.zeros(T, B, dtype=torch.int32, device=DEVICE).t()
    pos32.copy_(pos)
    assert not q.is_contiguous() and not k.is_contiguous() and not pos32.is_contiguous()
    got = assert_exact(q, k, pos32)
    assert torch.equal(got, max_logit_per_head(q.contiguous(), k.contiguous(), SCALE, pos))


def test_scale_is_applied_to_the_maximum():
    q, k = qk(1, 2, 30, 24, torch.float32, seed=6)
    one = max_logit_per_head(q, k, 1.0)
    torch.testing.assert_close(max_logit_per_head(q, k, 0.25), one * 0.25, rtol=0, atol=0)


def test_empty_batch_or_sequence_gives_minus_infinity():
    for B, T in ((0, 5), (2, 0)):
        q, k = qk(B, 3, T, 24, torch.float32)
        for fn in (max_logit_per_head, max_logit_per_head_reference):
            got = fn(q, k, SCALE, torch.zeros(B, T, dtype=torch.int64, device=DEVICE))
            assert got.shape == (3,) and torch.isinf(got).all() and (got < 0).all()


def test_inputs_that_require_grad_give_a_plain_tensor():
    q, k = qk(1, 2, 20, 24, torch.float32)
    got = max_logit_per_head(q.requires_grad_(True), k.requires_grad_(True), SCALE)
    assert got.grad_fn is None and not got.requires_grad


@pytest.mark.parametrize(
    "q, k, scale, pos, message",
    [
        (torch.zeros(2, 3, 8), torch.zeros(2, 3, 8), 1.0, None, r"q must be a floating tensor \[B, H, T, E\]"),
        (torch.zeros(1, 2, 3, 8), torch.zeros(1, 2, 4, 8), 1.0, None, "q and k must share shape"),
        (torch.zeros(1, 2, 3, 8), torch.zeros(1, 2, 3, 8).half(), 1.0, None, "q and k must share shape, dtype"),
        (torch.zeros(1, 2, 3, 8, dtype=torch.int32), torch.zeros(1, 2, 3, 8, dtype=torch.int32), 1.0, None,
         "q must be a floating tensor"),
        (torch.zeros(1, 2, 3, 8), torch.zeros(1, 2, 3, 8), 0.0, None, "scale must be a finite number > 0"),
        (torch.zeros(1, 2, 3, 8), torch.zeros(1, 2, 3, 8), -1.0, None, "scale must be"),
        (torch.zeros(1, 2, 3, 8), torch.zeros(1, 2, 3, 8), 1.0, torch.zeros(1, 4, dtype=torch.int64),
         r"pos must be an integer tensor \[B, T\] = \[1, 3\]"),
        (torch.zeros(1, 2, 3, 8), torch.zeros(1, 2, 3, 8), 1.0, torch.zeros(1, 3), "pos must be an integer"),
        (torch.zeros(1, 2, 3, 8), torch.zeros(1, 2, 3, 8), 1.0, torch.zeros(1, 3, dtype=torch.int64, device="meta"),
         "pos must be on q's device"),
        (torch.zeros(1, 2, 3, 8).double(), torch.zeros(1, 2, 3, 8).double(), 1.0, None, "float64 runs in"),
        (torch.zeros(1, 2, 3, 257), torch.zeros(1, 2, 3, 257), 1.0, None, "width E of 1..256"),
    ],
)
def test_bad_inputs_raise_one_clear_error(q, k, scale, pos, message):
    with pytest.raises(ValueError, match=message):
        max_logit_per_head(q, k, scale, pos)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU error without the interpreter")
def test_cpu_tensors_without_the_interpreter_raise(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="max_logit_per_head_reference on CPU"):
        max_logit_per_head(torch.zeros(1, 2, 3, 8), torch.zeros(1, 2, 3, 8), 1.0)


def test_custom_op_passes_opcheck():
    """Schema and fake kernel agree with the real kernel, with and without pos."""
    from kernels.max_logit.ops import _max_logit_op

    q, k = qk(2, 2, 20, 24, torch.float32, seed=7)
    for pos in (None, documents(2, 20, [15, 1, 64])):
        torch.library.opcheck(_max_logit_op, (q, k, SCALE, pos))


def test_compiles_without_graph_break():
    """Inside torch.compile(fullgraph=True) the op traces as one opaque call and gives eager's values."""
    torch._dynamo.reset()
    counters.clear()
    B, T = 2, 40
    pos = documents(B, T, [15, 1, 64])

    def layer_stat(x_BTHE, pos_BT):
        q = (2 * x_BTHE).transpose(1, 2)
        stat = max_logit_per_head(q, x_BTHE.transpose(1, 2), SCALE, pos_BT)
        return torch.maximum(torch.zeros(3, device=x_BTHE.device), stat)

    compiled = torch.compile(layer_stat, backend="inductor" if DEVICE == "cuda" else "aot_eager", fullgraph=True)
    x = torch.randn(B, T, 3, 24, generator=torch.Generator().manual_seed(8)).to(DEVICE)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x, pos), layer_stat(x, pos), rtol=0, atol=0)
    assert not counters["graph_break"], dict(counters["graph_break"])


def test_reference_products_stay_float32_under_bf16_autocast():
    """QK-Clip's statistic from the reference is the float32 maximum of exact products under the trainer's bf16
    autocast too (which casts an einsum's operands to bf16, and a bf16 einsum rounds its result to bf16), on float32
    q, k as on the bf16 ones the model's projections give there, as the Triton kernel's is. (With the products in
    bf16: up to 4.1e-3 relative error per head from float32 q, k and 3.6e-3 from bf16 ones.)"""
    pos = documents(2, 130, LAYOUTS["mixed"])
    for dtype in (torch.float32, torch.bfloat16):
        q, k = (t * 3 for t in qk(2, 3, 130, 192, dtype, seed=8))  # maxima ~38: the order of QK-Clip's tau
        want = max_logit_per_head_reference(q.double(), k.double(), SCALE, pos)
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            got = max_logit_per_head_reference(q, k, SCALE, pos)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=0)


def test_reference_products_op_passes_opcheck():
    """The reference's product op (kernels.float32_matmul) on the model's layout (transposed views, a chunk of the
    queries against every key)."""
    from kernels.float32_matmul import matmul_float32

    q, k = qk(2, 3, 20, 24, torch.float32, seed=9)
    torch.library.opcheck(matmul_float32, (q[:, :, 5:15], k.mT))
