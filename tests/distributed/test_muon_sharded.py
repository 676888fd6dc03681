"""Per-Head Muon on FSDP2-sharded parameters equals the single-process update, communicating only where it must.

Two gloo processes (float32 and bf16 momentum buffers); parameters are DTensors sharded on dim 0 like FSDP2
(including an uneven split and an empty shard). Heads that lie whole on one
shard and per-expert weights are orthogonalised locally: only the other
matrices may be gathered (one gather per parameter per step). A step skipped
on the device flag (`skip_if`) leaves every shard and momentum untouched.
"""

import functools

import pytest
import torch
import torch.distributed as dist

from gloo_workers import spawn_gloo
from titan_k3.optim import PerHeadMuon

WORLD = 2
CASES = {  # name: (shape, num_heads, per_expert, gathered?)
    "heads_aligned": ((8, 6), 4, False, False),     # 2 rows per head, 4 rows per rank
    "heads_straddle": ((15, 8), 3, False, True),    # 5 rows per head, 8 rows on rank 0
    "whole_matrix": ((9, 8), 1, False, True),
    "second_matrix": ((6, 4), 1, False, True),
    "experts_uneven": ((3, 6, 4), 1, True, False),  # 2 experts on rank 0, 1 on rank 1
    "one_row": ((1, 5), 1, False, False),           # whole on rank 0; rank 1 holds nothing
}


def _run(make, together=False, momentum_dtype=None, ns_chunk=0):
    """Three Muon steps on every case: one optimizer per parameter, or (together) one optimizer for all."""
    gen = torch.Generator().manual_seed(0)
    params, groups = {}, []
    for name, (shape, heads, per_expert, _) in CASES.items():
        params[name] = torch.nn.Parameter(make(torch.randn(shape, generator=gen)))
        groups.append({"params": [params[name]], "num_heads": heads, "per_expert": per_expert})
    kw = {"lr": 0.1, "momentum_dtype": momentum_dtype, "ns_chunk": ns_chunk}
    opts = [PerHeadMuon(groups, **kw)] if together else [PerHeadMuon([g], **kw) for g in groups]
    grads = [{n: torch.randn(CASES[n][0], generator=gen) for n in CASES} for _ in range(3)]
    for g in grads:
        for name, p in params.items():
            p.grad = make(g[name].clone())
        for opt in opts:
            opt.step()
    return params, opts


def _skipped_step_changes_nothing(params: dict, opts: list, make) -> bool:
    """One more step with NaN/inf gradients and skip_if set: every local shard and momentum stays bit-identical."""
    before = [t.to_local().clone() for opt in opts for p in params.values() if p in opt.state
              for t in (p, opt.state[p]["momentum_buffer"])]
    for name, p in params.items():
        grad = torch.full(CASES[name][0], float("nan"))
        grad.view(-1)[::2] = float("inf")
        p.grad = make(grad)
    for opt in opts:
        opt.skip_if = torch.tensor(True)
        opt.step()
    after = [t.to_local() for opt in opts for p in params.values() if p in opt.state
             for t in (p, opt.state[p]["momentum_buffer"])]
    return len(before) == 2 * len(CASES) and all(torch.equal(a, b) for a, b in zip(before, after))


def _compare(rank: int, world: int, triton_: bool, momentum_dtype, ns_chunk: int) -> dict:
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    if triton_:  # the fused passes in Triton's interpreter (the parent set TRITON_INTERPRET=1 for this process)
        from kernels.muon import decay_add_multi_, nesterov_momentum_multi_
        from titan_k3.optim import muon

        muon.nesterov_momentum_multi_ = functools.partial(nesterov_momentum_multi_, triton_=True)
        muon.decay_add_multi_ = functools.partial(decay_add_multi_, triton_=True)

    mesh = init_device_mesh("cpu", (world,))
    def make(t):
        return distribute_tensor(t, mesh, [Shard(0)])

    # NOTE: the single-process reference runs the Newton-Schulz all at once; the sharded runs in ns_chunk's chunks.
    plain = {n: p.detach() for n, p in _run(lambda t: t, momentum_dtype=momentum_dtype)[0].items()}
    out = {"plain": plain}
    for together in (False, True):
        gathers = []
        gather = dist.gather
        dist.gather = lambda *a, **k: (gathers.append(1), gather(*a, **k))[1]
        try:
            sharded, opts = _run(make, together, momentum_dtype, ns_chunk)
        finally:
            dist.gather = gather
        out[together] = {"sharded": {n: p.detach().full_tensor() for n, p in sharded.items()}, "gathers": len(gathers),
                         "skipped_unchanged": _skipped_step_changes_nothing(sharded, opts, make),
                         "momentum_dtypes": {opt.state[p]["momentum_buffer"].dtype for opt in opts for p in opt.state}}
    return out


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
@pytest.mark.parametrize("triton_, momentum_dtype, ns_chunk",
                         [(False, None, 0), (True, None, 0), (False, torch.bfloat16, 0), (False, None, 1)],
                         ids=["torch passes", "triton passes", "torch passes, bf16 momentum",
                              "torch passes, Newton-Schulz one block at a time"])
def test_sharded_muon_equals_single_process(tmp_path, monkeypatch, triton_, momentum_dtype, ns_chunk):
    if triton_:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    results = spawn_gloo(WORLD, _compare, triton_, momentum_dtype, ns_chunk, result_file=tmp_path / "result.pt")
    result = results[0]
    for together in (False, True):
        assert result[together]["momentum_dtypes"] == {momentum_dtype or torch.float32}
        for name in CASES:
            torch.testing.assert_close(result[together]["sharded"][name], result["plain"][name], rtol=1e-5, atol=1e-6,
                                       msg=f"{name} (one optimizer for all: {together})")
        assert all(r[together]["skipped_unchanged"] for r in results), f"a skipped step moved a shard ({together})"
    n_gathered = sum(1 for *_, gathered in CASES.values() if gathered)
    assert n_gathered == 3
    assert result[False]["gathers"] == 3 * n_gathered, "a locally orthogonalisable block was gathered (or a matrix was not)"
    # Together, the three gathered matrices travel in one gather per owner rank per step.
    assert result[True]["gathers"] == 3 * WORLD
