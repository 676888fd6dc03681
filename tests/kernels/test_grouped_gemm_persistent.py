"""grouped_gemm's persistent kernels (`triton_gemm.PERSISTENT`): the one-tile-per-program kernels' bits, and the
float64 reference's values.

Both kernels of a pair run pinned to one config (their family's first candidate: the interpreter's only one on the
CPU), so that equal bits are the claim: same tiles, same per-tile sums. A persistent launch has one program per SM
and the SM count is set to `programs` (INTERPRET_SMS in the interpreter): one program walks every tile, three walk
several each, and of 64 some have none. Float32 products run in IEEE float32, so the bound against float64 is 1e-5
(errors sit near 1e-7); the GLU's own formula (one exponential) adds ~1e-7 to h.
"""

import os

import pytest
import torch
import triton
from test_grouped_gemm import float64_grads, make_moe, rel_rms

from kernels.grouped_gemm import moe_experts, ops, reference, triton_gemm

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SENTINEL = -1234.5  # what outputs hold before a launch: rows left unwritten keep it

# (rows, K, M, offsets): empty groups, groups of one row, groups no BLOCK_M divides, a group holding every row, rows
# past offsets[-1] (the tail), no group at all.
CASES = [
    (70, 40, 72, [10, 10, 45, 45, 61]),
    (50, 33, 20, [0, 50, 50]),
    (41, 24, 50, [0, 0, 0, 7]),
    (37, 16, 40, [1, 1, 2, 35]),
    (23, 8, 12, [0, 0, 0]),
]


def random_case(seed: int, n_experts: int = 9, n_rows: int = 100):
    """(rows, K, M, offsets) with random group ends: repeats make empty groups; the last end leaves a tail."""
    gen = torch.Generator().manual_seed(seed)
    ends = torch.sort(torch.randint(0, n_rows - 5, (n_experts,), generator=gen)).values
    return n_rows, 20, 36, ends.tolist()


CASES += [random_case(seed) for seed in (1, 2)]

# ops attribute -> (its family's candidates, persistent)
KERNELS = {
    "grouped_mm_kernel": (triton_gemm.mm_configs, False),
    "grouped_mm_persistent_kernel": (triton_gemm.mm_configs, True),
    "grouped_mm_dual_kernel": (triton_gemm.epilogue_configs, False),
    "grouped_mm_dual_persistent_kernel": (triton_gemm.epilogue_configs, True),
    "glu_up_kernel": (triton_gemm.epilogue_configs, False),
    "glu_up_persistent_kernel": (triton_gemm.epilogue_configs, True),
}


class Pinned:
    """Stands in for an autotuned kernel in ops: launches its jitted body with one config, recording each launch's
    program count."""

    def __init__(self, autotuned, config):
        self.fn = autotuned.fn
        self.kwargs = {k: v for k, v in config.all_kwargs().items() if v is not None}
        self.programs = []

    def __getitem__(self, grid):
        def counted(meta):
            size = grid(meta)
            self.programs.append(size[0])
            return size

        return lambda *args, **kwargs: self.fn[counted](*args, **kwargs, **self.kwargs)


@pytest.fixture
def kernels(monkeypatch):
    """Every expert GEMM kernel of ops pinned to its family's first candidate (PROGRAMS_PER_SM 1 when persistent)."""
    pinned = {}
    for name, (configs, persistent) in KERNELS.items():
        config = configs()[0]
        if persistent:
            [config] = triton_gemm.persistent_configs([config], per_sm=(1,))
        pinned[name] = Pinned(getattr(ops, name), config)
        monkeypatch.setattr(ops, name, pinned[name])
    return pinned


def use_sms(monkeypatch, sms: int) -> None:
    """Persistent launches see `sms` SMs (on a GPU, or INTERPRET_SMS in the interpreter)."""
    monkeypatch.setattr(triton_gemm, "INTERPRET_SMS", sms)
    monkeypatch.setattr(ops, "_sm_count", lambda index: sms)


def switch(monkeypatch, on: bool) -> None:
    for name in triton_gemm.PERSISTENT:
        monkeypatch.setitem(triton_gemm.PERSISTENT, name, on)


def tiles_bound(n_rows, n_experts, n_cols, config) -> int:
    """The grid's cap: the tiles any offsets can need (`triton_gemm.row_tiles_upper_bound` times column tiles)."""
    block_m, block_n = config["BLOCK_M"], config["BLOCK_N"]
    return triton_gemm.row_tiles_upper_bound(n_rows, n_experts, block_m) * triton.cdiv(n_cols, block_n)


