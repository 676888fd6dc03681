"""PyTorch versions of Muon's passes (the CPU path and the tests' ground truth).

`skip_if` (a one-element tensor; nonzero: skip) selects the old values on the
device with `torch.where`, never reading the flag on the host.
"""

import torch


def nesterov_momentum_(
    grad: torch.Tensor, buf: torch.Tensor, out: torch.Tensor, momentum: float, nesterov: bool,
    skip_if: torch.Tensor | None = None, grad_scale: torch.Tensor | None = None,
) -> None:
    """buf <- momentum * buf + grad (in place); out <- grad + momentum * buf (Nesterov) or buf, in out's dtype.

    Skipped: buf keeps its value and out is zero. grad_scale (one element): grad is read as grad * grad_scale.
    A buffer below float32 (bf16 momentum) is read into float32, advanced there, and rounded once when stored; the
    direction comes from the unrounded float32 value, as in the fused kernel.
    """
    if grad_scale is not None:
        grad = grad.float() * grad_scale.float().reshape(())
    if buf.dtype not in (torch.float32, torch.float64):
        new = buf.float().mul_(momentum).add_(grad)
        direction = torch.add(grad, new, alpha=momentum) if nesterov else new
        if skip_if is not None:
            keep = (skip_if == 0).reshape(())
            direction, new = torch.where(keep, direction, 0.0), torch.where(keep, new, buf.float())
        out.copy_(direction)
        buf.copy_(new)
        return
    if skip_if is None:
        buf.mul_(momentum).add_(grad)
        if nesterov:
            torch.add(grad, buf, alpha=momentum, out=out)
        else:
            out.copy_(buf)
        return
    keep = (skip_if == 0).reshape(())
    new = buf.mul(momentum).add_(grad)
    direction = torch.add(grad, new, alpha=momentum) if nesterov else new
    out.copy_(torch.where(keep, direction, 0.0))
    buf.copy_(torch.where(keep, new, buf))


def decay_add_(
    param: torch.Tensor, update: torch.Tensor, decay: float, alpha: float, skip_if: torch.Tensor | None = None,
    shadow: torch.Tensor | None = None,
) -> None:
    """param <- decay * param + alpha * update, in place (update may be of a lower dtype); shadow, if given, <- the
    new param in its dtype; skipped: both unchanged."""
    if skip_if is None:
        if decay != 1.0:
            param.mul_(decay)
        param.add_(update, alpha=alpha)
    else:
        new = param.mul(decay) if decay != 1.0 else param.clone()
        param.copy_(torch.where((skip_if == 0).reshape(()), new.add_(update, alpha=alpha), param))
    if shadow is not None:
        shadow.copy_(torch.where((skip_if == 0).reshape(()), param.to(shadow.dtype), shadow) if skip_if is not None
                     else param)


def ns_scale_(x: torch.Tensor, sumsq: torch.Tensor, *, square: bool, diag: float = 0.0, eps: float) -> torch.Tensor:
    """x[b] <- s_b^(2 if square else 1) * (x[b] + diag * I), in place, with s_b = 1 / (sqrt(sumsq[b]) + eps)."""
    s = (sumsq.sqrt() + eps).reciprocal()
    if square:
        s = s * s
    if diag:
        x.diagonal(dim1=-2, dim2=-1).add_(diag)
    s = s[:, None, None]
    return x.mul_(s).masked_fill_(s == 0, 0.0)  # an overflowed norm zeroes the matrix, as dividing G by it did


def ns_polynomial(A: torch.Tensor, coeffs: tuple[float, float, float], *, scale: float = 1.0,
                  sumsq: torch.Tensor | None = None, eps: float = 1e-7) -> torch.Tensor:
    """One Newton-Schulz step's B' = scale * t * (a I + b t^2 A + c t^4 A^2) for each matrix of A [B, m, m].

    t = 1 / (sqrt(sumsq[b]) + eps) when sumsq [B] is given (the first step, whose A = G G^T is of the raw G),
    else 1. A is scratch here (scaled in place when sumsq is given). An overflowed norm (t = 0) gives zeros.
    """
    a, b, c = coeffs
    if sumsq is None:
        B = torch.baddbmm(A, A, A, beta=b * scale, alpha=c * scale)
        B.diagonal(dim1=-2, dim2=-1).add_(a * scale)
        return B
    ns_scale_(A, sumsq, square=True, eps=eps)
    B = torch.baddbmm(A, A, A, beta=b * scale, alpha=c * scale)
    return ns_scale_(B, sumsq, square=False, diag=a * scale, eps=eps)


NS_COEFFS = (3.4445, -4.7750, 2.0315)


def newton_schulz(G: torch.Tensor, steps: int, *, dtype: torch.dtype, eps: float = 1e-7, scale: float = 1.0) -> torch.Tensor:
    """Quintic Newton-Schulz as first written: X = G / (||G||_F + eps) per matrix (the norm in float32, X
    rounded once to dtype), then on the wide orientation `steps` times X <- B' X with B' = a I + b A + c A^2,
    A = X X^T, the last B' times `scale`. G [..., m, n] -> [..., m, n] in dtype."""
    a, b, c = NS_COEFFS
    norm = torch.linalg.vector_norm(G, dim=(-2, -1), keepdim=True, dtype=torch.promote_types(G.dtype, torch.float32))
    X = torch.div(G, norm + eps, out=torch.empty(G.shape, dtype=dtype, device=G.device))
    tall = X.size(-2) > X.size(-1)
    if tall:
        X = X.mT
    for step in range(steps):
        k = scale if step == steps - 1 else 1.0
        A = X @ X.mT
        B = (b * k) * A + (c * k) * (A @ A)
        B.diagonal(dim1=-2, dim2=-1).add_(a * k)
        X = B @ X
    return (X.mT if tall else X).contiguous()
