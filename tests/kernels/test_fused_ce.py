"""kernels.fused_ce: the chunked reference and the Triton path vs float64 ground truth, on the GPU where there is one,
else on the CPU (Triton's interpreter)."""

import os

if not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

import kernels.fused_ce.ce_one_pass as ce_one_pass_module
import kernels.fused_ce.ce_rows as ce_rows_module
from kernels.fused_ce import linear_cross_entropy, reference

IGNORE = -100
# NOTE: on a GPU machine the fused path refuses CPU tensors (the interpreter is off there), so the inputs live on the GPU.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(n, d, v, dtype=torch.float32, ignore_every=0, seed=0, device=DEVICE):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(n, d, generator=gen, dtype=torch.float64).to(dtype)
    weight = (torch.randn(v, d, generator=gen, dtype=torch.float64) / d**0.5).to(dtype)
    targets = torch.randint(0, v, (n,), generator=gen)
    if ignore_every:
        targets[::ignore_every] = IGNORE
    return h.to(device), weight.to(device), targets.to(device)


def _loss_and_grads(fn, h, weight, targets, ignore_index=IGNORE, **kwargs):
    h = h.detach().clone().requires_grad_(True)
    weight = weight.detach().clone().requires_grad_(True)
    loss_sum, n_valid = fn(h, weight, targets, ignore_index, **kwargs)
    # A non-unit upstream gradient checks that backward scales by it.
    (loss_sum * 0.37).backward()
    return loss_sum.detach(), n_valid, h.grad, weight.grad


def _ground_truth(h, weight, targets):
    return _loss_and_grads(reference.linear_cross_entropy_naive, h.double(), weight.double(), targets)