@pytest.mark.parametrize("programs", [1, 3, 64])
@pytest.mark.parametrize("kind", ["plain", "gathered", "dual", "dual_gathered"])
@pytest.mark.parametrize("n_rows,red,n_cols,ends", CASES)
def test_persistent_mm_gives_the_one_tile_kernels_bits(n_rows, red, n_cols, ends, kind, programs, kernels,
                                                       monkeypatch):
    """`_launch_mm` with PERSISTENT on: the same output as the one-tile kernel, the float64 reference's values, and
    zeros in the tail (whose A rows hold NaN: never read)."""
    use_sms(monkeypatch, programs)
    gen = torch.Generator().manual_seed(n_rows + red)
    n_experts, dual, gathered = len(ends), kind.startswith("dual"), kind.endswith("gathered")
    tail = ends[-1] if ends else 0
    n_tokens = n_rows + 7 if gathered else n_rows
    a, a2 = (torch.randn(n_tokens, red, generator=gen) for _ in range(2))
    b, b2 = (torch.randn(n_experts, red, n_cols, generator=gen) for _ in range(2))
    gather = torch.randint(0, n_tokens, (n_rows,), generator=gen, dtype=torch.int32) if gathered else None
    if not gathered:
        a[tail:], a2[tail:] = float("nan"), float("nan")
    a, a2, b, b2 = (t.to(DEVICE) for t in (a, a2, b, b2))
    offsets = torch.tensor(ends, dtype=torch.int32, device=DEVICE)
    gather = None if gather is None else gather.to(DEVICE)
    extra = dict(a2=a2, b2=b2) if dual else {}

    def launch(persistent: bool) -> torch.Tensor:
        switch(monkeypatch, persistent)
        out = torch.full((n_rows, n_cols), SENTINEL, device=DEVICE)
        return ops._launch_mm(a, b, offsets, out, gather=gather, **extra)

    want_bits = launch(False)
    got = launch(True)
    name = "grouped_mm_dual_kernel" if dual else "grouped_mm_kernel"
    persistent = name.replace("_kernel", "_persistent_kernel")
    assert len(kernels[name].programs) == 1
    assert kernels[persistent].programs == [min(programs, tiles_bound(n_rows, n_experts, n_cols,
                                                                      kernels[persistent].kwargs))]
    assert torch.equal(got, want_bits)
    assert torch.equal(got[tail:], torch.zeros_like(got[tail:]))
    rows = slice(None) if gather is None else gather.long()
    want = reference.grouped_mm(a[rows].double(), b.double(), offsets)
    if dual:
        want += reference.grouped_mm(a2[rows].double(), b2.double(), offsets)
    if tail:
        assert rel_rms(got[:tail], want[:tail]) < 1e-5


@pytest.mark.parametrize("programs", [1, 3, 64])
@pytest.mark.parametrize("store_gu", [True, False], ids=["g_u", "h_only"])
@pytest.mark.parametrize("n_rows,red,n_cols,ends", CASES)
def test_persistent_glu_up_gives_the_one_tile_kernels_bits(n_rows, red, n_cols, ends, store_gu, programs, kernels,
                                                           monkeypatch):
    """`_launch_glu_up` with PERSISTENT on: the same h (and g, u) as the one-tile kernel, the float64 reference's
    values, and the tail rows left as they were."""
    use_sms(monkeypatch, programs)
    gen = torch.Generator().manual_seed(n_rows * 3 + red)
    n_experts, n_tokens = len(ends), n_rows // 2 + 1
    tail = ends[-1] if ends else 0
    x = torch.randn(n_tokens, red, generator=gen).to(DEVICE)
    w1 = (torch.randn(n_experts, red, n_cols, generator=gen) / red**0.5).to(DEVICE)
    w3 = (torch.randn(n_experts, red, n_cols, generator=gen) * 8 / red**0.5).to(DEVICE)
    token = torch.randint(0, n_tokens, (n_rows,), generator=gen, dtype=torch.int32).to(DEVICE)
    offsets = torch.tensor(ends, dtype=torch.int32, device=DEVICE)

    def launch(persistent: bool) -> list[torch.Tensor]:
        switch(monkeypatch, persistent)
        h, g, u = (torch.full((n_rows, n_cols), SENTINEL, device=DEVICE) for _ in range(3))
        ops._launch_glu_up(x, w1, w3, offsets, token, h, *((g, u) if store_gu else ()))
        return [h, g, u]

    want_bits = launch(False)
    got = launch(True)
    assert len(kernels["glu_up_kernel"].programs) == 1
    programs_run = kernels["glu_up_persistent_kernel"].programs
    assert programs_run == [min(programs, tiles_bound(n_rows, n_experts, n_cols, kernels["glu_up_kernel"].kwargs))]
    for name, a, b in zip("hgu", got, want_bits):
        assert torch.equal(a, b), name
    h, g, u = got
    assert (h[tail:] == SENTINEL).all() and (g[tail:] == SENTINEL).all() and (u[tail:] == SENTINEL).all()
    if not store_gu:
        assert (g == SENTINEL).all() and (u == SENTINEL).all()
    if not tail:
        return
    x_slots = x[token.long()].double()
    want_g = reference.grouped_mm(x_slots, w1.double(), offsets)[:tail]
    want_u = reference.grouped_mm(x_slots, w3.double(), offsets)[:tail]
    assert rel_rms(h[:tail], reference.situ_glu(want_g, want_u)) < 1e-5
    if store_gu:
        assert rel_rms(g[:tail], want_g) < 1e-5
        assert rel_rms(u[:tail], want_u) < 1e-5


