"""PyTorch versions of Muon's elementwise passes (the CPU path and the tests' ground truth)."""

import torch


def nesterov_momentum_(grad: torch.Tensor, buf: torch.Tensor, out: torch.Tensor, momentum: float, nesterov: bool) -> None:
    """buf <- momentum * buf + grad (in place); out <- grad + momentum * buf (Nesterov) or buf, in out's dtype."""
    buf.mul_(momentum).add_(grad)
    if nesterov:
        torch.add(grad, buf, alpha=momentum, out=out)
    else:
        out.copy_(buf)


def decay_add_(param: torch.Tensor, update: torch.Tensor, decay: float, alpha: float) -> None:
    """param <- decay * param + alpha * update, in place (update may be of a lower dtype)."""
    if decay != 1.0:
        param.mul_(decay)
    param.add_(update, alpha=alpha)
