"""KDA on a chunk layout of fixed shape: packed documents padded to a capacity (zero-length documents, padding chunks).

A captured CUDA graph replays one layout's shapes with new values, so `chunk_layout(..., capacity)` pads the
documents and the chunk table and `chunk_kda(..., chunk_layout=...)` takes them as device tensors. Padding must
change nothing: the real documents' outputs and gradients equal the unpadded layout's and the float64 reference's.
The Triton runs fill every torch.empty with NaN (deterministic mode), so that a padding chunk writing garbage
into a buffer that is later read or summed shows up as NaN. On CPU the kernels run in Triton's interpreter.
"""

import pytest
import torch
import triton

from kernels.kda import chunk_kda, chunk_kda_reference, l2norm
from kernels.kda.common import BT, chunk_layout
from kernels.kda.reference import check_cu_seqlens_values
from kda_launch import launch_settings

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
H, K, V = 1, 32, 16
# Padded against unpadded: the same kernels on the same chunks (sums over more, zero, partials may round apart).
SAME_TOL = 1e-6
# float32 kernels against the float64 reference at these widths and lengths: the interpreter gave at most 1.2e-6
# (outputs) and 8.7e-6 (gradients, ddt_bias) over the cases below.
OUT_TOL, GRAD_TOL = 1e-4, 1e-3


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    """sqrt(mean((a-b)^2)) / sqrt(mean(b^2)), absolute where b is all zeros."""
    a, b = a.double().cpu(), b.double().cpu()
    err, ref = (a - b).pow(2).mean().sqrt().item(), b.pow(2).mean().sqrt().item()
    return err / ref if ref > 0 else err


class nan_filled_empty:
    """torch.empty (and empty_like, new_empty) filled with NaN inside a with block; both settings restored after."""

    def __enter__(self):
        self.kept = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
                     torch.utils.deterministic.fill_uninitialized_memory)
        torch.use_deterministic_algorithms(True)
        torch.utils.deterministic.fill_uninitialized_memory = True
        assert torch.empty(3).isnan().all()  # otherwise the checks below prove nothing

    def __exit__(self, *exc):
        torch.use_deterministic_algorithms(self.kept[0], warn_only=self.kept[1])
        torch.utils.deterministic.fill_uninitialized_memory = self.kept[2]


def document_lengths(seed: int) -> list[int]:
    """A shuffled pack of one token, under a block (16), under a chunk (64), exactly a chunk, and ragged tails."""
    gen = torch.Generator().manual_seed(seed)

    def rand(lo, hi):
        return int(torch.randint(lo, hi + 1, (1,), generator=gen))

    lengths = [1, rand(2, 15), rand(17, 63), 64, 64 + rand(1, 63)]
    return [lengths[i] for i in torch.randperm(len(lengths), generator=gen).tolist()]


def packed_inputs(T: int, rows: int, seed: int, gate: str | None) -> dict:
    """float64 inputs of one packed row of T tokens, an initial state of `rows` documents, cotangents, gate params."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    x = dict(q=randn(1, T, H, K), k=l2norm(randn(1, T, H, K)), v=randn(1, T, H, V),
             beta=torch.rand(1, T, H, generator=gen, dtype=torch.float64) * 0.98 + 0.01,
             h0=randn(rows, H, K, V) * 0.5, do=randn(1, T, H, V), dS=randn(rows, H, K, V))
    if gate is None:
        x["g"] = -5.0 * torch.rand(1, T, H, K, generator=gen, dtype=torch.float64)
    else:
        x["g"], x["A_log"], x["dt_bias"] = randn(1, T, H, K) * 2, randn(H) * 0.5, randn(H, K)
    return x


def run(fn, x: dict, documents: int, *, dtype, device, with_h0: bool, lower_bound, **kwargs) -> dict:
    """fn's output, final state and gradients (q, k, v, g, beta, h0, A_log, dt_bias) for the first `documents`
    rows of the initial state and of the final state's cotangent."""
    names = ["q", "k", "v", "g", "beta"] + (["h0"] if with_h0 else []) + (["A_log", "dt_bias"] if "A_log" in x else [])
    leaves = {n: (x[n][:documents] if n == "h0" else x[n]).to(device, dtype).requires_grad_(True) for n in names}
    gate = dict(A_log=leaves["A_log"], dt_bias=leaves["dt_bias"], gate_lower_bound=lower_bound) if "A_log" in x else {}
    o, S = fn(*(leaves[n] for n in ("q", "k", "v", "g", "beta")), initial_state=leaves.get("h0"),
              output_final_state=True, **gate, **kwargs)
    loss = (o * x["do"].to(o)).sum() + (S * x["dS"][:documents].to(S)).sum()
    grads = torch.autograd.grad(loss, list(leaves.values()))
    return {"o": o.detach(), "S": S.detach(), **{"d" + n: g for n, g in zip(names, grads)}}