def _rel_rms(x, ref):
    x, ref = x.double(), ref.double()
    return ((x - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt().clamp_min(1e-30)).item()


def _assert_close_to_truth(got, truth, tol):
    loss, n_valid, gh, gw = got
    t_loss, t_n, t_gh, t_gw = truth
    assert loss.dtype == torch.float32 and loss.shape == ()
    assert n_valid.dtype == torch.int64 and n_valid.shape == () and n_valid.item() == t_n.item()
    assert abs(loss.item() - t_loss.item()) <= tol * abs(t_loss.item())
    assert _rel_rms(gh, t_gh) < tol
    assert _rel_rms(gw, t_gw) < tol


@pytest.mark.parametrize(
    "n, d, v, chunk_rows",
    [(37, 16, 53, 8), (64, 32, 300, None), (5, 8, 1, 2), (130, 24, 97, 64)],
)
def test_reference_matches_naive_float64(n, d, v, chunk_rows):
    h, weight, targets = _inputs(n, d, v, ignore_every=7)
    truth = _ground_truth(h, weight, targets)
    got = _loss_and_grads(reference.linear_cross_entropy, h, weight, targets, chunk_rows=chunk_rows)
    _assert_close_to_truth(got, truth, 1e-5)


def test_reference_all_ignored_gives_zero_loss_and_grads():
    h, weight, targets = _inputs(9, 8, 21)
    targets[:] = IGNORE
    loss, n_valid, gh, gw = _loss_and_grads(reference.linear_cross_entropy, h, weight, targets, chunk_rows=4)
    assert loss.item() == 0.0 and n_valid.item() == 0
    assert torch.equal(gh, torch.zeros_like(gh)) and torch.equal(gw, torch.zeros_like(gw))


def test_reference_ignore_index_inside_vocab():
    h, weight, targets = _inputs(20, 8, 11)
    targets[::3] = 0
    loss, n_valid, gh, _ = _loss_and_grads(
        reference.linear_cross_entropy, h, weight, targets, ignore_index=0, chunk_rows=6
    )
    t_loss, _, t_gh, _ = _loss_and_grads(
        reference.linear_cross_entropy_naive, h.double(), weight.double(), targets, ignore_index=0
    )
    keep = targets != 0
    assert n_valid.item() == int(keep.sum())
    assert abs(loss.item() - t_loss.item()) <= 1e-5 * abs(t_loss.item())
    assert torch.equal(gh[~keep], torch.zeros_like(gh[~keep]))
    assert _rel_rms(gh, t_gh) < 1e-5


def test_reference_chunk_logits_stay_bounded(monkeypatch):
    """The chunked reference never builds a logits tensor with more than chunk_rows rows."""
    h, weight, targets = _inputs(50, 8, 40)
    seen = []
    real_mm = torch.Tensor.__matmul__

    def spy(a, b):
        out = real_mm(a, b)
        if out.dim() == 2 and out.shape[1] == weight.shape[0]:
            seen.append(out.shape[0])
        return out

    monkeypatch.setattr(torch.Tensor, "__matmul__", spy)
    _loss_and_grads(reference.linear_cross_entropy, h, weight, targets, chunk_rows=16)
    assert seen and max(seen) <= 16


@pytest.fixture
def small_block(monkeypatch):
    """A 32-wide vocabulary block so that small vocabularies span several blocks and a ragged tail (both row
    kernels)."""
    monkeypatch.setattr(ce_rows_module, "LAUNCH", ce_rows_module.RowsLaunch(block=32))
    monkeypatch.setattr(ce_one_pass_module, "LAUNCH", ce_rows_module.RowsLaunch(block=32, programs_per_sm=1,
                                                                                 prefetch=True))


# NOTE: the fused loss's tests run with both ways of writing the gradient: the two-pass row kernel and the one-pass
# one (kernels/fused_ce/ce_one_pass.py), which must give the same loss and gradients.
ONE_PASS = pytest.mark.parametrize("one_pass", [False, True], ids=["two-pass", "one-pass"])


@pytest.mark.parametrize(
    "n, d, v, chunk_rows, dtype",
    [
        (37, 16, 53, 8, torch.float32),  # ragged last chunk, V = 32 + 21
        (64, 32, 300, None, torch.float32),  # one chunk, V = 9 blocks + 12
        (5, 8, 1, 2, torch.float32),  # V = 1: loss 0, gradient 0
        (48, 16, 96, 17, torch.float16),  # V a multiple of the block (the one-pass kernel refuses float16)
        (48, 16, 96, 17, torch.float32),  # the same in float32
    ],
)
@ONE_PASS
def test_fused_matches_float64_ground_truth(small_block, n, d, v, chunk_rows, dtype, one_pass):
    h, weight, targets = _inputs(n, d, v, dtype=dtype, ignore_every=5)
    if one_pass and dtype == torch.float16:
        with pytest.raises(ValueError, match="one_pass needs bfloat16 or float32"):
            linear_cross_entropy(h, weight, targets, IGNORE, chunk_rows=chunk_rows, one_pass=True)
        return
    truth = _ground_truth(h, weight, targets)
    got = _loss_and_grads(linear_cross_entropy, h, weight, targets, chunk_rows=chunk_rows, one_pass=one_pass)
    _assert_close_to_truth(got, truth, 1e-5 if dtype == torch.float32 else 5e-3)
    assert got[2].dtype == dtype and got[3].dtype == dtype


@pytest.mark.parametrize("fn", [reference.linear_cross_entropy, linear_cross_entropy], ids=["chunked", "fused"])
def test_a_float32_weight_with_half_h_gets_its_gradient_in_float32(small_block, fn):
    """The model's bf16 training hands the float32 head weight over as it is: the products run in h's dtype, exactly
    as with the weight rounded first, and the weight's gradient is that one before its rounding."""
    h, weight, targets = _inputs(48, 16, 96, dtype=torch.float16, ignore_every=5)
    master = weight.float()
    loss16, n16, gh16, gw16 = _loss_and_grads(fn, h, weight, targets, chunk_rows=17)
    loss32, n32, gh32, gw32 = _loss_and_grads(fn, h, master, targets, chunk_rows=17)
    assert gw32.dtype == torch.float32 and gh32.dtype == torch.float16
    assert torch.equal(loss32, loss16) and torch.equal(gh32, gh16) and n32 == n16
    assert torch.equal(gw32.to(torch.float16), gw16) and not torch.equal(gw32, gw16.float())
    truth = _ground_truth(h, weight, targets)[3]
    assert _rel_rms(gw32, truth) < _rel_rms(gw16, truth)


ROW_LAUNCHES = {
    "one program per row": dict(),
    "second pass backwards": dict(reverse=True),
    "one program per SM": dict(programs_per_sm=1, reverse=True),
    "two per SM, prefetched, L2 hints": dict(programs_per_sm=2, reverse=True, prefetch=True, l2_hints=True),
    "forwards, prefetched": dict(programs_per_sm=3, prefetch=True),
    "one per row, prefetched": dict(reverse=True, prefetch=True),
    # whatever the kernel launches by default, at the test's block
    "the default launch": {k: v for k, v in ce_rows_module.LAUNCH._asdict().items() if k != "block"},
}


@pytest.mark.parametrize("launch", ROW_LAUNCHES.values(), ids=ROW_LAUNCHES.keys())
def test_row_kernel_matches_float64_softmax_grad(monkeypatch, launch):
    """The row kernel alone, at every launch: per-row loss, and the gradient written in place only when asked.

    77 columns are two 32-wide tiles and a ragged one; 11 rows are more than the programs of a launch that loops
    over rows (the interpreter counts two SMs), so a program takes several rows, the last ones unevenly."""
    monkeypatch.setattr(ce_rows_module, "LAUNCH", ce_rows_module.RowsLaunch(block=32, **launch))
    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(11, 77, generator=gen) * 4).to(DEVICE)
    targets = torch.randint(0, 77, (11,), generator=gen).to(DEVICE)
    targets[[1, 6]] = IGNORE
    x64 = logits.double().requires_grad_(True)
    torch.nn.functional.cross_entropy(x64, targets, ignore_index=IGNORE, reduction="sum").backward()
    ref_loss = torch.nn.functional.cross_entropy(logits.double(), targets, ignore_index=IGNORE, reduction="none")
    loss = torch.full((11,), float("nan"), device=DEVICE)
    grad = logits.clone()
    ce_rows_module.ce_rows(grad, targets, loss, IGNORE, write_grad=True)
    assert torch.allclose(loss.double(), ref_loss, rtol=1e-5, atol=1e-5)
    assert torch.allclose(grad.double(), x64.grad, rtol=1e-5, atol=1e-6)
    loss_only = torch.full((11,), float("nan"), device=DEVICE)
    untouched = logits.clone()
    ce_rows_module.ce_rows(untouched, targets, loss_only, IGNORE, write_grad=False)
    assert torch.equal(untouched, logits) and torch.equal(loss_only, loss)


