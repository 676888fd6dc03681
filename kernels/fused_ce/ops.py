"""Fused linear cross-entropy: the custom op, its autograd, and the public function.

Legend: N rows (tokens), D model width, V vocabulary, C rows in one chunk.

The rows are processed in chunks of C. For each chunk, one cuBLAS matmul writes
the chunk's logits [C, V] (in the inputs' dtype, float32 accumulation) into a
reused buffer, the Triton kernel in `ce_rows.py` turns each row into its loss
and overwrites it with `softmax - onehot(target)`, and two more matmuls take
that buffer to dH [C, D] and to dW [V, D] (accumulated in float32 over chunks).
Full logits never exist: at most C x V of them do.

The gradients are computed in the forward when they will be needed, so the
logits are computed once instead of twice (three matmuls of N x V x D rather
than four); the backward only scales the stored float32 gradients by the
upstream scalar. The price is holding dH (N x D) and dW (V x D) in float32
between forward and backward.

With `one_pass`, the row kernel is `ce_one_pass.py`'s, which reads each chunk's logits once instead of twice: it
leaves exp(logits - r) with the target's entry adjusted and a float32 scale per row, which the two products take on
their narrow side (dH's rows after its product, h's rows before dW's).

With `fp8_grads`, the two gradient products run in FP8 instead (`grad_fp8.py`):
the row kernel leaves each row's log-sum-exp, and a second pass writes the
gradient in e5m2, in both layouts those products read (the transposed one in
the dead logits' buffer); dW then adds up in bf16.

The op is registered with `torch.library` (fake kernel and autograd included)
so that `torch.compile` traces through it without a graph break.
"""

import torch

from kernels.device import triton_runs_on
from kernels.fused_ce import grad_fp8
from kernels.fused_ce.ce_one_pass import ce_rows_one_pass
from kernels.fused_ce.ce_rows import ce_rows
from kernels.fused_ce.reference import check_inputs, check_target_values, rows_per_chunk

