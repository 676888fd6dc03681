"""Triton kernels for Muon's elementwise passes: one read and one write of each tensor per pass.

Unfused, a Muon step makes five passes over every Muon parameter's float32
tensors (momentum scale, momentum add, Nesterov direction, weight decay,
update): ~48 bytes per parameter. Fused, the momentum pass reads the
gradient and the buffer and writes the buffer and the NS-dtype direction
(14 bytes with float32 state and a bf16 direction), and the update pass
reads and writes the parameter and reads the update (10 bytes).
All arithmetic is float32 whatever the storage dtypes.

Every tensor is taken flat. A pass covers a list of tensors in one launch
(a k3-mini step was host-bound on one launch per parameter). A host-built int64 table has
one row per non-empty tensor: [first program, numel, offset of its slot in
the NS-side operand, offset in each other operand]; offsets count elements
from the operand's first tensor, which is the kernel's pointer argument, so
the kernel needs no integer-to-pointer casts. A program finds its row by a
binary search over the first-program column.

`skip_if` (a one-element tensor on the device; nonzero: skip) masks every
store of the parameters and momentum buffers, read by each program once and
never by the host, so a trainer can skip a non-finite update without a sync.

`ns_polynomial` computes a Newton-Schulz step's B' = a I + b A + c A^2 on
the small [B, m, m] Gram matrices (the first step's per-matrix
normalisation included) as one batched matmul with the rest in its
epilogue (see `titan_k3.optim.orthogonalise.newton_schulz`).
"""

from __future__ import annotations

import itertools

import torch

import triton
import triton.language as tl

from kernels.device import host_to_device, triton_runs_on
from kernels.muon import reference

# NOTE: 4096 elements per program and 8 warps: 16 float32 per thread, four 16-byte loads per tensor; a
# memory-bound pass at this size runs at HBM speed for every tensor of a k3-mini step (>= 64K elements).
BLOCK = 4096
NUM_WARPS = 8
# NOTE: numels and offsets loaded from a table are unknown to the compiler, which would then move one element
# per instruction; when all are multiples of ALIGN (the kernels' `tl.multiple_of(..., 16)`) the kernel says so
# and gets its 16-byte loads back.
ALIGN = 16


@triton.jit
def _row(table, n_rows, COLS: tl.constexpr):
    """Pointer to this program's table row: the last row whose first program is <= the program id."""
    pid = tl.program_id(0)
    lo = pid * 0
    hi = lo + n_rows
    while hi - lo > 1:
        mid = (lo + hi) // 2
        ahead = tl.load(table + mid * COLS) <= pid
        lo = tl.where(ahead, mid, lo)
        hi = tl.where(ahead, hi, mid)
    return table + lo * COLS


@triton.jit
def _field(row, col: tl.constexpr, ALIGNED: tl.constexpr):
    x = tl.load(row + col)
    if ALIGNED:
        x = tl.multiple_of(x, 16)
    return x


@triton.jit
def _block(row, n, skip_ptr, HAS_SKIP: tl.constexpr, BLOCK: tl.constexpr):
    """(offsets of this program's elements in its tensor, in-bounds mask, in-bounds and not skipped mask)."""
    offs = (tl.program_id(0) - tl.load(row)).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    keep = mask
    if HAS_SKIP:
        keep = offs < tl.where(tl.load(skip_ptr) == 0, n, 0)  # skipped: no element in bounds
    return offs, mask, keep


