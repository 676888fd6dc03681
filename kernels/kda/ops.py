"""The public `chunk_kda`: the Triton forward and backward as two custom ops joined by autograd.

Legend: B batch, T tokens, H heads, K/V widths, N sequences, NT chunks (64 tokens).
"""

import functools

import torch
import triton

from kernels.device import triton_runs_on
from kernels.kda import bwd, fwd, smem
from kernels.kda.common import BC, BT, bounded_gate, chunk_layout, dot_precision
from kernels.kda.reference import DEFAULT_GATE_LOWER_BOUND, check_kda_inputs, l2norm


# Launch settings of every kernel, fixed (no autotuning): a first call only compiles. "BV" is the V tile of
# the two sequential state walks (their programs are V tiles x sequences x heads) and of the dense gradient
# kernel's V loop, "BK" the K tile of the kernels that hold a whole chunk's q, k, b tiles.
# `benchmarks/kda.py --sweep` / `--candidates` time alternatives; these won on an H200 (benchmarks/results/kda.md).
# "fill_sms" lets a state walk halve its BV (down to 32) while twice its programs still fit one wave of the
# GPU's SMs (`fill_bv`): k3-mini's 8 sequences x 4 heads at BV=64 are 64 programs, half of an H200's 132 SMs.
# NOTE: fewer than 8 warps on the state walks spill their [K, BV] float32 state and triple compile time.
# NOTE: the scores and intra-gradient kernels run unpipelined (num_stages=1) on purpose: Triton 3.6 pipelines
# their K loop wrongly around the exact column-loop branch, and a bf16 hard reset (g = -1000) then gave
# non-finite A; unpipelined they are also 4-10% faster. Their num_stages here applies to the bounded path
# alone (no column loop); the exact path always runs unpipelined.
# "safe" picks the fused safe gate's paths when its lower bound bounds every 16-row block (`common.bounded_gate`,
# lb >= -7.5): diag_dot=1 compiles the scores kernel without the run-time block check and the exact column loop
# (`BOUNDED`) and needs fuse_bwd=1, which has the dense gradient kernel add the
# intra-chunk terms itself ("dfused": its launch), so `_dintra_kernel` and the round trip of dM, dA and float32
# dq, dk, db through memory go away. A precomputed g (or the softplus gate) always takes the exact path.
# NOTE: the default is the exact path: on an H200 with Triton 3.6 at the k3-mini shape it ran 2.12 ms fwd+bwd,
# the bounded unfused path 2.17 and the fused one 2.95 (its kernel spills; benchmarks/results/kda.md).
# Every call fits these settings to the GPU's shared memory (`launch_plan`, bounds in kernels/kda/smem.py): a kernel
# whose bound exceeds it runs unpipelined, then with narrower V tiles. At K = V <= 128 in bfloat16 the table fits
# as is; K = 256 runs the backward state walk unpipelined.
# NOTE: the bounded unfused path (diag_dot=1, fuse_bwd=0) is refused: on an H200 (Triton 3.6) its dq was wrong
# (float32 against the float64 recurrence, random and pinned gates) while the exact and fused paths matched,
# and the CPU interpreter passed all three. "safe.diag_dot=1;safe.fuse_bwd=1" as --candidates times the fused one.
LAUNCH = {
    "safe": dict(diag_dot=0, fuse_bwd=0),
    "decay": dict(num_warps=4, num_stages=1),
    "scores": dict(BK=32, num_warps=4, num_stages=1),
    "solve": dict(num_warps=2, num_stages=1),
    "wy": dict(num_warps=4, num_stages=2),
    "state": dict(BV=64, fill_sms=True, num_warps=8, num_stages=2),
    "output": dict(num_warps=4, num_stages=2),
    "dstate": dict(BV=64, fill_sms=True, num_warps=8, num_stages=2),
    "dchunk": dict(BK=64, BV=64, num_warps=8, num_stages=2),
    "dintra": dict(BK=32, num_warps=4, num_stages=1, split=1),
    "dfused": dict(BK=64, BV=64, num_warps=8, num_stages=2),
    "ddecay": dict(num_warps=4, num_stages=1),
}


