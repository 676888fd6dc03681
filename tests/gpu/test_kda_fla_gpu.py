"""flash-linear-attention's KDA test cases on a GPU, and the kernels' shared memory against Triton's allocation.

Every case of fla's test_chunk / test_chunk_varlen that chunk_kda can express (benchmarks/kda_precision.py:
FLA_CASES) in bfloat16 (training) and float16 (fla's own dtype), with fla's tolerances (relative RMS error),
against float64. KDA_FLA_RESULTS / KDA_SMEM_RESULTS name JSON-lines files that receive one row per case
(benchmarks/results/kda.md records them).
"""

import contextlib
import json
import os
import warnings

import pytest
import torch

from benchmarks.kda_precision import FLA_CASES, FLA_DA_WARN, fla_errors
from kernels.kda import bwd, chunk_kda, fwd, l2norm, smem

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def record(env_var: str, row: dict) -> None:
    path = os.environ.get(env_var)
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", FLA_CASES, ids=lambda case: case.name.replace(" ", "-"))
def test_fla_case(case, dtype):
    errors = fla_errors(case, dtype, "cuda")
    failed = {name: errors[name] for name, tol in case.tolerances.items() if not errors[name] < tol}
    record("KDA_FLA_RESULTS", dict(case=case.name, dtype=str(dtype).split(".")[-1], errors=errors, failed=failed))
    assert not failed, f"above fla's tolerances {case.tolerances}: {failed}"
    if "dA" in errors and errors["dA"] > FLA_DA_WARN[case.kind]:
        warnings.warn(f"{case.name}: dA {errors['dA']:.2e} above fla's warning level {FLA_DA_WARN[case.kind]}")


KERNELS = {
    fwd._decay_kernel: "decay", fwd._scores_kernel: "scores", fwd._solve_kernel: "solve", fwd._wy_kernel: "wy",
    fwd._state_kernel: "state", fwd._output_kernel: "output", bwd._dstate_kernel: "dstate",
    bwd._dchunk_kernel: "dchunk", bwd._dintra_kernel: "dintra", bwd._ddecay_kernel: "ddecay",
}


@contextlib.contextmanager
def launches():
    """Rows (kernel, launch kwargs, Triton's shared memory in bytes) of every KDA kernel launched in the block."""
    rows = []

    def wrap(fn, name):
        run = fn.run

        def recorded(*args, **kwargs):
            kernel = run(*args, **kwargs)
            rows.append(("dfused" if kwargs.get("FUSE_INTRA") else name, kwargs, kernel.metadata.shared))
            return kernel

        return recorded

    for fn, name in KERNELS.items():
        fn.run = wrap(fn, name)
    try:
        yield rows
    finally:
        for fn in KERNELS:
            del fn.run


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("KV", [64, 128, 256])
def test_shared_memory_bound_covers_every_compiled_kernel(dtype, KV):
    """fwd + bwd on packed documents with the precomputed, softplus and safe gates (exact and fused paths):
    every kernel's Triton allocation is within its bound (kernels/kda/smem.py) and the bound within the H200's;
    float32 at K = 256 stops before any kernel with one line."""
    from kernels.kda import ops

    H = 2
    cu = torch.tensor([0, 70, 200])
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = [torch.randn(1, 200, H, KV, device="cuda", generator=gen) for _ in range(4)]
    q, k, v, g_raw = l2norm(x[0]).to(dtype), l2norm(x[1]).to(dtype), x[2].to(dtype), x[3]
    beta = torch.rand(1, 200, H, device="cuda", generator=gen).to(dtype)
    A_log, dt_bias = torch.zeros(H, device="cuda"), torch.zeros(H, KV, device="cuda")
    calls = {
        "g": dict(g=-torch.rand_like(g_raw) * 3),
        "softplus": dict(g=g_raw, A_log=A_log, dt_bias=dt_bias, gate_lower_bound=None),
        "safe": dict(g=g_raw, A_log=A_log, dt_bias=dt_bias, gate_lower_bound=-5.0),
    }
    if dtype == torch.float32 and KV > 128:
        with launches() as rows, pytest.raises(ValueError, match=r"^chunk_kda: K=256, V=256 in torch.float32 needs"):
            chunk_kda(q, k, v, calls["g"]["g"], beta, cu_seqlens=cu)
        assert rows == []
        return
    with launches() as rows:
        for name, kw in calls.items():
            for path in ([dict(diag_dot=0, fuse_bwd=0), dict(diag_dot=1, fuse_bwd=1)] if name == "safe" else [None]):
                kept = ops.LAUNCH["safe"]
                ops.LAUNCH["safe"] = path or kept
                try:
                    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
                    o, _ = chunk_kda(*leaves, kw["g"], beta, cu_seqlens=cu, **{n: a for n, a in kw.items() if n != "g"})
                    o.float().sum().backward()
                finally:
                    ops.LAUNCH["safe"] = kept
    torch.cuda.synchronize()
    assert {name for name, _, _ in rows} >= set(KERNELS.values()) | {"dfused"}
    over = []
    for name, kwargs, shared in rows:
        opts = dict(BK=kwargs.get("BK", 0), BV=kwargs.get("BV", 0), num_stages=kwargs["num_stages"])
        bound = smem.shared_bytes(name, KV, KV, dtype, opts)
        record("KDA_SMEM_RESULTS", dict(kernel=name, KV=KV, dtype=str(dtype).split(".")[-1], **opts, shared=shared,
                                        bound=bound))
        if not shared <= bound <= smem.SHARED_LIMIT:
            over.append((name, opts, shared, bound))
    assert not over
