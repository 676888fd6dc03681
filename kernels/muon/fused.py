"""Triton kernels for Muon's elementwise passes: one read and one write of each tensor per pass.

Unfused, a Muon step makes five passes over every Muon parameter's float32
tensors (momentum scale, momentum add, Nesterov direction, weight decay,
update): ~48 bytes per parameter. Fused, the momentum pass reads the
gradient and the buffer and writes the buffer and the NS-dtype direction
(14 bytes with float32 state and a bf16 direction), and the update pass
reads and writes the parameter and reads the update (10 bytes).
All arithmetic is float32 whatever the storage dtypes.

Every tensor is taken flat: callers pass contiguous tensors of equal numel
(a view of a parameter's blocks, a slice of the stacked NS input).
"""

import torch

import triton
import triton.language as tl

from kernels.device import triton_runs_on
from kernels.muon import reference

# NOTE: 4096 elements per program and 8 warps: 16 float32 per thread, four 16-byte loads per tensor; a
# memory-bound pass at this size runs at HBM speed for every tensor of a k3-mini step (>= 64K elements).
BLOCK = 4096
NUM_WARPS = 8


@triton.jit
def _nesterov_momentum_kernel(grad_ptr, buf_ptr, out_ptr, n, momentum, NESTEROV: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(grad_ptr + offs, mask=mask).to(tl.float32)
    b = tl.load(buf_ptr + offs, mask=mask).to(tl.float32)
    b = momentum * b + g
    tl.store(buf_ptr + offs, b.to(buf_ptr.dtype.element_ty), mask=mask)
    d = g + momentum * b if NESTEROV else b
    tl.store(out_ptr + offs, d.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _decay_add_kernel(p_ptr, u_ptr, n, decay, alpha, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    p = tl.load(p_ptr + offs, mask=mask).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask).to(tl.float32)
    tl.store(p_ptr + offs, (decay * p + alpha * u).to(p_ptr.dtype.element_ty), mask=mask)


def _use_triton(t: torch.Tensor, triton_: bool | None) -> bool:
    """None: the Triton pass on CUDA tensors, the reference elsewhere. True on CPU needs Triton's interpreter."""
    if triton_ is None:
        return t.device.type == "cuda"
    if triton_ and not triton_runs_on(t.device):
        raise ValueError(f"the Triton pass needs a CUDA tensor (or TRITON_INTERPRET=1); got one on {t.device}")
    return triton_


def _check(op: str, **tensors: torch.Tensor) -> int:
    """Same numel, same device, contiguous; returns the numel (raises naming the op and the tensor)."""
    first_name, first = next(iter(tensors.items()))
    for name, t in tensors.items():
        if not t.is_contiguous():
            raise ValueError(f"{op}: {name} must be contiguous (shape {tuple(t.shape)}, strides {t.stride()})")
        if t.numel() != first.numel() or t.device != first.device:
            raise ValueError(f"{op}: {name} has {t.numel()} elements on {t.device}; "
                             f"{first_name} has {first.numel()} on {first.device}")
    return first.numel()


def nesterov_momentum_(
    grad: torch.Tensor, buf: torch.Tensor, out: torch.Tensor, momentum: float, nesterov: bool, *, triton_: bool | None = None
) -> None:
    """buf <- momentum * buf + grad (in place); out <- grad + momentum * buf (Nesterov) or buf, in out's dtype."""
    n = _check("nesterov_momentum_", grad=grad, buf=buf, out=out)
    if not _use_triton(buf, triton_):
        return reference.nesterov_momentum_(grad, buf, out, momentum, nesterov)
    if n:
        _nesterov_momentum_kernel[(triton.cdiv(n, BLOCK),)](grad, buf, out, n, float(momentum), NESTEROV=bool(nesterov),
                                                           BLOCK=BLOCK, num_warps=NUM_WARPS)


def decay_add_(
    param: torch.Tensor, update: torch.Tensor, decay: float, alpha: float, *, triton_: bool | None = None
) -> None:
    """param <- decay * param + alpha * update, in place (update may be of a lower dtype)."""
    n = _check("decay_add_", param=param, update=update)
    if not _use_triton(param, triton_):
        return reference.decay_add_(param, update, decay, alpha)
    if n:
        _decay_add_kernel[(triton.cdiv(n, BLOCK),)](param, update, n, float(decay), float(alpha), BLOCK=BLOCK,
                                                   num_warps=NUM_WARPS)
