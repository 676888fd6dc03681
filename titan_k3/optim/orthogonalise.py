"""Newton–Schulz orthogonalisation of Muon's blocks: the math Per-Head Muon runs on each block (docs/k3.md §6.1).

A Muon parameter is split into blocks that are orthogonalised on their own (`blocks_of`):
  2-D weight W [out, in], num_heads H   -> H row blocks [out/H, in]  (H = 1: the whole matrix)
  3-D weight W [E, a, b], per_expert    -> E matrices [a, b]
Blocks of one shape go through one batched `newton_schulz` call on [B, r, c], and each block's update is scaled
by `muon_scale` = 0.2 * sqrt(max(r, c)) so that its RMS roughly matches AdamW's. These are pure functions, so
that a sharded optimizer can call them on blocks it has gathered itself (titan_k3/optim/muon.py).
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor, Replicate
from torch.profiler import record_function

from kernels.muon import ns_polynomial
from kernels.muon.reference import NS_COEFFS  # the quintic's (a, b, c): every singular value into ~[0.7, 1.2]
from titan_k3.optim.spec import ParamSpec


def default_ns_dtype(device: torch.device) -> torch.dtype:
    """bf16 on GPU (tensor cores), float32 elsewhere (CPU bf16 matmuls are slow)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def newton_schulz(
    G: torch.Tensor, steps: int = 5, *, dtype: torch.dtype | None = None, eps: float = 1e-7, scale: float = 1.0,
    chunk: int = 0, overwrite: bool = False,
) -> torch.Tensor:
    """Approximately orthogonalise each matrix of G: O ~ scale * U V^T for G = U S V^T.

    G [..., m, n] -> O [..., m, n] in `dtype` (default: `default_ns_dtype(G.device)`), which must have float32's
    exponent range (bf16, float32, float64). Each matrix counts as divided by its Frobenius norm (+ eps), summed
    in float32 (float64 for float64), so that every singular value starts in [0, 1]; `scale` rides on the last
    step's matmul. `chunk` > 0 runs every step over `chunk` matrices at a time instead of all of them (the same
    math per matrix): a chunk's iterates and Gram matrices can stay in the GPU's L2 cache from one product to the
    next, where the whole batch goes through memory every product, and the temporaries shrink to a chunk's.
    `overwrite`: G is scratch and the result may be written over it (when G is contiguous, already in `dtype`
    and steps > 1: no output allocation; the returned tensor is then G itself).
    """
    if G.ndim < 2:
        raise ValueError(f"newton_schulz: G must have at least 2 dims [..., m, n]; got shape {tuple(G.shape)}")
    if steps < 1:
        raise ValueError(f"newton_schulz: steps={steps}; must be >= 1")
    if chunk < 0:
        raise ValueError(f"newton_schulz: chunk={chunk}; must be >= 0 (0: all matrices at once)")
    dtype = dtype or default_ns_dtype(G.device)
    if dtype not in (torch.bfloat16, torch.float32, torch.float64):
        # NOTE: the first Gram matrix is of the raw G (below); in float16 it overflows once a row's norm passes 256.
        raise ValueError(f"newton_schulz: dtype {dtype} lacks float32's exponent range; use bfloat16 or float32")
    X = G.to(dtype)  # no pass when the caller wrote G in the NS dtype (PerHeadMuon does)
    # NOTE: iterate on the wide orientation so that X X^T is the smaller Gram matrix: a tall X through a transposed
    # copy. (Iterating it in place from the right, X <- X B' with A = X^T X, took the same time on an H100 and was
    # removed: benchmarks/results/newton_schulz.md, session 46.)
    transposed = X.size(-2) > X.size(-1)
    X3 = X.mT if transposed else X
    X3 = X3.reshape(-1, *X3.shape[-2:])
    # NOTE: G is read only by the first step (a transposed G not even then: X3 is its copy), so from two steps on
    # the last product may write over it, chunk by chunk too (a chunk's rows of G are read only in its own steps).
    in_place = overwrite and steps > 1 and X is G and G.is_contiguous()
    out = G.view(-1, *G.shape[-2:]) if in_place else None
    if not 0 < chunk < X3.shape[0]:
        return _ns_iterate(X3, steps, eps, scale, transposed, out=out).reshape(G.shape)
    if out is None:
        out = torch.empty((X3.shape[0], *G.shape[-2:]), dtype=dtype, device=G.device)
    for first in range(0, X3.shape[0], chunk):
        _ns_iterate(X3[first:first + chunk], steps, eps, scale, transposed, out=out[first:first + chunk])
    return out.reshape(G.shape)