@pytest.mark.parametrize("skew", [False, True], ids=["every_expert", "empty_experts"])
def test_moe_experts_forward_and_backward_same_with_persistent_kernels(skew, kernels, monkeypatch):
    """The whole expert block, forward and backward (float32): the persistent kernels in its four uses of them (glu_up,
    w2, dh, dx) give the same output and gradients, bit for bit, as the one-tile kernels."""
    use_sms(monkeypatch, 3)
    x, w1, w3, w2, idx, prob = make_moe(37, 8, 3, 40, 72, torch.float32, seed=60, skew=skew)
    params = [t.detach().to(DEVICE).requires_grad_() for t in (x, w1, w3, w2, prob)]
    idx = idx.to(DEVICE)
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(61)).to(DEVICE)

    def block(persistent: bool) -> list[torch.Tensor]:
        switch(monkeypatch, persistent)
        y = moe_experts(*params[:4], idx, params[4])
        return [y, *torch.autograd.grad(y, params, dy)]

    want = block(False)
    one_tile = {name: len(k.programs) for name, k in kernels.items()}
    got = block(True)
    persistent = {name: len(k.programs) - one_tile[name] for name, k in kernels.items()}
    launches = dict(grouped_mm_kernel=2, grouped_mm_dual_kernel=1, glu_up_kernel=1)  # w2 and dh; dx; glu_up
    assert one_tile == {**{name: 0 for name in KERNELS}, **launches}
    assert persistent == {**{name: 0 for name in KERNELS},
                          **{name.replace("_kernel", "_persistent_kernel"): n for name, n in launches.items()}}
    for name, a, b in zip(("y", "x", "w1", "w3", "w2", "topk_weight"), got, want):
        assert torch.equal(a, b), name
    want64, grads64 = float64_grads(lambda a, b, c, d, p: reference.moe_experts(a, b, c, d, idx, p), params, dy)
    for name, a, b in zip(("y", "x", "w1", "w3", "w2", "topk_weight"), got, (want64, *grads64)):
        assert rel_rms(a, b) < 5e-3, name


def test_persistent_candidates_are_the_kernels_own_with_one_and_two_programs_per_sm(monkeypatch):
    """On a GPU each persistent kernel autotunes over its one-tile kernel's candidates, each at 1 and 2 programs per
    SM; the interpreter keeps its one config at 1."""
    monkeypatch.setattr(triton_gemm, "INTERPRET", False)
    for configs in (triton_gemm.mm_configs(), triton_gemm.epilogue_configs()):
        got = [(c.kwargs, c.num_warps, c.num_stages) for c in triton_gemm.persistent_configs(configs)]
        assert got == [({**c.kwargs, "PROGRAMS_PER_SM": n}, c.num_warps, c.num_stages) for c in configs for n in (1, 2)]
    monkeypatch.setattr(triton_gemm, "INTERPRET", True)
    [config] = triton_gemm.persistent_configs(triton_gemm.mm_configs()[:1])
    assert config.kwargs["PROGRAMS_PER_SM"] == 1


def test_persistent_grid_is_programs_per_sm_times_sms_capped_at_the_tiles(monkeypatch):
    monkeypatch.setattr(triton_gemm, "INTERPRET_SMS", 5)
    monkeypatch.setattr(ops, "_sm_count", lambda index: 5)
    meta = dict(BLOCK_M=32, BLOCK_N=32, PROGRAMS_PER_SM=2)
    assert ops._persistent_grid(torch.device(DEVICE), 1000, 4, 64)(meta) == (10,)
    # 40 rows over 4 experts: at most cdiv(40, 32) + 4 + 1 = 7 row tiles, one column tile
    assert ops._persistent_grid(torch.device(DEVICE), 40, 4, 20)(meta) == (7,)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the benchmark's smoke run is the interpreter's")
def test_expert_tiles_smoke_times_the_persistent_kernels_next_to_each_setting(tmp_path):
    """benchmarks/expert_tiles.py --persistent (the GPU measurement that decides PERSISTENT): in the interpreter, each
    setting of dx in the persistent kernel too, and the layer with every persistent kernel on, all outputs checked
    against the trainer's setting."""
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from benchmarks import expert_tiles

    switches = dict(triton_gemm.PERSISTENT)
    assert expert_tiles.main(["--smoke", "--persistent", "--uses", "dx", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "expert_tiles.json").read_text())["rows"]
    other = rows[2]["setting"]
    assert [(r["use"], r["setting"]) for r in rows] == [
        ("dx", "trainer's"), ("dx", "persistent, autotuned"), ("dx", other), ("dx", f"persistent, {other}, 1 per SM"),
        ("dx", f"persistent, {other}, 2 per SM"), ("layer", "trainer's"),
        ("layer", "persistent: glu_up, mm, mm_dual, autotuned")]
    assert all("error" not in r and r["rel_rms"] < 1e-6 and r["layer_rel_rms"] < 1e-6 for r in rows), rows
    assert triton_gemm.PERSISTENT == switches  # as they were