@triton.jit
def _nesterov_momentum_multi_kernel(table, n_rows, out_ptr, grad_ptr, buf_ptr, skip_ptr, scale_ptr, momentum,
                                    NESTEROV: tl.constexpr, HAS_SKIP: tl.constexpr, HAS_SCALE: tl.constexpr,
                                    ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
    row = _row(table, n_rows, 5)
    n = _field(row, 1, ALIGNED)
    out_ptr += _field(row, 2, ALIGNED)
    grad_ptr += _field(row, 3, ALIGNED)
    buf_ptr += _field(row, 4, ALIGNED)
    offs, mask, keep = _block(row, n, skip_ptr, HAS_SKIP, BLOCK)
    g = tl.load(grad_ptr + offs, mask=keep, other=0.0).to(tl.float32)
    if HAS_SCALE:
        g = g * tl.load(scale_ptr).to(tl.float32)
    b = tl.load(buf_ptr + offs, mask=keep, other=0.0).to(tl.float32)
    b = momentum * b + g
    tl.store(buf_ptr + offs, b.to(buf_ptr.dtype.element_ty), mask=keep)
    d = g + momentum * b if NESTEROV else b
    # NOTE: a skipped step still writes its (zero) directions: Newton-Schulz then runs on zeros, not on stale memory.
    tl.store(out_ptr + offs, d.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _decay_add_multi_kernel(table, n_rows, u_ptr, p_ptr, s_ptr, skip_ptr, decay, alpha, HAS_SKIP: tl.constexpr,
                            HAS_SHADOW: tl.constexpr, ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
    if HAS_SHADOW:
        row = _row(table, n_rows, 5)
    else:
        row = _row(table, n_rows, 4)
    n = _field(row, 1, ALIGNED)
    u_ptr += _field(row, 2, ALIGNED)
    p_ptr += _field(row, 3, ALIGNED)
    offs, _, keep = _block(row, n, skip_ptr, HAS_SKIP, BLOCK)
    p = tl.load(p_ptr + offs, mask=keep).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=keep).to(tl.float32)
    p = (decay * p + alpha * u).to(p_ptr.dtype.element_ty)
    tl.store(p_ptr + offs, p, mask=keep)
    if HAS_SHADOW:
        # NOTE: rounded from the stored parameter, so the shadow is exactly what casting the parameter gives.
        s_ptr += _field(row, 4, ALIGNED)
        tl.store(s_ptr + offs, p.to(s_ptr.dtype.element_ty), mask=keep)


def _use_triton(t: torch.Tensor, triton_: bool | None) -> bool:
    """None: the Triton pass on CUDA tensors, the reference elsewhere. True on CPU needs Triton's interpreter."""
    if triton_ is None:
        return t.device.type == "cuda"
    if triton_ and not triton_runs_on(t.device):
        raise ValueError(f"the Triton pass needs a CUDA tensor (or TRITON_INTERPRET=1); got one on {t.device}")
    return triton_


class Table:
    """The table of one multi-tensor launch: rows built and checked on the host, then sent to the device.

    slots: the NS-side operand (momentum's out, the update): one contiguous tensor holding the slots end to end,
    None for such a tensor that does not exist yet, or one tensor per slot. operands: lists of contiguous tensors,
    pairwise of one numel with the first list, each list of one dtype and device. Offsets count elements from
    each list's first non-empty tensor, the kernel's pointer argument.
    """

    def __init__(self, op: str, slots: torch.Tensor | list[torch.Tensor] | None, *operands: list[torch.Tensor]):
        self.op, self.cols = op, 3 + len(operands)
        numels = [t.numel() for t in operands[0]]
        self.slot_numel = sum(numels)
        columns = [self._offsets(slots, numels) if isinstance(slots, list) else [0, *itertools.accumulate(numels)]]
        columns += [self._offsets(ts, numels) for ts in operands]
        self.rows: list[int] = []  # flat, `cols` per row
        first = 0
        for i, n in enumerate(numels):
            if n:
                self.rows += [first, n, *(c[i] for c in columns)]
                first += -(-n // BLOCK)
        self.programs, self.n_rows = first, len(self.rows) // self.cols
        self.aligned = all(v % ALIGN == 0 for i, v in enumerate(self.rows) if i % self.cols)
        self.device: torch.Tensor | None = None

    def _offsets(self, tensors: list[torch.Tensor], numels: list[int]) -> list[int]:
        if len(tensors) != len(numels):
            raise ValueError(f"{self.op}: an operand has {len(tensors)} tensors; the first has {len(numels)}")
        base = first_nonempty(tensors)
        if base is None:
            return [0] * len(tensors)
        ptr, size, dtype, device = base.data_ptr(), base.element_size(), base.dtype, base.device
        out = []
        for i, (t, n) in enumerate(zip(tensors, numels)):
            if t.numel() != n or t.dtype != dtype or not t.is_contiguous() or t.device != device:
                raise ValueError(f"{self.op}: tensor {i} of an operand ({t.numel()} elements, {t.dtype} on {t.device}, "
                                 f"strides {t.stride()}) must be contiguous with {n} elements, {dtype} on {device} "
                                 "like the operand's first")
            out.append((t.data_ptr() - ptr) // size if n else 0)
        return out

    def host(self) -> torch.Tensor:
        """int64 [rows, 3 + operands]: first program, numel, slot offset, offset in each operand."""
        return torch.tensor(self.rows, dtype=torch.int64).view(-1, self.cols)

    def check_slots(self, slots: torch.Tensor | list[torch.Tensor]) -> None:
        if isinstance(slots, torch.Tensor) and (not slots.is_contiguous() or slots.numel() != self.slot_numel):
            raise ValueError(f"{self.op}: the slot tensor must be contiguous with {self.slot_numel} elements (one "
                             f"slot per tensor, end to end); got shape {tuple(slots.shape)}, strides {slots.stride()}")


def first_nonempty(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    return next((t for t in tensors if t.numel()), None)


def momentum_table(grads: list[torch.Tensor], bufs: list[torch.Tensor],
                   out: torch.Tensor | list[torch.Tensor] | None = None) -> Table:
    """The table of `nesterov_momentum_multi_(grads, bufs, out)` (out None: one tensor to come, slots end to end)."""
    return Table("nesterov_momentum_multi_", out, grads, bufs)


def decay_add_table(params: list[torch.Tensor], update: torch.Tensor | list[torch.Tensor] | None = None,
                    shadows: list[torch.Tensor] | None = None) -> Table:
    """The table of `decay_add_multi_(params, update, shadows=shadows)` (update None: one tensor to come, slots end
    to end)."""
    return Table("decay_add_multi_", update, params, *([shadows] if shadows is not None else []))


def send_tables(tables: list[Table], device: torch.device | str) -> None:
    """Put every table on `device` in one asynchronous copy (no host sync), as views of one buffer."""
    flat = host_to_device(torch.tensor([v for t in tables for v in t.rows], dtype=torch.int64), device)
    for t, piece in zip(tables, flat.split([len(t.rows) for t in tables])):
        t.device = piece.view(-1, t.cols)


def _prepare(table: Table | None, make, slots, skip_if: torch.Tensor | None, lists: list[list[torch.Tensor]],
             triton_: bool | None, names: tuple[str, ...], grad_scale: torch.Tensor | None = None,
             ) -> tuple[Table | None, list]:
    """(the table on the device, or None for the reference path; the kernel's pointer arguments). names: the
    slots' and each list's argument name, for errors."""
    bases = [slots if isinstance(slots, torch.Tensor) else first_nonempty(slots)] + [first_nonempty(l) for l in lists]
    if bases[1] is None:
        return None, []
    if table is None:
        table = make()
    table.check_slots(slots)
    # NOTE: a table checks each list on its own; the kernel reads every list as the first one's device's memory.
    for name, base in zip(names, bases):
        if base is not None and base.device != bases[1].device:
            raise ValueError(f"{table.op}: {name} is on {base.device}, {names[1]} on {bases[1].device}; "
                             "all must be on one device")
    for name, flag in (("skip_if", skip_if), ("grad_scale", grad_scale)):
        if flag is not None and (flag.numel() != 1 or flag.device != bases[1].device):
            raise ValueError(f"{table.op}: {name} must be a one-element tensor on {bases[1].device}; "
                             f"got shape {tuple(flag.shape)} on {flag.device}")
    if not _use_triton(bases[1], triton_):
        return None, bases
    if table.device is None:
        send_tables([table], bases[1].device)
    return table, bases


def nesterov_momentum_multi_(
    grads: list[torch.Tensor], bufs: list[torch.Tensor], out: torch.Tensor | list[torch.Tensor], momentum: float,
    nesterov: bool, *, skip_if: torch.Tensor | None = None, grad_scale: torch.Tensor | None = None,
    table: Table | None = None, triton_: bool | None = None,
) -> None:
    """bufs[i] <- momentum * bufs[i] + grads[i] (in place); out's slot i <- grads[i] + momentum * bufs[i] (Nesterov)
    or bufs[i], in out's dtype: every tensor of the lists in one launch.

    out: one contiguous tensor holding the slots end to end (a stacked Newton-Schulz input), or one tensor per
    slot. skip_if: nonzero leaves every buffer as it was (and writes zero directions). grad_scale: a one-element
    tensor on the device that multiplies every gradient as it is read (a trainer's clip coefficient), so the
    gradients need no pass of their own. table: `momentum_table` of the same tensors, possibly already sent
    (`send_tables`: several in one copy); None: built and sent here.
    """
    table, bases = _prepare(table, lambda: momentum_table(grads, bufs, out), out, skip_if, [grads, bufs], triton_,
                            ("out", "grads", "bufs"), grad_scale)
    if table is None:
        if bases:
            slots = out if isinstance(out, list) else out.reshape(-1).split([g.numel() for g in grads])
            for g, b, o in zip(grads, bufs, slots):
                reference.nesterov_momentum_(g.reshape(-1), b.view(-1), o.view(-1), momentum, nesterov, skip_if,
                                             grad_scale)
        return
    _nesterov_momentum_multi_kernel[(table.programs,)](
        table.device, table.n_rows, *bases, skip_if if skip_if is not None else table.device,
        grad_scale if grad_scale is not None else table.device, float(momentum), NESTEROV=bool(nesterov),
        HAS_SKIP=skip_if is not None, HAS_SCALE=grad_scale is not None, ALIGNED=table.aligned, BLOCK=BLOCK,
        num_warps=NUM_WARPS)


def decay_add_multi_(
    params: list[torch.Tensor], update: torch.Tensor | list[torch.Tensor], decay: float, alpha: float, *,
    shadows: list[torch.Tensor] | None = None, skip_if: torch.Tensor | None = None, table: Table | None = None,
    triton_: bool | None = None,
) -> None:
    """params[i] <- decay * params[i] + alpha * update's slot i, in place: every tensor of the list in one launch.

    update: one contiguous tensor holding the slots end to end (a Newton-Schulz output), or one tensor per slot
    (of one dtype, possibly lower than the parameters'). shadows: one contiguous tensor per parameter, of its numel
    and of one (lower) dtype, written with the new parameter rounded to it (the parameter's cast, in the same pass
    that writes it). skip_if: nonzero leaves every parameter and shadow as it was. table: `decay_add_table` of the
    same tensors, possibly already sent; None: built and sent here.
    """
    lists, names = [params], ("update", "params")
    if shadows is not None:
        lists, names = [params, shadows], (*names, "shadows")
    table, bases = _prepare(table, lambda: decay_add_table(params, update, shadows), update, skip_if, lists, triton_,
                            names)
    if table is None:
        if bases:
            slots = update if isinstance(update, list) else update.reshape(-1).split([p.numel() for p in params])
            for i, (p, u) in enumerate(zip(params, slots)):
                reference.decay_add_(p.view(-1), u.reshape(-1), decay, alpha, skip_if,
                                     shadow=shadows[i].view(-1) if shadows is not None else None)
        return
    if table.cols != 3 + len(lists):
        raise ValueError(f"decay_add_multi_: the table has {table.cols - 3} operands; shadows "
                         f"{'given' if shadows is not None else 'not given'} needs {len(lists)}")
    u_base, p_base, *s_base = bases
    _decay_add_multi_kernel[(table.programs,)](
        table.device, table.n_rows, u_base, p_base, s_base[0] if s_base else p_base,
        skip_if if skip_if is not None else table.device, float(decay), float(alpha), HAS_SKIP=skip_if is not None,
        HAS_SHADOW=shadows is not None, ALIGNED=table.aligned, BLOCK=BLOCK, num_warps=NUM_WARPS)


# NOTE: A^2 of k3-mini's [256, 256] Gram matrices: cuBLAS's baddbmm ran at 211 TFLOP/s on an H200 against 472 for a
# plain bmm of the same shape (benchmarks/results/muon.md): beta != 0 costs a copy of A into the output and a
# read of it in the epilogue. Here the epilogue reads A's tile once, and A^2 being symmetric, only the tiles on
# and above the diagonal are computed (each written twice).
# NOTE: 128 x 128 tiles, BLOCK_K 64, 4 warps, 3 stages: the fastest of six configs at [3872, 256, 256] (0.50 ms
# against 0.62-0.68 ms for 8 warps or other tiles; benchmarks/newton_schulz.py).
POLY_BLOCK_K = 64
MAX_GRID_Y = 65535


@triton.jit
def ns_poly_epilogue(acc, av, rows, cols, t, s, ca, cb, cc, HAS_T: tl.constexpr):
    """A tile of B' = s t (a I + b t^2 A + c t^4 A^2) in float32 from acc = its tile of A^2 and av = its tile of A
    (rows, cols: the tile's indices in the matrix; t = 1 unless HAS_T)."""
    t2 = t * t
    val = cc * t2 * t2 * acc + cb * t2 * av
    val = tl.where(rows[:, None] == cols[None, :], val + ca, val) * (s * t)
    if HAS_T:
        val = tl.where(t == 0.0, 0.0, val)  # an overflowed norm zeroes the matrix (0 * inf would be nan)
    return val


@triton.jit
def _ns_poly_kernel(a_ptr, out_ptr, sumsq_ptr, first, m, n_tiles, ca, cb, cc, scale, eps, HAS_SUMSQ: tl.constexpr,
                    IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    # NOTE: the tiles of one matrix are neighbours in launch order (axis 0), so its A is read from HBM once and
    # from L2 by its other tiles.
    bid = first + tl.program_id(1).to(tl.int64)
    # axis 0 walks the upper triangle of tiles row by row: (0, 0), (0, 1), .., (1, 1), ..
    p = tl.program_id(0)
    ti = p * 0
    left = n_tiles
    while p >= left:
        p -= left
        ti += 1
        left -= 1
    tj = ti + p
    base = bid * m * m
    rows = ti * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tj * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < m
    col_ok = cols < m
    acc = tl.zeros((BLOCK_M, BLOCK_M), dtype=tl.float32)
    for k0 in range(0, m, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < m
        x = tl.load(a_ptr + base + rows[:, None] * m + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        y = tl.load(a_ptr + base + ks[:, None] * m + cols[None, :], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if IEEE:
            acc = tl.dot(x, y, acc, input_precision="ieee")
        else:
            acc = tl.dot(x, y, acc)
    tile = rows[:, None] * m + cols[None, :]
    ok = row_ok[:, None] & col_ok[None, :]
    av = tl.load(a_ptr + base + tile, mask=ok, other=0.0).to(tl.float32)
    t = 1.0
    if HAS_SUMSQ:
        t = 1.0 / (tl.sqrt(tl.load(sumsq_ptr + bid).to(tl.float32)) + eps)
    val = ns_poly_epilogue(acc, av, rows, cols, t, scale, ca, cb, cc, HAS_SUMSQ).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + base + tile, val, mask=ok)
    if tj > ti:
        # the mirror tile: element (r, c) of this tile is (c, r) of the result
        tl.store(out_ptr + base + cols[None, :] * m + rows[:, None], val, mask=ok)


def ns_polynomial(
    A: torch.Tensor, coeffs: tuple[float, float, float], *, scale: float = 1.0, sumsq: torch.Tensor | None = None,
    eps: float = 1e-7, triton_: bool | None = None,
) -> torch.Tensor:
    """A Newton-Schulz step's B' = scale * t * (a I + b t^2 A + c t^4 A^2), A [B, m, m] symmetric -> new [B, m, m].

    t = 1 / (sqrt(sumsq[b]) + eps) with sumsq [B] (the squared norm of the step's raw input, for the first step),
    else 1. One launch: A^2 on the tensor cores (float32 accumulation), the rest in its epilogue, only the upper
    triangle of tiles computed (A^2 of a symmetric A is symmetric). A is read only here; the reference (CPU, and
    float64 anywhere) scales it in place.
    """
    if A.ndim != 3 or A.shape[1] != A.shape[2] or not A.is_contiguous():
        raise ValueError(f"ns_polynomial: A must be contiguous [B, m, m]; got {tuple(A.shape)} (strides {A.stride()})")
    if sumsq is not None and (sumsq.shape != A.shape[:1] or sumsq.device != A.device):
        raise ValueError(f"ns_polynomial: sumsq must be [B] = [{A.shape[0]}] on A's device {A.device}; got "
                         f"{tuple(sumsq.shape)} on {sumsq.device}")
    if A.dtype == torch.float64 or not _use_triton(A, triton_):
        return reference.ns_polynomial(A, coeffs, scale=scale, sumsq=sumsq, eps=eps)
    B, m = A.shape[0], A.shape[1]
    out = torch.empty_like(A)
    block = 128 if m > 64 else max(16, triton.next_power_of_2(m))
    n_tiles = triton.cdiv(m, block)
    a, b, c = coeffs
    for first in range(0, B if m else 0, MAX_GRID_Y):  # a launch's second grid axis holds at most 65,535
        _ns_poly_kernel[(n_tiles * (n_tiles + 1) // 2, min(MAX_GRID_Y, B - first))](
            A, out, sumsq.contiguous() if sumsq is not None else A, first, m, n_tiles, float(a), float(b), float(c),
            float(scale), float(eps), HAS_SUMSQ=sumsq is not None, IEEE=A.dtype == torch.float32, BLOCK_M=block,
            BLOCK_K=POLY_BLOCK_K if m >= POLY_BLOCK_K else 16, num_warps=4, num_stages=3)
    return out