def _ns_iterate(X3: torch.Tensor, steps: int, eps: float, scale: float, transposed: bool,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """`newton_schulz`'s steps on X3 [k, m, n] (m <= n, the NS dtype) -> [k, m, n], or [k, n, m] if `transposed`
    (the caller's orientation), into `out` when given."""
    dtype = X3.dtype
    # NOTE: one step is X <- a X + b A X + c A^2 X = B' X with B' = a I + b A + c A^2 (A = X X^T): the
    # small [m, m] B' takes every coefficient (`ns_polynomial`: A^2 with the rest in its epilogue), so the big
    # [m, n] product is a plain bmm (a baddbmm on X would first copy all of X into its output).
    for step in range(steps):
        s = scale if step == steps - 1 else 1.0
        A = X3 @ X3.mT
        sumsq = None
        if step == 0:
            # NOTE: normalising G would be a pass over all of it. With r = 1 / (||G||_F + eps) per matrix, the
            # first step is r (a I + b r^2 G G^T + c (r^2 G G^T)^2) G: the scalars go on the small A (r^2) and
            # B' (r), and ||G||_F^2 = trace(G G^T) comes off A's diagonal instead of a pass over G.
            sumsq = A.diagonal(dim1=-2, dim2=-1).sum(-1, dtype=torch.promote_types(dtype, torch.float32))
        B = ns_polynomial(A, NS_COEFFS, scale=s, sumsq=sumsq, eps=eps)
        if step < steps - 1:
            X3 = torch.bmm(B, X3)
    # NOTE: the last step writes the caller's orientation, (B' X)^T = X^T B' (B' is symmetric), so the result is
    # contiguous and the update pass reads it in order (a transposed view reads strided).
    return torch.bmm(X3.mT, B, out=out) if transposed else torch.bmm(B, X3, out=out)


def muon_scale(rows: int, cols: int) -> float:
    """Update scale of one orthogonalised [rows, cols] block (matches AdamW's update RMS)."""
    return 0.2 * math.sqrt(max(rows, cols))


def blocks_of(x: torch.Tensor, spec: ParamSpec) -> torch.Tensor:
    """View a Muon parameter (or its gradient) as its blocks [B, r, c] (see the module docstring)."""
    if spec.per_expert:
        return x
    return x.reshape(spec.num_heads, x.shape[0] // spec.num_heads, x.shape[1])


def orthogonalise(
    direction: torch.Tensor, spec: ParamSpec, *, ns_steps: int = 5, ns_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Scaled, blockwise-orthogonalised update with the shape and dtype of `direction`.

    A DTensor direction is gathered, orthogonalised whole on every rank and
    handed back with its own placements.
    NOTE: that gather is the simple, correct single-node path: every rank
    repeats the Newton–Schulz work of every parameter. A sharded optimizer
    should instead assign blocks to ranks and call this on plain tensors.
    """
    if isinstance(direction, DTensor):
        full = orthogonalise(direction.full_tensor(), spec, ns_steps=ns_steps, ns_dtype=ns_dtype)
        mesh = direction.device_mesh
        replicated = DTensor.from_local(full, mesh, [Replicate()] * mesh.ndim, run_check=False)
        return replicated.redistribute(mesh, direction.placements)
    return orthogonalise_batched([direction], [spec], ns_steps=ns_steps, ns_dtype=ns_dtype)[0]


def orthogonalise_batched(
    directions: list[torch.Tensor], specs: list[ParamSpec], *, ns_steps: int = 5, ns_dtype: torch.dtype | None = None,
    cast: bool = True, graphs: "NewtonSchulzGraphs | None" = None, key=None, ns_chunk: int = 0,
) -> list[torch.Tensor]:
    """`orthogonalise` of each plain tensor, with every block of one [r, c] shape in one Newton–Schulz call.

    A step then launches a few kernels per block shape rather than per
    parameter (a k3-mini step was bound by those host launches). `cast=False`
    leaves each update in the NS dtype (the fused update pass reads it as is).
    With `graphs` (CUDA), each block shape's NS is a CUDA graph keyed by (`key`, shape); the updates are then
    views of the graphs' persistent outputs, valid until the same call next step.
    """
    blocks = [blocks_of(d, spec) for d, spec in zip(directions, specs)]
    out: list[torch.Tensor | None] = [None] * len(directions)
    for (rows, cols), idx in largest_first(by_block_shape(blocks), blocks):
        if graphs is not None:
            shape = (sum(blocks[i].shape[0] for i in idx), rows, cols)
            O = graphs.orthogonalise((key, rows, cols), [blocks[i] for i in idx], shape, ns_steps,
                                     ns_dtype or default_ns_dtype(blocks[idx[0]].device), ns_chunk)
        else:
            stacked = blocks[idx[0]] if len(idx) == 1 else torch.cat([blocks[i] for i in idx])
            O = orthogonalise_stacked(stacked, ns_steps, ns_dtype, ns_chunk)
        for i, u in zip(idx, O.split([blocks[i].shape[0] for i in idx])):
            out[i] = (u.to(directions[i].dtype) if cast else u).reshape(directions[i].shape)
    return out


def by_block_shape(blocks: list[torch.Tensor]) -> dict[tuple[int, int], list[int]]:
    """Indices of the [B, r, c] block tensors, grouped by (r, c) (one device and dtype assumed)."""
    groups: dict[tuple[int, int], list[int]] = {}
    for i, b in enumerate(blocks):
        groups.setdefault(tuple(b.shape[-2:]), []).append(i)
    return groups


def orthogonalise_stacked(stacked: torch.Tensor, ns_steps: int, ns_dtype: torch.dtype | None,
                          ns_chunk: int = 0, scratch: bool = False) -> torch.Tensor:
    """Scaled Newton–Schulz of blocks [B, r, c] of one shape, in the NS dtype (`newton_schulz`'s chunk: ns_chunk).

    scratch: `stacked` is the caller's scratch; with ns_chunk > 0 the update is written over it (no output
    allocation, `newton_schulz`'s overwrite).
    """
    rows, cols = stacked.shape[-2:]
    with record_function(f"muon.newton_schulz[{stacked.shape[0]}x{rows}x{cols}]"):
        return newton_schulz(stacked, ns_steps, dtype=ns_dtype, scale=muon_scale(rows, cols), chunk=ns_chunk,
                             overwrite=scratch and ns_chunk > 0)


def largest_first(groups: dict[tuple[int, int], list[int]], blocks: list[torch.Tensor]) -> list:
    """The (block shape, indices) groups ordered by total elements, largest first."""
    return sorted(groups.items(), key=lambda kv: -sum(blocks[i].numel() for i in kv[1]))