# NOTE: 3 GiB of logits per chunk: at V = 163,840 in bf16 that is 8,192 rows.
# Larger chunks ran faster on an H200 (32K tokens, fwd+bwd: 1K rows 38.5 ms,
# 2K 36.7, 4K 35.3, 8K 34.5; benchmarks/results/fused_ce.md) and 8K rows still
# peak under a tenth of the 30 GiB that materialised bf16 logits take.
DEFAULT_CHUNK_BYTES = 3 * 2**30
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# NOTE: aten has CUDA kernels only for matmuls with a float32 out_dtype; CPU
# tensors reach these helpers only under Triton's interpreter (tests), where
# upcasting the operands gives the same float32 result.
def _mm_f32(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    """out = a @ b in float32 (float32 accumulation, one rounding) for any input dtype."""
    if a.dtype == torch.float32 or not a.is_cuda:
        torch.mm(a.float(), b.float(), out=out)
    else:
        torch.mm(a, b, out_dtype=torch.float32, out=out)


def _addmm_f32(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b with `acc` float32, without a temporary of its size."""
    if a.dtype == torch.float32 or not a.is_cuda:
        acc.addmm_(a.float(), b.float())
    else:
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)


def grad_w_dtype(fp8_grads: bool) -> torch.dtype:
    """The dtype the weight's gradient adds up in over the chunks: float32, or bf16 beside the FP8 products, whose
    error is ~10x that of a bf16 sum over k3-mini's 8 chunks; a chunk's add of its product then moves 0.5 GB
    instead of 0.84 (k3-mini's head)."""
    return torch.bfloat16 if fp8_grads else torch.float32


@torch.library.custom_op("fused_ce::linear_cross_entropy", mutates_args=())
def _fused_linear_ce(
    h: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int,
    chunk_rows: int,
    need_grad_h: bool,
    need_grad_w: bool,
    check_targets: bool,
    fp8_grads: bool = False,
    one_pass: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss_sum [], grad_h32 [N, D] or [0], grad_w [V, D] or [0]) for unit upstream gradient; fp8_grads: the two
    gradient products in FP8 (`kernels.fused_ce.grad_fp8`); one_pass: the row kernel that reads the logits once
    (`kernels.fused_ce.ce_one_pass`). grad_w is float32, or bf16 with fp8_grads (`grad_w_dtype`)."""
    if check_targets:
        check_target_values(targets, weight.shape[0], ignore_index)
    n_rows, dim = h.shape
    vocab = weight.shape[0]
    f32 = dict(dtype=torch.float32, device=h.device)
    targets = targets.contiguous()
    loss_N = torch.zeros(n_rows, **f32)
    grad_h32 = torch.empty(n_rows, dim, **f32) if need_grad_h else torch.empty(0, **f32)
    grad_w = (torch.empty(vocab, dim, dtype=grad_w_dtype(fp8_grads), device=h.device) if need_grad_w
              else torch.empty(0, **f32))
    if n_rows == 0:
        return loss_N.sum(), grad_h32, grad_w.zero_()
    write_grad = need_grad_h or need_grad_w
    logits_buf = torch.empty(min(chunk_rows, n_rows), vocab, dtype=h.dtype, device=h.device)
    # NOTE: a float32 (master) weight runs the products in h's dtype; its gradient is grad_w's dtype.
    weight = weight.to(h.dtype)
    weight_t = weight.t()
    fp8 = _Fp8Grads(weight, logits_buf, need_grad_h) if fp8_grads and write_grad else None
    scale_buf = torch.empty(logits_buf.shape[0], **f32) if one_pass and write_grad else None
    for start in range(0, n_rows, chunk_rows):
        end = min(start + chunk_rows, n_rows)
        h_CD = h[start:end]
        logits_CV = logits_buf[: end - start]
        torch.mm(h_CD, weight_t, out=logits_CV)
        if fp8 is not None:
            ce_rows(logits_CV, targets[start:end], loss_N[start:end], ignore_index, False, lse_C=fp8.lse[: end - start])
            fp8.backward(logits_CV, targets[start:end], ignore_index, h_CD,
                         grad_h32[start:end] if need_grad_h else None, grad_w if need_grad_w else None, start == 0)
            continue
        scale_C, h_w = None, h_CD
        if scale_buf is not None:
            scale_C = scale_buf[: end - start]
            ce_rows_one_pass(logits_CV, targets[start:end], loss_N[start:end], scale_C, ignore_index)
            # NOTE: logits_CV now holds E', and dloss/dlogits = scale_C[:, None] * E': the scale rides on the narrow
            # side of each product, dH's rows after it and h's rows before dW's. Rounding h's scaled rows to h's
            # dtype is the one rounding this path adds to dW (the two-pass path rounds the scaled gradient instead).
            if need_grad_w:
                h_w = (h_CD.float() * scale_C[:, None]).to(h.dtype)
        else:
            ce_rows(logits_CV, targets[start:end], loss_N[start:end], ignore_index, write_grad)
            # logits_CV now holds dloss/dlogits.
        if need_grad_h:
            _mm_f32(logits_CV, weight, grad_h32[start:end])
            if scale_C is not None:
                grad_h32[start:end].mul_(scale_C[:, None])
        if need_grad_w and start == 0:
            _mm_f32(logits_CV.t(), h_w, grad_w)
        elif need_grad_w:
            _addmm_f32(grad_w, logits_CV.t(), h_w)
    return loss_N.sum(), grad_h32, grad_w


class _Fp8Grads:
    """One call's FP8 gradient products (kernels/fused_ce/grad_fp8.py): the buffers its chunks reuse."""

    def __init__(self, weight: torch.Tensor, logits_buf: torch.Tensor, need_grad_h: bool):
        vocab, dim, device = *weight.shape, weight.device
        chunk_rows = logits_buf.shape[0]
        padded = grad_fp8.padded_rows(chunk_rows)
        self.lse = torch.empty(chunk_rows, dtype=torch.float32, device=device)
        self.g = torch.empty(padded * vocab, dtype=grad_fp8.G_DTYPE, device=device)
        # NOTE: a chunk's logits are dead once G is written from them, so G's transpose and dW's bf16 product live in
        # the logits buffer (k3-mini, 4,096-row chunks: 0.8 GiB less at the loss's peak); a buffer too small for
        # both (chunks of a few rows) leaves them their own.
        spare = logits_buf.view(-1).view(torch.uint8)
        product_at = -(-padded * vocab // 256) * 256  # cuBLAS wants aligned operands
        product_bytes = vocab * dim * grad_w_dtype(True).itemsize
        if product_at + product_bytes > spare.numel():
            spare = torch.empty(product_at + product_bytes, dtype=torch.uint8, device=device)
        self.gt = spare[: padded * vocab].view(grad_fp8.G_DTYPE)
        self.dw_product = spare[product_at: product_at + product_bytes].view(grad_w_dtype(True)).view(vocab, dim)
        self.g_row_scale = grad_fp8.g_scales(max(padded, vocab), device)
        # NOTE: W in e4m3 once per call (every chunk's dH reads it), transposed: cuBLAS's layout for the right operand.
        self.w8_DV, self.w_scale = grad_fp8.columns_to_fp8(weight) if need_grad_h else (None, None)

    def backward(self, logits_CV, targets_C, ignore_index, h_CD, grad_h_CD, grad_w_VD, first: bool) -> None:
        """grad_h_CD = G W (float32, written) and grad_w_VD += G^T h (bf16, `grad_w_dtype`; the first chunk writes
        it) for this chunk's G, from its logits and the log-sum-exp `ce_rows` left in self.lse; None skips a
        product. The logits are overwritten."""
        rows, vocab = logits_CV.shape
        padded = grad_fp8.padded_rows(rows)
        g_CV, gt_VC = self.g[: padded * vocab].view(padded, vocab), self.gt[: padded * vocab].view(vocab, padded)
        grad_fp8.softmax_grad(logits_CV, self.lse[:rows], targets_C, ignore_index, grad_fp8.G_SCALE, g_CV, gt_VC)
        if grad_h_CD is not None:
            product = dict(scale_a=self.g_row_scale[:padded], scale_b=self.w_scale, out_dtype=torch.float32)
            if padded == rows:
                torch._scaled_mm(g_CV, self.w8_DV.t(), **product, out=grad_h_CD)
            else:
                grad_h_CD.copy_(torch._scaled_mm(g_CV, self.w8_DV.t(), **product)[:rows])
        if grad_w_VD is not None:
            h8_DC, h_scale = grad_fp8.columns_to_fp8(h_CD, padded)
            # NOTE: cuBLAS's FP8 product cannot add to its output, so later chunks write theirs aside and add it.
            product = dict(scale_a=self.g_row_scale[:vocab], scale_b=h_scale, out_dtype=grad_w_VD.dtype)
            torch._scaled_mm(gt_VC, h8_DC.t(), **product, out=grad_w_VD if first else self.dw_product)
            if not first:
                grad_w_VD.add_(self.dw_product)


@_fused_linear_ce.register_fake
def _(h, weight, targets, ignore_index, chunk_rows, need_grad_h, need_grad_w, check_targets, fp8_grads=False,
      one_pass=False):
    loss = h.new_empty((), dtype=torch.float32)
    grad_h32 = h.new_empty(h.shape if need_grad_h else (0,), dtype=torch.float32)
    grad_w = (weight.new_empty(weight.shape, dtype=grad_w_dtype(fp8_grads)) if need_grad_w
              else weight.new_empty((0,), dtype=torch.float32))
    return loss, grad_h32, grad_w


def _setup_context(ctx, inputs, output):
    h, weight, _, _, _, need_grad_h, need_grad_w, _, *_ = inputs
    _, grad_h32, grad_w = output
    ctx.save_for_backward(grad_h32, grad_w)
    ctx.dtypes = (h.dtype, weight.dtype)
    ctx.computed = (need_grad_h, need_grad_w)


def _backward(ctx, grad_loss, _grad_h32, _grad_w):
    grad_h32, grad_w = ctx.saved_tensors
    h_dtype, w_dtype = ctx.dtypes
    grads = [None, None]
    for i, (stored, dtype) in enumerate(((grad_h32, h_dtype), (grad_w, w_dtype))):
        if ctx.needs_input_grad[i]:
            if not ctx.computed[i]:
                raise RuntimeError(
                    "linear_cross_entropy: the forward ran without grad for this input "
                    "(grad mode off or requires_grad=False), so it has no gradient to give"
                )
            # NOTE: the product is written straight into the input's dtype, so no
            # second [V, D] float32 buffer exists.
            grads[i] = torch.mul(stored, grad_loss.float(), out=torch.empty_like(stored, dtype=dtype))
    return grads[0], grads[1], None, None, None, None, None, None, None, None


_fused_linear_ce.register_autograd(_backward, setup_context=_setup_context)


def check_fp8_grads(h: torch.Tensor, weight: torch.Tensor) -> None:
    """Raise ValueError unless the FP8 gradient products can run on these inputs (device and dimensions)."""
    if not grad_fp8.fp8_supported(h.device):
        raise ValueError(f"fp8_grads: FP8 matmuls need a CUDA GPU of compute capability 8.9 or newer, got {h.device}"
                         + (f" of capability {torch.cuda.get_device_capability(h.device)}" if h.is_cuda else ""))
    vocab, dim = weight.shape
    if vocab % grad_fp8.ALIGN or dim % grad_fp8.ALIGN:
        raise ValueError(f"fp8_grads: the vocabulary ({vocab}) and the width ({dim}) must be multiples of "
                         f"{grad_fp8.ALIGN} (cuBLAS's FP8 products)")


def linear_cross_entropy(
    h: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int = -100,
    *,
    chunk_rows: int | None = None,
    check_targets: bool = True,
    fp8_grads: bool = False,
    one_pass: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed cross-entropy of `h @ weight.T` against `targets`, fused and chunked.

    h [N, D] (bfloat16, float16 or float32; float64 runs in the reference),
    weight [V, D] (nn.Linear layout; h's dtype, or float32 with bf16 /
    float16 h: the products then run in h's dtype and the weight's gradient comes
    back in float32, never rounded to bf16), targets [N] int64
    -> (loss_sum float32 [], n_valid int64 []): the loss summed over rows whose
    target is not `ignore_index`, and the count of such rows.
    Differentiable in `h` and `weight`. `chunk_rows` (default: 3 GiB of logits)
    bounds the rows whose logits exist at one time. `check_targets` reads the
    targets to reject out-of-range values with a ValueError (one device sync);
    a caller that validated them on the host passes False, and a target out of
    range then gives that row a NaN loss instead of an error. `fp8_grads` runs
    the two gradient products in FP8 (`kernels.fused_ce.grad_fp8`: ~2x their bf16
    rate on an H200, ~2.6e-2 relative error against ~2e-3); it needs FP8 matmuls
    (CUDA compute capability 8.9+) and V and D multiples of 16. `one_pass` reads
    each chunk's logits once instead of twice for the gradient
    (`kernels.fused_ce.ce_one_pass`; bf16 or float32, not with fp8_grads).
    Needs CUDA tensors, or TRITON_INTERPRET=1 on CPU; the CPU path of a model is
    `kernels.fused_ce.reference.linear_cross_entropy`.

    With grad enabled the forward does the gradient work too, so evaluate under
    `torch.no_grad()`, and keep this call out of activation checkpointing (a
    recompute would redo all three matmuls).
    """
    check_inputs(h, weight, targets)
    if h.dtype not in DTYPES:
        # NOTE: the row kernel takes every logit to float32: float64 inputs came back with float32 accuracy.
        raise ValueError(f"fused linear_cross_entropy needs bfloat16/float16/float32 h and weight, got {h.dtype}; "
                         "float64 runs in kernels.fused_ce.reference.linear_cross_entropy")
    if not triton_runs_on(h.device):
        raise ValueError(
            f"fused linear_cross_entropy needs CUDA tensors, got device {h.device}; "
            "use kernels.fused_ce.reference.linear_cross_entropy there"
        )
    if chunk_rows is None:
        chunk_rows = rows_per_chunk(h.shape[0], weight.shape[0], h.element_size(), DEFAULT_CHUNK_BYTES)
    elif chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    if fp8_grads and one_pass:
        raise ValueError("fp8_grads and one_pass are two ways to write the gradient; pass one of them")
    if one_pass and h.dtype == torch.float16:
        # NOTE: the one-pass kernel stores exp(z - r) up to e^32 and, at the target, minus the row's sum (over 1e5 for
        # a uniform row of 163,840): float16 tops out at 65,504.
        raise ValueError("one_pass needs bfloat16 or float32 h and weight (float16 cannot hold exp(logit - r) and "
                         "its row sums); use the two-pass row kernel (one_pass=False)")
    if fp8_grads:
        check_fp8_grads(h, weight)
    grad_on = torch.is_grad_enabled()
    loss_sum, _, _ = _fused_linear_ce(
        h,
        weight,
        targets,
        ignore_index,
        chunk_rows,
        grad_on and h.requires_grad,
        grad_on and weight.requires_grad,
        check_targets,
        fp8_grads,
        one_pass,
    )
    n_valid = (targets != ignore_index).sum()
    return loss_sum, n_valid
