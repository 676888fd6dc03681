"""Pure-PyTorch linear cross-entropy: a memory-safe chunked version and a naive one.

Legend: N rows (tokens), D model width, V vocabulary, C rows in one chunk.

`linear_cross_entropy` is the CPU path of the model and the fallback on GPU: it
never holds float32 logits for more than C rows at once, in forward or backward
(the backward recomputes each chunk's logits from `h` and `weight`).
`linear_cross_entropy_naive` materialises all logits and calls
`F.cross_entropy`; tests use it as ground truth.

Both return `(loss_sum, n_valid)`: the summed loss over rows whose target is not
`ignore_index` (float32 scalar; float64 for float64 inputs, so the reference can
stand as a float64 ground truth) and the number of such rows (int64 scalar).
There is no mean reduction on purpose: the trainer divides by the valid-token
count of the whole update, summed over microbatches and ranks.
"""

import torch
import torch.nn.functional as F

# NOTE: 256 MiB of float32 logits per chunk keeps the peak small next to the
# model's activations while each chunk's matmul stays large enough to be
# efficient (at V = 163,840 it is 409 rows).
DEFAULT_CHUNK_BYTES = 256 * 2**20


def check_inputs(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> None:
    """Raise ValueError naming the argument if shapes, dtypes or devices do not fit together."""
    if h.dim() != 2:
        raise ValueError(f"h must be 2-D [N, D], got shape {tuple(h.shape)}")
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [V, D] (nn.Linear layout), got shape {tuple(weight.shape)}")
    if h.shape[1] != weight.shape[1]:
        raise ValueError(
            f"h [N, D] and weight [V, D] must share D, got h {tuple(h.shape)} and weight {tuple(weight.shape)}"
        )
    if weight.shape[0] == 0:
        raise ValueError("weight must have at least one row (V >= 1), got V=0")
    if targets.dim() != 1 or targets.shape[0] != h.shape[0]:
        raise ValueError(f"targets must be 1-D of length N={h.shape[0]}, got shape {tuple(targets.shape)}")
    if targets.dtype != torch.int64:
        raise ValueError(f"targets must be torch.int64, got {targets.dtype}")
    master = weight.dtype == torch.float32 and h.dtype in (torch.bfloat16, torch.float16)
    if not h.is_floating_point() or (h.dtype != weight.dtype and not master):
        raise ValueError("h and weight must share one floating dtype (or weight be float32 with bfloat16 / "
                         f"float16 h), got h {h.dtype} and weight {weight.dtype}")
    if not (h.device == weight.device == targets.device):
        raise ValueError(
            f"h, weight and targets must be on one device, got {h.device}, {weight.device}, {targets.device}"
        )


def check_target_values(targets: torch.Tensor, vocab: int, ignore_index: int) -> None:
    """Raise ValueError unless every target is in [0, vocab) or equals `ignore_index`.

    Reads the targets: one device sync.
    """
    bad = ((targets < 0) | (targets >= vocab)) & (targets != ignore_index)
    if bool(bad.any()):
        first = targets[bad][0].item()
        raise ValueError(f"targets must be in [0, {vocab}) or equal ignore_index={ignore_index}, found {first}")


def rows_per_chunk(n_rows: int, vocab: int, bytes_per_logit: int, chunk_bytes: int) -> int:
    """Rows per chunk so that one chunk of logits fits in `chunk_bytes`.

    N is split into nearly equal chunks (no tiny, inefficient last chunk), each
    rounded up to a multiple of 256 rows when that still fits, for the matmuls.
    """
    max_rows = max(1, chunk_bytes // (vocab * bytes_per_logit))
    n_chunks = max(1, -(-n_rows // max_rows))
    rows = max(1, -(-n_rows // n_chunks))
    aligned = -(-rows // 256) * 256
    return aligned if aligned <= max_rows else rows


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Row-chunked linear cross-entropy; the backward recomputes each chunk's logits.

    Softmax and accumulation run in float32 (float64 for float64 inputs); the
    matmuls run in h's dtype, as `nn.Linear` would (a float32 weight with bf16 h is
    rounded to bf16 for them; its gradient comes back in float32).
    """

    @staticmethod
    def forward(ctx, h, weight, targets, ignore_index, chunk_rows):
        n_rows = h.shape[0]
        acc = torch.promote_types(h.dtype, torch.float32)
        lse_N = torch.empty(n_rows, dtype=acc, device=h.device)
        loss_sum = torch.zeros((), dtype=acc, device=h.device)
        weight_t = weight.t().to(h.dtype)  # the products' dtype (a float32 weight with bf16 h: rounded once)
        for start in range(0, n_rows, chunk_rows):
            end = min(start + chunk_rows, n_rows)
            logits_CV = (h[start:end] @ weight_t).to(acc)
            lse_C = torch.logsumexp(logits_CV, dim=-1)
            lse_N[start:end] = lse_C
            tgt_C = targets[start:end]
            valid_C = tgt_C != ignore_index
            picked_C = logits_CV.gather(1, tgt_C.clamp(min=0).unsqueeze(1)).squeeze(1)
            loss_sum += torch.where(valid_C, lse_C - picked_C, 0.0).sum()
        ctx.save_for_backward(h, weight, targets, lse_N)
        ctx.ignore_index = ignore_index
        ctx.chunk_rows = chunk_rows
        ctx.weight_dtype = weight.dtype
        # NOTE: float64 inputs keep their float64 sum: rounded to float32 it hid the float64 gradients from a
        # finite-difference check (torch.autograd.gradcheck saw steps of float32 rounding).
        return loss_sum

    @staticmethod
    def backward(ctx, grad_loss):
        h, weight, targets, lse_N = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(h) if need_h else None
        acc = lse_N.dtype
        grad_w32 = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        g = grad_loss.to(acc)
        weight = weight.to(h.dtype)  # the products' dtype; grad_w keeps the weight's own (below)
        for start in range(0, h.shape[0], ctx.chunk_rows):
            end = min(start + ctx.chunk_rows, h.shape[0])
            h_CD = h[start:end]
            logits_CV = (h_CD @ weight.t()).to(acc)
            # dloss/dlogits = softmax - onehot(target), zero for ignored rows.
            dlogits_CV = torch.exp(logits_CV - lse_N[start:end, None])
            tgt_C = targets[start:end]
            valid_C = tgt_C != ctx.ignore_index
            # NOTE: ignored rows subtract 1 at a clamped index too; the mask below zeroes them.
            dlogits_CV.scatter_add_(1, tgt_C.clamp(min=0).unsqueeze(1), -torch.ones_like(lse_N[start:end, None]))
            dlogits_CV.mul_((valid_C.to(acc) * g)[:, None])
            dlogits_CV = dlogits_CV.to(h.dtype)
            if need_h:
                grad_h[start:end] = dlogits_CV @ weight
            if need_w:
                grad_w32 += (dlogits_CV.t() @ h_CD).to(acc)
        grad_w = grad_w32.to(ctx.weight_dtype) if need_w else None
        return grad_h, grad_w, None, None, None


def linear_cross_entropy(
    h: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int = -100,
    *,
    chunk_rows: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed cross-entropy of `h @ weight.T` against `targets`, chunked over rows.

    h [N, D], weight [V, D] (h's dtype, or float32 with bf16 / float16 h), targets [N] int64
    -> (loss_sum float32 [] (float64 for float64 h), n_valid int64 []). Differentiable in `h` and `weight`.
    `chunk_rows` (default: 256 MiB of float32 logits) bounds the rows whose logits exist at one time.
    """
    check_inputs(h, weight, targets)
    check_target_values(targets, weight.shape[0], ignore_index)
    if chunk_rows is None:
        chunk_rows = rows_per_chunk(h.shape[0], weight.shape[0], 4, DEFAULT_CHUNK_BYTES)
    elif chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    n_valid = (targets != ignore_index).sum()
    loss_sum = _ChunkedLinearCrossEntropy.apply(h, weight, targets, ignore_index, chunk_rows)
    return loss_sum, n_valid


def linear_cross_entropy_naive(
    h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100
) -> tuple[torch.Tensor, torch.Tensor]:
    """Ground truth: materialise all [N, V] logits and call `F.cross_entropy`.

    Computes and returns the loss in the dtype of `h`: pass float64 inputs for a
    high-precision reference.
    """
    check_inputs(h, weight, targets)
    check_target_values(targets, weight.shape[0], ignore_index)
    logits_NV = h @ weight.t()
    loss_sum = F.cross_entropy(logits_NV, targets, ignore_index=ignore_index, reduction="sum")
    n_valid = (targets != ignore_index).sum()
    return loss_sum, n_valid


def softmax_grad(logits_CV: torch.Tensor, lse_C: torch.Tensor, targets_C: torch.Tensor, ignore_index: int,
                 scale: float, g_CV: torch.Tensor, gt_VC: torch.Tensor) -> None:
    """`kernels.fused_ce.grad_fp8.softmax_grad` in torch: scale * (softmax - onehot(target)) in g's dtype (torch's
    round-to-nearest cast), and its transpose; rows of ignored targets and past C (padding) are zero."""
    rows = logits_CV.shape[0]
    p_CV = torch.exp(logits_CV.float() - lse_C[:, None])
    valid_C = targets_C != ignore_index
    p_CV.scatter_add_(1, targets_C.clamp(min=0).unsqueeze(1), -torch.ones_like(lse_C[:, None]))
    p_CV.mul_(torch.where(valid_C, scale, 0.0)[:, None])
    g_CV.zero_()
    g_CV[:rows] = p_CV
    gt_VC.copy_(g_CV.t())


def columns_to_fp8(x_RD: torch.Tensor, rows_padded: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`kernels.fused_ce.grad_fp8.columns_to_fp8` in torch: (x^T [D, R'] in e4m3 with zero columns past R, scale
    [1, D] float32, each column's largest magnitude over e4m3's largest value)."""
    from kernels.fused_ce.grad_fp8 import OPERAND_DTYPE, column_scales

    rows, dim = x_RD.shape
    scale = column_scales(x_RD)
    x8_DR = torch.zeros(dim, rows_padded or rows, dtype=OPERAND_DTYPE, device=x_RD.device)
    x8_DR[:, :rows] = (x_RD.float() * (1.0 / scale)).t()
    return x8_DR, scale[None, :]