ONE_PASS_LAUNCHES = {
    "one program per row": dict(),
    "one program per SM, prefetched": dict(programs_per_sm=1, prefetch=True),
    "two per SM": dict(programs_per_sm=2),
    # whatever the one-pass kernel launches by default, at the test's block
    "the default launch": {k: v for k, v in ce_one_pass_module.LAUNCH._asdict().items() if k != "block"},
}


@pytest.mark.parametrize("rescale_at", [ce_one_pass_module.RESCALE_AT, 0.25], ids=["recipe", "every-step-moves"])
@pytest.mark.parametrize("launch", ONE_PASS_LAUNCHES.values(), ids=ONE_PASS_LAUNCHES.keys())
def test_one_pass_row_kernel_matches_float64_softmax_grad(launch, rescale_at):
    """The one-pass row kernel alone: per-row loss, and scale * E' equal to softmax - onehot, with ignored rows at
    scale 0 and loss 0. Row 3's largest logit sits 60 above its first step's (the reference moves even at the
    recipe's threshold) and is its target; row 4's target is column 0 and row 5's the last column; at a threshold of
    0.25 nearly every step moves the reference and rescales the steps before it."""
    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(11, 77, generator=gen) * 4).to(DEVICE)
    targets = torch.randint(0, 77, (11,), generator=gen).to(DEVICE)
    logits[3, 70] = 60.0
    targets[3], targets[4], targets[5] = 70, 0, 76
    targets[[1, 6]] = IGNORE
    x64 = logits.double().requires_grad_(True)
    torch.nn.functional.cross_entropy(x64, targets, ignore_index=IGNORE, reduction="sum").backward()
    ref_loss = torch.nn.functional.cross_entropy(logits.double(), targets, ignore_index=IGNORE, reduction="none")
    loss = torch.full((11,), float("nan"), device=DEVICE)
    scale = torch.full((11,), float("nan"), device=DEVICE)
    e = logits.clone()
    ce_one_pass_module.ce_rows_one_pass(e, targets, loss, scale, IGNORE,
                                        launch=ce_rows_module.RowsLaunch(block=32, **launch), rescale_at=rescale_at)
    assert torch.allclose(loss.double(), ref_loss, rtol=1e-5, atol=1e-5)
    assert torch.equal(scale[[1, 6]], torch.zeros(2, device=DEVICE)) and bool((scale[targets != IGNORE] > 0).all())
    assert torch.isfinite(e).all()
    assert torch.allclose(e.double() * scale.double()[:, None], x64.grad, rtol=1e-5, atol=1e-6)