# The decayed-product gradients' input precision for bfloat16 / float16 calls (bwd.intra_dot), by the "split" of
# `_dintra_kernel`: 0 three TF32 passes ("tf32", which intra_dot splits), 1 three bfloat16 passes (the fused backward,
# dfused, keeps three TF32 passes). Both keep the float32 operands to ~16 bits or more, which the cancellation in
# the gate's gradient needs (one TF32 pass does not: bwd.intra_dot).
# NOTE: split=1 is the default: on an H200 (Triton 3.6, k3-mini shape B8 T4096 H4) it took KDA's forward + backward
# from 2.37 to 2.01 ms (plain gate) and 2.40 to 2.04 ms (safe gate), bfloat16 tensor-core products running at
# twice TF32's rate, with fla's float16 test cases as exact as in three TF32 passes (dt_bias 2.6e-4 to 4.9e-4
# against 2.5e-4 to 4.8e-4; benchmarks/results/kda.md, session 24).
INTRA_SPLITS = ("tf32", "bf16x3")


def intra_precision(dtype: torch.dtype, device: torch.device, opts: dict) -> tuple[dict, str]:
    """(opts without "split", the decayed-product gradients' input precision): float32 calls keep "ieee".

    NOTE: Triton's CPU interpreter refuses "bf16x3" (it multiplies float32 tiles in float32 whatever the setting),
    so a call there takes three TF32 passes: the same precision class, and the GPU tests check bf16x3 itself.
    """
    opts = dict(opts)
    split = opts.pop("split", 0)
    if dtype == torch.float32:
        return opts, "ieee"
    return opts, INTRA_SPLITS[split] if device.type == "cuda" else INTRA_SPLITS[0]


FLOAT32_MAX_WIDTH = 128
"""The widest K a float32 call takes on a GPU: `launch_plan`'s shared-memory fit refuses wider heads (the model's
kernel choice checks it at start-up, titan_k3/models/k3/impl.py; tests/kernels/test_kda_smem.py holds the two
together)."""

# What the widths' limit is, in words (the shared-memory fit of `launch_plan` decides it on a GPU).
SUPPORTED_WIDTHS = (f"K and V up to 256 in bfloat16 / float16, up to {FLOAT32_MAX_WIDTH} in float32 "
                    "on a GPU")


def _bounded(gate) -> tuple[bool, bool]:
    """(bounded, fused): whether this call takes the safe gate's bounded kernels, and its fused backward."""
    if LAUNCH["safe"]["diag_dot"] and not LAUNCH["safe"]["fuse_bwd"]:
        raise ValueError("kernels.kda LAUNCH['safe']: diag_dot=1 needs fuse_bwd=1 (the bounded forward with the unfused "
                         "backward gave wrong dq on an H200, tests/gpu/test_kda_gpu.py)")
    bounded = gate is not None and bounded_gate(gate[2]) and bool(LAUNCH["safe"]["diag_dot"])
    return bounded, bounded and bool(LAUNCH["safe"]["fuse_bwd"])


def _launch(name: str, K: int, V: int) -> dict:
    """LAUNCH[name] with its tile sizes capped to the problem's widths (and BV to 32 when K > 128)."""
    opts = dict(LAUNCH[name])
    if "BK" in opts:
        opts["BK"] = min(opts["BK"], max(16, triton.next_power_of_2(K)))
    if "BV" in opts:
        opts["BV"] = min(opts["BV"], 32 if K > 128 else 64, max(16, triton.next_power_of_2(V)))
    return opts


def fill_bv(bv: int, V: int, walks: int, sms: int) -> int:
    """The V tile of a state walk: `bv` halved (down to 32) while twice the programs still fit in one wave.

    walks = sequences x heads; each walks its chunks in order, one program per V tile, so a grid smaller
    than the SM count leaves SMs idle for the whole walk, while a second wave doubles it.
    """
    while bv > 32 and 2 * triton.cdiv(V, bv) * walks <= sms:
        bv //= 2
    return bv