# (gate, lower bound, ops.LAUNCH["safe"], initial state): the plain log decay, the safe gate on the exact path and on
# the bounded fused backward (FUSE_INTRA), the softplus gate.
CASES = {
    "plain": (None, None, dict(diag_dot=0, fuse_bwd=0), True),
    "plain-no-h0": (None, None, dict(diag_dot=0, fuse_bwd=0), False),
    "safe-exact": ("safe", -5.0, dict(diag_dot=0, fuse_bwd=0), True),
    "safe-fused": ("safe", -5.0, dict(diag_dot=1, fuse_bwd=1), True),
    "softplus": ("softplus", None, dict(diag_dot=0, fuse_bwd=0), True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_padded_layout_equals_unpadded_and_reference(case):
    gate, lower_bound, safe, with_h0 = CASES[case]
    seed = list(CASES).index(case)
    lengths = document_lengths(seed)
    N, T = len(lengths), sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    x = packed_inputs(T, N + 5, seed, gate)
    common = dict(with_h0=with_h0, lower_bound=lower_bound)
    with launch_settings(safe=safe), nan_filled_empty():
        unpadded = run(chunk_kda, x, N, dtype=torch.float32, device=DEVICE, cu_seqlens=cu, **common)
    ref = run(chunk_kda_reference, x, N, dtype=torch.float64, device="cpu", cu_seqlens=cu, **common)
    for name in unpadded:
        assert rel_rms(unpadded[name], ref[name]) < (OUT_TOL if name in ("o", "S") else GRAD_TOL), name
    for capacity in (N + 1, N + 5):
        layout = chunk_layout(1, T, cu, DEVICE, capacity)[:3]
        with launch_settings(safe=safe), nan_filled_empty():
            padded = run(chunk_kda, x, capacity, dtype=torch.float32, device=DEVICE, chunk_layout=layout, **common)
        assert all(torch.isfinite(t).all() for t in padded.values()), capacity
        for name, t in padded.items():
            real = t[:N] if name in ("S", "dh0") else t
            assert rel_rms(real, unpadded[name]) < SAME_TOL, (capacity, name)
        # A padding document has no tokens: its final state is its initial state, the gradient passes straight back.
        h0_pad = x["h0"][N:capacity].float() if with_h0 else torch.zeros(capacity - N, H, K, V)
        assert torch.equal(padded["S"][N:].cpu(), h0_pad), capacity
        if with_h0:
            assert torch.equal(padded["dh0"][N:].cpu(), x["dS"][N:capacity].float()), capacity
        # The float64 reference takes the padded boundaries (zero-length documents) as they are.
        ref_padded = run(chunk_kda_reference, x, capacity, dtype=torch.float64, device="cpu",
                         cu_seqlens=layout[0].cpu().long(), **common)
        for name in padded:
            assert rel_rms(padded[name], ref_padded[name]) < (OUT_TOL if name in ("o", "S") else GRAD_TOL), name


def test_zero_length_documents_inside_the_pack():
    """Zero-length documents among real ones (first, middle, last): no chunks, their states pass through."""
    lengths = [0, 5, 0, 0, 70, 0]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    x = packed_inputs(sum(lengths), len(lengths), 7, None)
    common = dict(with_h0=True, lower_bound=None)
    with nan_filled_empty():
        out = run(chunk_kda, x, len(lengths), dtype=torch.float32, device=DEVICE, cu_seqlens=cu, **common)
    ref = run(chunk_kda_reference, x, len(lengths), dtype=torch.float64, device="cpu", cu_seqlens=cu, **common)
    for name in out:
        assert rel_rms(out[name], ref[name]) < (OUT_TOL if name in ("o", "S") else GRAD_TOL), name
    empty = [i for i, n in enumerate(lengths) if n == 0]
    assert torch.equal(ref["S"][empty], x["h0"][empty]) and torch.equal(out["S"][empty].cpu(), x["h0"][empty].float())


def test_padded_layout_tables():
    """The padded table: real rows first and as unpadded, then zero-length documents at B*T and padding chunks
    (chunk 0 of the last document) up to cdiv(B*T, 64) + capacity rows."""
    cu = torch.tensor([0, 1, 64, 64, 200])
    real = chunk_layout(1, 200, cu, "cpu")
    cu_p, chunks_p, offsets_p, N, NT = chunk_layout(1, 200, cu, "cpu", 7)
    assert (N, NT) == (7, triton.cdiv(200, BT) + 7) and real[3:] == (4, 5)
    assert cu_p.dtype == chunks_p.dtype == offsets_p.dtype == torch.int32
    assert cu_p.tolist() == [0, 1, 64, 64, 200, 200, 200, 200]
    assert chunks_p[:5].tolist() == real[1].tolist() == [[0, 0], [1, 0], [3, 0], [3, 1], [3, 2]]
    assert chunks_p[5:].tolist() == [[6, 0]] * (NT - 5)
    assert offsets_p.tolist() == real[2].tolist() + [5] * 3 == [0, 1, 2, 2, 5, 5, 5, 5]


@pytest.mark.parametrize("capacity", [3, 2])
def test_capacity_must_leave_a_padding_document(capacity):
    with pytest.raises(ValueError, match=f"3 documents need capacity > 3 .*got capacity={capacity}$"):
        chunk_layout(1, 10, torch.tensor([0, 2, 5, 10]), "cpu", capacity)
    with pytest.raises(ValueError, match="capacity=4 pads packed documents"):
        chunk_layout(2, 10, None, "cpu", 4)


def test_boundaries_may_repeat_but_never_fall():
    check_cu_seqlens_values([0, 0, 3, 3, 10, 10], 10)
    with pytest.raises(ValueError, match="cu_seqlens must rise"):
        check_cu_seqlens_values([0, 4, 3, 10], 10)


def _layout_of(T=100):
    return chunk_layout(1, T, torch.tensor([0, 30, T]), DEVICE, 4)[:3]


@pytest.mark.parametrize(
    "bad",
    [
        lambda cu, ci, co: (cu.long(), ci, co),  # int64 boundaries
        lambda cu, ci, co: (cu, ci.reshape(-1), co),  # 1-D chunk table
        lambda cu, ci, co: (cu, torch.cat([ci, ci[:, :1]], 1), co),  # [NT, 3]
        lambda cu, ci, co: (cu, ci, co[:-1]),  # chunk_offsets shorter than cu_seqlens
        lambda cu, ci, co: (cu[:1], ci, co[:1]),  # no document
        lambda cu, ci, co: (cu, ci, co.to("meta")),  # another device
        lambda cu, ci, co: (cu, ci),  # two tensors
        lambda cu, ci, co: (cu.tolist(), ci, co),  # a list
    ],
)
def test_malformed_layout_is_one_line_value_error(bad):
    x = torch.zeros(1, 100, 1, 16, device=DEVICE)
    with pytest.raises(ValueError, match=r"^chunk_layout must be \(cu_seqlens int32 \[N\+1\].*got \(") as err:
        chunk_kda(x, x, x, x, torch.zeros(1, 100, 1, device=DEVICE), chunk_layout=bad(*_layout_of()))
    assert "\n" not in str(err.value)


def test_layout_needs_one_row_and_its_document_count_of_initial_states():
    x = torch.zeros(2, 50, 1, 16, device=DEVICE)
    with pytest.raises(ValueError, match="chunk_layout needs B == 1"):
        chunk_kda(x, x, x, x, torch.zeros(2, 50, 1, device=DEVICE), chunk_layout=_layout_of())
    x = torch.zeros(1, 100, 1, 16, device=DEVICE)
    with pytest.raises(ValueError, match=r"initial_state must be \[N, H, K, V\] = \[4, "):
        chunk_kda(x, x, x, x, torch.zeros(1, 100, 1, device=DEVICE), chunk_layout=_layout_of(),
                  initial_state=torch.zeros(2, 1, 16, 16, device=DEVICE))


def test_compiled_with_a_layout_of_two_document_counts():
    """One compiled graph (fullgraph, dynamic) serves layouts of two capacities; values and gradients equal eager's."""
    from torch._dynamo.testing import CompileCounterWithBackend

    T = 90
    x = packed_inputs(T, 6, 11, None)

    def loss(q, k, v, g, beta, h0, cu, chunk_indices, chunk_offsets):
        o, S = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                         chunk_layout=(cu, chunk_indices, chunk_offsets))
        return (o * o).sum() + S.sum()

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(loss, backend=counter, fullgraph=True, dynamic=True)
    for boundaries, capacity in (([0, 40, T], 3), ([0, 10, 11, 70, T], 6)):
        layout = chunk_layout(1, T, torch.tensor(boundaries), DEVICE, capacity)[:3]
        for t in layout:
            torch._dynamo.maybe_mark_dynamic(t, 0)
        leaves = [x[n].to(DEVICE, torch.float32).requires_grad_(True) for n in ("q", "k", "v", "g", "beta")]
        leaves.append(x["h0"][:capacity].to(DEVICE, torch.float32).requires_grad_(True))
        l_c = compiled(*leaves, *layout)
        grads_c = torch.autograd.grad(l_c, leaves)
        l_e = loss(*leaves, *layout)
        grads_e = torch.autograd.grad(l_e, leaves)
        assert torch.allclose(l_c, l_e)
        for a, b in zip(grads_c, grads_e):
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)
    assert counter.frame_count == 1