@ONE_PASS
def test_fused_all_ignored_gives_zero_loss_and_grads(small_block, one_pass):
    h, weight, targets = _inputs(9, 8, 40)
    targets[:] = IGNORE
    loss, n_valid, gh, gw = _loss_and_grads(linear_cross_entropy, h, weight, targets, chunk_rows=4, one_pass=one_pass)
    assert loss.item() == 0.0 and n_valid.item() == 0
    assert torch.equal(gh, torch.zeros_like(gh)) and torch.equal(gw, torch.zeros_like(gw))


def test_fused_grad_of_one_input_and_no_grad_forward(small_block):
    h, weight, targets = _inputs(20, 8, 70, ignore_every=3)
    t_loss, _, _, t_gw = _ground_truth(h, weight, targets)
    w = weight.clone().requires_grad_(True)
    loss, _ = linear_cross_entropy(h, w, targets, IGNORE, chunk_rows=8)
    (loss * 0.37).backward()
    assert _rel_rms(w.grad, t_gw) < 1e-5
    with torch.no_grad():
        loss_ng, n_valid = linear_cross_entropy(h, weight.requires_grad_(True), targets, IGNORE)
    assert not loss_ng.requires_grad
    assert abs(loss_ng.item() - t_loss.item()) <= 1e-5 * abs(t_loss.item())


@ONE_PASS
def test_fused_is_deterministic(small_block, one_pass):
    h, weight, targets = _inputs(30, 8, 50, ignore_every=4)
    first = _loss_and_grads(linear_cross_entropy, h, weight, targets, chunk_rows=7, one_pass=one_pass)
    second = _loss_and_grads(linear_cross_entropy, h, weight, targets, chunk_rows=7, one_pass=one_pass)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


@ONE_PASS
def test_fused_compiles_without_graph_break(small_block, one_pass):
    h, weight, targets = _inputs(16, 8, 40, ignore_every=3)
    truth = _ground_truth(h, weight, targets)
    compiled = torch.compile(linear_cross_entropy, backend="eager", fullgraph=True)
    got = _loss_and_grads(compiled, h, weight, targets, chunk_rows=8, one_pass=one_pass)
    _assert_close_to_truth(got, truth, 1e-5)


@ONE_PASS
def test_fused_op_passes_opcheck(one_pass):
    h, weight, targets = _inputs(12, 8, 20, ignore_every=4)
    h.requires_grad_(True)
    weight.requires_grad_(True)
    op = torch.ops.fused_ce.linear_cross_entropy.default
    torch.library.opcheck(op, (h, weight, targets, IGNORE, 5, True, True, True, False, one_pass))