def _sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 0 elsewhere (the CPU interpreter keeps the table's tiles)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 0


def _tiles(K: int, V: int) -> tuple[int, int, int]:
    """(BK_full, BK, BV): BK_full covers all of K for the state kernels; BK/BV tile the rest."""
    BK_full = max(16, triton.next_power_of_2(K))
    BK = min(64, BK_full)
    BV = min(64 if BK_full <= 128 else 32, max(16, triton.next_power_of_2(V)))
    return BK_full, BK, BV


def launch_plan(K: int, V: int, dtype: torch.dtype, walks: int, sms: int, gate, *, limit: int | None) -> dict:
    """The launch settings of every kernel one call runs: {kernel: opts}, opts holding the tiles
    (BK, BV) and num_warps / num_stages, each kernel's shared memory (`smem.shared_bytes`) within `limit`.

    walks = sequences x heads (the state walks' programs per V tile), sms the GPU's SM count (0: none);
    gate as `kda_forward` takes it. limit None (the CPU interpreter, which has no shared memory) skips
    the fitting. A kernel above the limit gives up pipelining first, then halves its V tile (down to 16);
    one that still does not fit stops the call with a ValueError before any kernel runs.
    The plans are cached per shape and LAUNCH table (read-only: every call of a layer reuses one).
    """
    bounded, fused = _bounded(gate)
    table = tuple((name, tuple(opts.items())) for name, opts in LAUNCH.items())
    return _cached_plan(K, V, dtype, walks, sms, bounded, fused, limit, table)


@functools.lru_cache(maxsize=256)
def _cached_plan(K, V, dtype, walks, sms, bounded, fused, limit, table) -> dict:
    """launch_plan's work; `table` (LAUNCH as tuples) is only the cache key: the helpers read LAUNCH itself.

    NOTE: cached because building a plan (a dozen bounds and fits) took ~0.1 ms of host time, three times per
    layer call, where the step is host-bound once the GPU is fast (see common._packed_layout).
    """
    _, BK, BV = _tiles(K, V)
    plan = {
        "decay": dict(BK=BK, **_launch("decay", K, V)),
        "scores": _split_launch("scores", K, V, bounded),
        "solve": _launch("solve", K, V),
        "wy": dict(BK=BK, BV=BV, **_launch("wy", K, V)),
        "state": _walk_launch("state", K, V, walks, sms),
        "output": dict(BK=BK, BV=BV, **_launch("output", K, V)),
        "dstate": _walk_launch("dstate", K, V, walks, sms),
        "ddecay": dict(BK=BK, **_launch("ddecay", K, V)),
    }
    if fused:
        plan["dfused"] = _launch("dfused", K, V)
    else:
        plan["dchunk"] = _dchunk_launch(K, V, dtype)
        plan["dintra"] = _split_launch("dintra", K, V, False)
    if limit is not None:
        plan = {name: _fit(name, opts, K, V, dtype, limit) for name, opts in plan.items()}
    return plan


def _fit(name: str, opts: dict, K: int, V: int, dtype: torch.dtype, limit: int) -> dict:
    """opts with num_stages, then BV, lowered until the kernel's shared memory is within limit; else ValueError."""
    opts = dict(opts)
    while (need := smem.shared_bytes(name, K, V, dtype, opts)) > limit:
        if opts["num_stages"] > 1:
            opts["num_stages"] -= 1
        elif opts.get("BV", 0) > 16:
            opts["BV"] //= 2
        else:
            raise ValueError(
                f"chunk_kda: K={K}, V={V} in {dtype} needs {need:,} bytes of shared memory in its {name} kernel "
                f"(unpipelined, V tiles of {opts.get('BV', '-')}), above the GPU's {limit:,}; {SUPPORTED_WIDTHS}"
            )
    return opts


def _split_launch(name: str, K: int, V: int, bounded: bool) -> dict:
    """LAUNCH[name] for the scores / intra-gradient kernels: unpipelined unless bounded (see the NOTE above)."""
    opts = _launch(name, K, V)
    if not bounded:
        opts["num_stages"] = 1
    return opts


def _walk_launch(name: str, K: int, V: int, walks: int, sms: int) -> dict:
    """LAUNCH settings of a state walk ("state", "dstate") over `walks` sequences x heads on `sms` SMs."""
    opts = _launch(name, K, V)
    if opts.pop("fill_sms", False):
        opts["BV"] = fill_bv(opts["BV"], V, walks, sms)
    return opts


def _sizes(T: int, batch: int, cu_seqlens, chunk_indices) -> tuple:
    """(N, NT): the sequences and the chunk table's rows, from shapes alone (`batch` sequences of T / batch,
    or the packed layout's tensors); a padded layout counts its padding documents and chunks."""
    if cu_seqlens is None:
        return batch, batch * triton.cdiv(_per_sequence(T, batch), BT)
    return cu_seqlens.shape[0] - 1, chunk_indices.shape[0]


def _per_sequence(T: int, batch: int) -> int:
    """T / batch, the tokens of each of `batch` sequences packed into T rows; 0 for an empty batch (B == 0)."""
    return T // batch if batch else 0


def _layout(T: int, batch: int, layout, device) -> tuple:
    """(cu_seqlens, chunk_indices, chunk_offsets, N, NT) of a call: the cached plain layout of `batch` sequences
    (layout None), or the packed documents' device tensors `layout` as given (their values are not read here)."""
    if layout is None:
        return chunk_layout(batch, _per_sequence(T, batch), None, device)
    return (*layout, *_sizes(T, batch, layout[0], layout[1]))


def _plan_for(K: int, V: int, dtype: torch.dtype, device: torch.device, walks: int, gate) -> dict:
    """launch_plan of a call on `device`, fitted to the GPU's shared memory there (CUDA)."""
    limit = smem.SHARED_LIMIT if device.type == "cuda" else None
    return launch_plan(K, V, dtype, walks, _sm_count(device), gate, limit=limit)


def _call(q, v, batch, layout, gate) -> tuple:
    """What the forward and the backward of one call share: (T, H, K, V, cu_seqlens, chunk_indices,
    chunk_offsets, N sequences, NT chunks, BK covering all of K, the launch plan, the dots' precision)."""
    T, H, K = q.shape
    cu, chunk_indices, chunk_offsets, N, NT = _layout(T, batch, layout, q.device)
    V = v.shape[-1]
    plan = _plan_for(K, V, q.dtype, q.device, N * H, gate)
    return T, H, K, V, cu, chunk_indices, chunk_offsets, N, NT, _tiles(K, V)[0], plan, dot_precision(q.dtype)


def kda_forward(q, k, v, g, beta, scale, h0, output_final_state, batch, layout, gate):
    """Runs the forward kernels on packed [T, H, *] tensors: `batch` sequences of T / batch (layout None)
    or packed documents, layout = (cu_seqlens, chunk_indices, chunk_offsets) int32 on q's device.

    gate: None (g is the log decay) or (A_log [H], dt_bias [H, K] or None, lower_bound or None).
    Returns o [T, H, V], the final state [N, H, K, V] float32 or None, and what backward needs.
    """
    T, H, K, V, cu, chunk_indices, chunk_offsets, N, NT, BK_full, plan, prec = _call(q, v, batch, layout, gate)
    dev = q.device
    b = torch.empty(T, H, K, device=dev, dtype=torch.float32)
    A_log, dt_bias, lower_bound = gate if gate is not None else (None, None, None)
    fwd._decay_kernel[(NT, triton.cdiv(K, plan["decay"]["BK"]), H)](
        g, b, A_log, dt_bias, chunk_indices, cu, 0.0 if lower_bound is None else float(lower_bound),
        H=H, K=K, BT=BT, HAS_GATE=gate is not None, HAS_DT_BIAS=dt_bias is not None,
        USE_LOWER_BOUND=lower_bound is not None, **plan["decay"],
    )
    # Every row of M and A is written whole, zeros above the diagonal included.
    M = torch.empty(T, H, BT, device=dev, dtype=torch.float32)
    A = torch.empty(T, H, BT, device=dev, dtype=torch.float32)
    bounded, _ = _bounded(gate)
    fwd._scores_kernel[(NT * (BT // BC), H)](
        q, k, b, M, A, chunk_indices, cu, scale, H=H, K=K, BT=BT, BC=BC, PREC=prec, BOUNDED=bounded,
        **plan["scores"],
    )
    Ai = torch.empty(T, H, BT, device=dev, dtype=torch.float32)
    fwd._solve_kernel[(NT, H)](A, beta, Ai, chunk_indices, cu, H=H, BT=BT, BC=BC, PREC=prec, **plan["solve"])
    Wk = torch.empty_like(k)
    Wv = torch.empty_like(v)
    fwd._wy_kernel[(NT, H)](
        k, v, b, beta, Ai, Wk, Wv, chunk_indices, cu, H=H, K=K, V=V, BT=BT, PREC=prec, **plan["wy"],
    )
    h = torch.empty(NT, H, K, V, device=dev, dtype=q.dtype)
    U = torch.empty_like(v)
    final = torch.empty(N, H, K, V, device=dev, dtype=torch.float32) if output_final_state else None
    state = plan["state"]
    fwd._state_kernel[(triton.cdiv(V, state["BV"]), N * H)](
        k, b, Wk, Wv, U, h, h0, final, cu, chunk_offsets,
        H=H, K=K, V=V, BT=BT, BK=BK_full, HAS_H0=h0 is not None, STORE_FINAL=output_final_state, PREC=prec, **state,
    )
    o = torch.empty_like(v)
    fwd._output_kernel[(triton.cdiv(V, plan["output"]["BV"]), NT, H)](
        q, b, h, M, U, o, chunk_indices, cu, scale, H=H, K=K, V=V, BT=BT, PREC=prec, **plan["output"],
    )
    return o, final, (b, M, A, Ai, Wk, h, U)


def kda_backward(q, k, v, g, beta, scale, h0, do, dht, batch, layout, gate, saved):
    """Runs the backward kernels; returns dq, dk, dv, dg (of the raw gate when fused), dbeta, dh0, dA_log, ddt_bias."""
    b, M, A, Ai, Wk, h, U = saved
    T, H, K, V, cu, chunk_indices, chunk_offsets, N, NT, BK_full, plan, prec = _call(q, v, batch, layout, gate)
    dev = q.device
    dh = torch.empty_like(h)
    dU = torch.empty_like(v)
    dh0 = torch.empty(N, H, K, V, device=dev, dtype=torch.float32) if h0 is not None else None
    dstate = plan["dstate"]
    bwd._dstate_kernel[(triton.cdiv(V, dstate["BV"]), N * H)](
        q, k, b, M, Wk, do, dht, dh, dU, dh0, cu, chunk_offsets, scale,
        H=H, K=K, V=V, BT=BT, BK=BK_full, HAS_DHT=dht is not None, HAS_H0=h0 is not None, PREC=prec, **dstate,
    )
    fused = "dfused" in plan
    db = torch.empty(T, H, K, device=dev, dtype=torch.float32)
    dv = torch.empty_like(v)
    dq_out, dk_out = torch.empty_like(q), torch.empty_like(k)
    if fused:
        dchunk = plan["dfused"]
        dq, dk, dM, dA = dq_out, dk_out, None, None
    else:
        dchunk = plan["dchunk"]
        dq, dk = torch.empty_like(db), torch.empty_like(db)
        dM = torch.empty(T, H, BT, device=dev, dtype=torch.float32)  # written whole by _dchunk_kernel
        dA = torch.empty_like(dM)
    NK = triton.cdiv(K, dchunk["BK"])
    dbeta = torch.empty(NK, T, H, device=dev, dtype=torch.float32)
    bwd._dchunk_kernel[(NT, NK, H)](
        q, k, v, b, beta, A, Ai, h, dh, U, dU, do, dq, dk, dv, db, dbeta, dM, dA, chunk_indices, cu, scale, T,
        H=H, K=K, V=V, BT=BT, BC=BC, PREC=prec, FUSE_INTRA=fused, **dchunk,
    )
    dbeta = dbeta.sum(0)
    if not fused:
        opts, intra_prec = intra_precision(q.dtype, q.device, plan["dintra"])
        bwd._dintra_kernel[(NT * (BT // BC), H)](
            q, k, b, dM, dA, dq, dk, db, dq_out, dk_out, chunk_indices, cu, H=H, K=K, BT=BT, BC=BC, PREC=intra_prec,
            **opts,
        )
    A_log, dt_bias, lower_bound = gate if gate is not None else (None, None, None)
    NKD = triton.cdiv(K, plan["ddecay"]["BK"])
    dg = torch.empty_like(g)
    dA_part = torch.empty(NT, NKD, H, device=dev, dtype=torch.float32) if gate is not None else None
    ddt_part = torch.empty(H, K, NT, device=dev, dtype=torch.float32) if dt_bias is not None else None
    bwd._ddecay_kernel[(NT, NKD, H)](
        db, g, A_log, dt_bias, dg, dA_part, ddt_part, chunk_indices, cu,
        0.0 if lower_bound is None else float(lower_bound),
        H=H, K=K, BT=BT, HAS_GATE=gate is not None, HAS_DT_BIAS=dt_bias is not None,
        USE_LOWER_BOUND=lower_bound is not None, **plan["ddecay"],
    )
    dA_log = dA_part.sum((0, 1)) if gate is not None else None
    ddt_bias = ddt_part.sum(-1) if dt_bias is not None else None
    return dq_out, dk_out, dv, dg, dbeta, dh0, dA_log, ddt_bias


# The autograd wrapper is a pair of custom ops so that torch.compile sees one opaque call (no graph
# break). Absent optional outputs are empty tensors: a custom op returns a fixed tuple of tensors.
# Packed documents come as their layout's three device tensors (None for a plain batch), sizes from their shapes:
# nothing is read on the host, so a captured CUDA graph replays the ops with new documents of one capacity.
_EMPTY = (0,)


@torch.library.custom_op("kernels_kda::chunk_fwd", mutates_args=())
def _chunk_fwd_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    h0: torch.Tensor | None, A_log: torch.Tensor | None, dt_bias: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None, chunk_indices: torch.Tensor | None, chunk_offsets: torch.Tensor | None,
    batch: int, scale: float, output_final_state: bool, lower_bound: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
           torch.Tensor, torch.Tensor]:
    gate = None if A_log is None else (A_log, dt_bias, lower_bound)
    layout = None if cu_seqlens is None else (cu_seqlens, chunk_indices, chunk_offsets)
    o, final, saved = kda_forward(q, k, v, g, beta, scale, h0, output_final_state, batch, layout, gate)
    return (o, q.new_empty(_EMPTY, dtype=torch.float32) if final is None else final, *saved)


@_chunk_fwd_op.register_fake
def _(q, k, v, g, beta, h0, A_log, dt_bias, cu_seqlens, chunk_indices, chunk_offsets, batch, scale,
      output_final_state, lower_bound):
    T, H, K = q.shape
    V = v.shape[-1]
    N, NT = _sizes(T, batch, cu_seqlens, chunk_indices)
    f32 = dict(dtype=torch.float32)
    return (
        torch.empty_like(v),
        q.new_empty((N, H, K, V) if output_final_state else _EMPTY, **f32),
        q.new_empty(T, H, K, **f32),
        *(q.new_empty(T, H, BT, **f32) for _ in range(3)),
        torch.empty_like(k),
        q.new_empty(NT, H, K, V),
        torch.empty_like(v),
    )


@torch.library.custom_op("kernels_kda::chunk_bwd", mutates_args=())
def _chunk_bwd_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    h0: torch.Tensor | None, A_log: torch.Tensor | None, dt_bias: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None, chunk_indices: torch.Tensor | None, chunk_offsets: torch.Tensor | None,
    b: torch.Tensor, M: torch.Tensor, A: torch.Tensor, Ai: torch.Tensor,
    Wk: torch.Tensor, h: torch.Tensor, U: torch.Tensor, do: torch.Tensor, dht: torch.Tensor | None,
    batch: int, scale: float, lower_bound: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
           torch.Tensor]:
    gate = None if A_log is None else (A_log, dt_bias, lower_bound)
    layout = None if cu_seqlens is None else (cu_seqlens, chunk_indices, chunk_offsets)
    dq, dk, dv, dg, dbeta, dh0, dA_log, ddt_bias = kda_backward(
        q, k, v, g, beta, scale, h0, do.contiguous(), None if dht is None else dht.contiguous(),
        batch, layout, gate, (b, M, A, Ai, Wk, h, U),
    )

    def or_empty(x, like):
        return q.new_empty(_EMPTY) if x is None else x.to(like.dtype)

    return (dq.to(q.dtype), dk.to(k.dtype), dv, dg.to(g.dtype), dbeta.to(beta.dtype),
            or_empty(dh0, h0), or_empty(dA_log, A_log), or_empty(ddt_bias, dt_bias))


@_chunk_bwd_op.register_fake
def _(q, k, v, g, beta, h0, A_log, dt_bias, cu_seqlens, chunk_indices, chunk_offsets, b, M, A, Ai, Wk, h, U, do, dht,
      batch, scale, lower_bound):
    def like_or_empty(x):
        return q.new_empty(_EMPTY) if x is None else torch.empty_like(x)

    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(g),
            torch.empty_like(beta), like_or_empty(h0), like_or_empty(A_log), like_or_empty(dt_bias))


def _setup_context(ctx, inputs, output):
    q, k, v, g, beta, h0, A_log, dt_bias, *layout, batch, scale, output_final_state, lower_bound = inputs
    ctx.save_for_backward(q, k, v, g, beta, h0, A_log, dt_bias, *layout, *output[2:])
    ctx.batch, ctx.scale, ctx.lower_bound, ctx.output_final_state = batch, scale, lower_bound, output_final_state


def _backward(ctx, do, dht, *_unused):
    q, k, v, g, beta, h0, A_log, dt_bias, *saved = ctx.saved_tensors
    if do is None:
        do = torch.zeros_like(v)
    dht = dht if ctx.output_final_state else None
    dq, dk, dv, dg, dbeta, dh0, dA_log, ddt_bias = _chunk_bwd_op(
        q, k, v, g, beta, h0, A_log, dt_bias, *saved, do, dht, ctx.batch, ctx.scale, ctx.lower_bound,
    )
    return (dq, dk, dv, dg, dbeta, None if h0 is None else dh0, None if A_log is None else dA_log,
            None if dt_bias is None else ddt_bias, None, None, None, None, None, None, None)


_chunk_fwd_op.register_autograd(_backward, setup_context=_setup_context)


def _dchunk_launch(K: int, V: int, dtype: torch.dtype) -> dict:
    """LAUNCH["dchunk"] for the unfused backward, unpipelined for float32 / float16 inputs over several K tiles.

    NOTE: on an H200 with Triton 3.6, float32 inputs with K = 128 (two K tiles, the `i_k == 0` products inside
    the pipelined V loop) took dq, dk and dg 40-120% off the float64 recurrence, down to one 16-token chunk,
    while bfloat16, K = 64 (one tile), the fused backward and the CPU interpreter matched. Unpipelined
    (num_stages=1) every gradient matched to ~1e-6 (benchmarks/results/kda.md, benchmarks/kda_precision.py);
    bfloat16, the training dtype, keeps the measured-best pipelined launch.
    """
    opts = _launch("dchunk", K, V)
    if dtype != torch.bfloat16 and triton.cdiv(K, opts["BK"]) > 1:
        opts["num_stages"] = 1
    return opts


def _check_layout(layout, device: torch.device) -> int:
    """N of a chunk_layout given to `chunk_kda`; one ValueError line unless it is three int32 tensors on
    `device`: cu_seqlens [N+1] (N >= 1), chunk_indices [NT, 2] (NT >= 1) and chunk_offsets [N+1]."""
    parts = list(layout) if isinstance(layout, (tuple, list)) else [layout]
    ok = len(parts) == 3 and all(isinstance(t, torch.Tensor) for t in parts)
    if ok:
        cu, chunk_indices, chunk_offsets = parts
        ok = (all(t.dtype == torch.int32 and t.device == device for t in parts)
              and cu.dim() == 1 and cu.shape[0] >= 2 and chunk_offsets.shape == cu.shape
              and chunk_indices.dim() == 2 and chunk_indices.shape[1] == 2 and chunk_indices.shape[0] >= 1)
    if not ok:
        got = ", ".join(f"{t.dtype} {tuple(t.shape)} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__
                        for t in parts)
        raise ValueError("chunk_layout must be (cu_seqlens int32 [N+1], chunk_indices int32 [NT, 2], chunk_offsets "
                         f"int32 [N+1]) on {device}, as common.chunk_layout(...)[:3] builds it, got ({got})")
    return parts[0].shape[0] - 1


# NOTE: reading the boundaries on the host is a graph break under torch.compile (and an error with fullgraph=True):
# a compiled caller builds the layout outside and passes chunk_layout.
@torch.compiler.disable
def _host_layout(cu_seqlens: torch.Tensor, T: int, device: torch.device) -> tuple:
    """(cu_seqlens, chunk_indices, chunk_offsets) of one packed row of T tokens, from boundaries read on the host."""
    return chunk_layout(1, T, cu_seqlens, device)[:3]


def chunk_kda(
    q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None, chunk_layout=None,
    A_log=None, dt_bias=None, gate_lower_bound=DEFAULT_GATE_LOWER_BOUND, use_qk_l2norm=False, beta_is_logit=False,
):
    """Chunked Kimi Delta Attention (docs/k3.md §2.1) in Triton, differentiable.

    q, k, g [B, T, H, K]; v [B, T, H, V]; beta [B, T, H]; q, k, v share one dtype (bfloat16, float16 or
    float32); state math and accumulation are float32. Widths: K, V <= 256, and on a GPU in float32
    K <= 128 (wider float32 heads exceed its shared memory: ValueError before any work, `launch_plan`).
    initial_state [N, H, K, V] float32. Packed documents (B == 1) come one of two ways:
    - cu_seqlens int64 [N+1] (zero-length documents allowed); it may live on the host (preferred: the
      lengths are then read without waiting for the GPU) and the chunk layout is built from it (cached);
    - chunk_layout = (cu_seqlens int32 [N+1], chunk_indices int32 [NT, 2], chunk_offsets int32 [N+1]) on
      q's device, as `kernels.kda.common.chunk_layout(1, T, cu, device, capacity)[:3]` builds it: used as
      is, nothing read on the host, so a CUDA graph replays it with new values of the same shapes. N counts
      its padding documents (capacity): initial_state has N rows, and the final state of a padding
      document is its initial state (zeros without one). cu_seqlens is then not read.
    Fused options: A_log [H] (with optional dt_bias [H, K]) turns g into the raw gate of the safe
    gate g = lb * sigmoid(exp(A_log) (g + dt_bias)), lb = gate_lower_bound (None: the softplus gate);
    use_qk_l2norm normalises q and k over K (eps 1e-6); beta_is_logit applies a sigmoid to beta.
    The gate runs inside the decay kernels (forward and backward); the L2 norm and the sigmoid
    run as PyTorch ops just before them, so that all three equal the unfused computation.
    Returns (o [B, T, H, V] in v's dtype, final state [N, H, K, V] float32 or None). B or T may be 0 (the final
    state is then the initial one).
    """
    documents = None if chunk_layout is None else _check_layout(chunk_layout, q.device)
    check_kda_inputs(q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias, documents=documents)
    if not triton_runs_on(q.device):
        raise ValueError(
            f"chunk_kda runs Triton kernels and needs CUDA tensors, got device {q.device}; "
            "use kernels.kda.chunk_kda_reference on CPU"
        )
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(
            f"q, k, v must share one dtype among bfloat16/float16/float32, got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    B, T, H, K = q.shape
    V = v.shape[-1]
    lower_bound = None if A_log is None or gate_lower_bound is None else float(gate_lower_bound)
    if chunk_layout is None and cu_seqlens is not None:
        chunk_layout = _host_layout(cu_seqlens, T, q.device)
    N = B if chunk_layout is None else chunk_layout[0].shape[0] - 1
    # Widths whose kernels exceed the GPU's shared memory stop here, before any work (one line, ValueError).
    # NOTE: not while torch.compile traces (dynamo warns at the plan cache's lru_cache on every compile): a compiled
    # call meets the same check in the op, where kda_forward plans before its first kernel.
    if not torch.compiler.is_compiling():
        _plan_for(K, V, q.dtype, q.device, N * H, None if A_log is None else (A_log, dt_bias, lower_bound))
    scale = K**-0.5 if scale is None else float(scale)
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    if beta_is_logit:
        beta = torch.sigmoid(beta)
    h0 = None if initial_state is None else initial_state.float().contiguous()

    def packed(x):
        return x.reshape(B * T, *x.shape[2:]).contiguous()

    o, final, *_ = _chunk_fwd_op(
        packed(q), packed(k), packed(v), packed(g), packed(beta), h0, A_log,
        None if dt_bias is None else dt_bias.contiguous(),
        *((None,) * 3 if chunk_layout is None else (t.contiguous() for t in chunk_layout)),
        B, scale, output_final_state, lower_bound,
    )
    return o.reshape(B, T, H, V), (final if output_final_state else None)