@pytest.mark.parametrize(
    "fn",
    [reference.linear_cross_entropy, reference.linear_cross_entropy_naive, linear_cross_entropy],
    ids=["chunked", "naive", "fused"],
)
@pytest.mark.parametrize(
    "case, match",
    [
        ("d_mismatch", "share D"),
        ("targets_int32", "torch.int64"),
        ("targets_len", "length N"),
        ("dtype_mismatch", "one floating dtype"),
        ("target_out_of_range", r"\[0, 11\)"),
        ("h_1d", "2-D"),
    ],
)
def test_bad_input_raises_value_error(fn, case, match):
    h, weight, targets = _inputs(6, 4, 11)
    if case == "d_mismatch":
        weight = weight[:, :3]
    elif case == "targets_int32":
        targets = targets.int()
    elif case == "targets_len":
        targets = targets[:5]
    elif case == "dtype_mismatch":
        weight = weight.double()
    elif case == "target_out_of_range":
        targets[2] = 11
    elif case == "h_1d":
        h = h[0]
    with pytest.raises(ValueError, match=match):
        fn(h, weight, targets, IGNORE)


@ONE_PASS
def test_unchecked_target_out_of_range_gives_nan_not_a_wrong_number(one_pass):
    """check_targets=False skips the device read; a bad target must still be loud (NaN), never a valid-looking loss
    (with the gradient written too: the one-pass kernel runs only then)."""
    h, weight, targets = _inputs(6, 4, 11)
    h.requires_grad_(True)
    good, _ = linear_cross_entropy(h, weight, targets, IGNORE, check_targets=False, one_pass=one_pass)
    assert torch.isfinite(good)
    for bad in (11, -3):
        targets[2] = bad
        loss, _ = linear_cross_entropy(h, weight, targets, IGNORE, check_targets=False, one_pass=one_pass)
        assert torch.isnan(loss), bad


def test_fused_refuses_cpu_tensors_outside_the_interpreter(monkeypatch):
    h, weight, targets = _inputs(6, 4, 11, device="cpu")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        linear_cross_entropy(h, weight, targets, IGNORE)


# ------------------------------------------------------------------ FP8 gradient products (kernels/fused_ce/grad_fp8.py)


@pytest.fixture
def small_grad_tiles(monkeypatch):
    """Tiles of 8 rows x 16 columns (the transpose: 16 x 8), so that small chunks span several tiles and ragged edges."""
    import kernels.fused_ce.grad_fp8 as grad_fp8

    monkeypatch.setattr(grad_fp8, "BLOCK_ROWS", 8)
    monkeypatch.setattr(grad_fp8, "BLOCK_COLS", 16)
    monkeypatch.setattr(grad_fp8, "TRANSPOSE_BLOCK", (16, 8, 4))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_softmax_grad_writes_both_layouts_zero_padded(small_grad_tiles, dtype):
    """The FP8 path's gradient pass alone, in a wide dtype: scale * (softmax - onehot), its transpose, zero rows for
    ignored targets and for the padding up to 16 rows."""
    from kernels.fused_ce import grad_fp8

    gen = torch.Generator().manual_seed(5)
    rows, vocab, padded = 21, 48, 32
    logits = (torch.randn(rows, vocab, generator=gen) * 3).to(DEVICE)
    targets = torch.randint(0, vocab, (rows,), generator=gen).to(DEVICE)
    targets[[2, 9]] = IGNORE
    x64 = logits.double().requires_grad_(True)
    torch.nn.functional.cross_entropy(x64, targets, ignore_index=IGNORE, reduction="sum").backward()
    lse = torch.logsumexp(logits.double(), dim=1).float()
    g = torch.full((padded, vocab), float("nan"), dtype=dtype, device=DEVICE)
    gt = torch.full((vocab, padded), float("nan"), dtype=dtype, device=DEVICE)
    grad_fp8.softmax_grad(logits, lse, targets, IGNORE, 4.0, g, gt)
    expected = torch.zeros(padded, vocab, dtype=torch.float64, device=DEVICE)
    expected[:rows] = 4.0 * x64.grad
    tol = 1e-6 if dtype == torch.float32 else 2e-3
    assert torch.allclose(g.double(), expected, atol=tol, rtol=tol)
    assert torch.equal(gt, g.t())
    assert torch.equal(g[[2, 9]], torch.zeros_like(g[[2, 9]])) and torch.equal(g[rows:], torch.zeros_like(g[rows:]))
    g_ref, gt_ref = torch.empty_like(g), torch.empty_like(gt)
    reference.softmax_grad(logits, lse, targets, IGNORE, 4.0, g_ref, gt_ref)
    assert torch.allclose(g_ref, g, atol=tol, rtol=tol) and torch.equal(gt_ref, g_ref.t())


def _cpu_scaled_mm_takes_rowwise_scales() -> bool:
    """Whether this torch's CPU `_scaled_mm` takes a scale per row (torch 2.13's does; 2.11's only one per tensor)."""
    a = torch.ones(16, 16).to(torch.float8_e5m2)
    b = torch.ones(16, 16).to(torch.float8_e4m3fn).t()
    try:
        torch._scaled_mm(a, b, scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.float32)
    except RuntimeError:
        return False
    return True


@pytest.mark.skipif(DEVICE == "cpu" and not _cpu_scaled_mm_takes_rowwise_scales(),
                    reason="this torch's CPU _scaled_mm takes only per-tensor scales (torch 2.11's); the GPU run checks "
                           "the FP8 products (tests/gpu/test_fused_ce_gpu.py)")
@pytest.mark.parametrize("n, chunk_rows", [(40, 16), (37, 12), (16, None)])
def test_fp8_grads_track_float64_within_fp8_error(small_block, small_grad_tiles, monkeypatch, n, chunk_rows):
    """Both gradients through the FP8 products against float64, over ragged chunks (padded to 16 rows): the loss is
    exact (its logits stay in h's dtype), the gradients within FP8's error; a product left in float32 would fail the
    last line. NOTE: Triton's interpreter casts to FP8 wrongly (-0.95 * 2**15 comes out as -2**14), so on the CPU
    the gradient pass and the e4m3 casts are their torch references; the kernels' own FP8 stores are checked on the
    GPU (tests/gpu/test_fused_ce_gpu.py), the gradient pass in float32 / float16 above."""
    from kernels.fused_ce import grad_fp8

    if DEVICE == "cpu":
        monkeypatch.setattr(grad_fp8, "softmax_grad", reference.softmax_grad)
        monkeypatch.setattr(grad_fp8, "columns_to_fp8", reference.columns_to_fp8)
    h, weight, targets = _inputs(n, 32, 64, ignore_every=5)
    truth = _ground_truth(h, weight, targets)
    loss, n_valid, gh, gw = _loss_and_grads(linear_cross_entropy, h, weight, targets, chunk_rows=chunk_rows,
                                            fp8_grads=True)
    assert n_valid.item() == truth[1].item() and abs(loss.item() - truth[0].item()) <= 1e-5 * abs(truth[0].item())
    assert gh.dtype == gw.dtype == torch.float32
    errors = (_rel_rms(gh, truth[2]), _rel_rms(gw, truth[3]))
    assert max(errors) < 0.06, errors
    assert min(errors) > 1e-3, errors  # the FP8 products ran (float32 products err ~1e-7)


@pytest.mark.parametrize("chunk_rows, shared", [(64, True), (16, False)])
def test_fp8_grads_keep_g_transposed_in_the_logits_buffer_when_it_fits(chunk_rows, shared):
    """G's transpose and dW's bf16 product take the dead logits' memory (no allocation of their own) when the chunk's
    logits buffer holds both, and get their own memory when it does not."""
    from kernels.fused_ce.ops import _Fp8Grads

    weight = torch.randn(64, 32)
    logits_buf = torch.empty(chunk_rows, 64, dtype=torch.bfloat16)
    fp8 = _Fp8Grads(weight, logits_buf, need_grad_h=False)
    buffer = logits_buf.untyped_storage().data_ptr()
    assert [t.untyped_storage().data_ptr() == buffer for t in (fp8.gt, fp8.dw_product)] == [shared, shared]
    assert fp8.gt.numel() == chunk_rows * 64
    assert fp8.dw_product.shape == (64, 32) and fp8.dw_product.dtype == torch.bfloat16
    gt_end = fp8.gt.storage_offset() + fp8.gt.numel()
    assert fp8.dw_product.storage_offset() * 2 >= gt_end  # the two do not overlap


def test_fp8_grads_refuse_widths_cublas_cannot_take():
    h, weight, targets = _inputs(8, 24, 64)
    with pytest.raises(ValueError, match=r"fp8_grads: .*\(24\) must be multiples of 16"):
        linear_cross_entropy(h, weight, targets, IGNORE, fp8_grads=True)


def test_fp8_grads_and_one_pass_are_refused_together():
    h, weight, targets = _inputs(6, 16, 32)
    with pytest.raises(ValueError, match="fp8_grads and one_pass are two ways to write the gradient"):
        linear_cross_entropy(h, weight, targets, IGNORE, fp8_grads=True, one_pass=True)


def test_chunked_reference_gradcheck_in_float64():
    """torch.autograd.gradcheck of the chunked reference's hand-written backward (the CPU path's gradients), over a
    ragged last chunk and ignored rows; the naive reference's through autograd alongside."""
    h, weight, targets = _inputs(7, 4, 9, dtype=torch.float64, ignore_every=3, seed=70, device="cpu")
    h.requires_grad_()
    weight.requires_grad_()

    def chunked(h, weight):
        return reference.linear_cross_entropy(h, weight, targets, IGNORE, chunk_rows=3)[0]

    def naive(h, weight):
        return reference.linear_cross_entropy_naive(h, weight, targets, IGNORE)[0]

    assert torch.autograd.gradcheck(chunked, (h, weight))
    assert torch.autograd.gradcheck(naive, (h, weight))


@pytest.mark.parametrize("n", [0, 1])
@ONE_PASS
def test_fused_no_rows_and_one_row(small_block, n, one_pass):
    """An empty microbatch gives a zero loss, no valid rows and zero gradients; one row matches float64."""
    h, weight, targets = _inputs(n, 8, 40, seed=71)
    got = _loss_and_grads(linear_cross_entropy, h, weight, targets, one_pass=one_pass)
    truth = _ground_truth(h, weight, targets)
    if n == 0:
        loss, n_valid, gh, gw = got
        assert loss.item() == 0.0 and n_valid.item() == 0 and gh.shape == (0, 8)
        assert torch.equal(gw, torch.zeros_like(gw))
    else:
        _assert_close_to_truth(got, truth, 1e-5)


def test_fused_refuses_float64_and_points_at_the_reference():
    """The row kernel takes every logit to float32: float64 inputs came back, without a word, with float32
    accuracy (a loss ~1e-8 off the float64 one)."""
    h, weight, targets = _inputs(6, 4, 11, dtype=torch.float64)
    with pytest.raises(ValueError, match="float64 runs in kernels.fused_ce.reference.linear_cross_entropy"):
        linear_cross_entropy(h, weight, targets, IGNORE)


@pytest.mark.parametrize("chunk_rows", [1, 4, 100])
@ONE_PASS
def test_fused_ignore_index_inside_vocab_and_any_chunk(small_block, chunk_rows, one_pass):
    """ignore_index = 0 is a real token id: its rows are dropped, not picked, at one row per chunk, ragged chunks and
    one chunk holding every row."""
    h, weight, targets = _inputs(9, 4, 40, seed=72)
    targets[::2] = 0
    got = _loss_and_grads(linear_cross_entropy, h, weight, targets, ignore_index=0, chunk_rows=chunk_rows,
                          one_pass=one_pass)
    truth = _loss_and_grads(reference.linear_cross_entropy_naive, h.double(), weight.double(), targets, ignore_index=0)
    _assert_close_to_truth(got, truth, 1e-5)
    assert torch.equal(got[2][::2], torch.zeros_like(got[2][::2]))
