"""The KDA kernels' shared memory: every launch plan fits the H200, without a GPU.

`kernels.kda.smem.shared_bytes` bounds each kernel's need from the tiles it holds; `ops.launch_plan` lowers
pipelining, then V tiles, until every kernel fits. These tests check the plans for the widths we document and
the bound against Triton's own allocation, recorded for sm_90 (Triton 3.6, the H200's) below.
"""

import pytest
import torch

from kernels.kda import ops, smem

WIDTHS = [64, 128, 256]
GATES = {"precomputed g": None, "softplus gate": (None, None, None), "safe gate": (None, None, -5.0)}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("K", WIDTHS)
@pytest.mark.parametrize("V", WIDTHS)
def test_every_kernel_of_every_plan_fits_the_h200(dtype, K, V):
    """Each kernel a call would launch, for one and for many walks (V tiles narrowed to fill the SMs or not),
    needs at most 232,448 bytes; float32 with K > 128 is refused instead, with one line."""
    paths = [dict(diag_dot=0, fuse_bwd=0), dict(diag_dot=1, fuse_bwd=1)]
    for safe in paths:
        for gate in GATES.values():
            for walks in (1, 4096):
                kept = ops.LAUNCH["safe"]
                ops.LAUNCH["safe"] = safe
                try:
                    if dtype == torch.float32 and K > 128:
                        with pytest.raises(ValueError, match=r"^chunk_kda: K=256, .* above the GPU's 232,448; "):
                            ops.launch_plan(K, V, dtype, walks, 132, gate, limit=smem.SHARED_LIMIT)
                        continue
                    plan = ops.launch_plan(K, V, dtype, walks, 132, gate, limit=smem.SHARED_LIMIT)
                finally:
                    ops.LAUNCH["safe"] = kept
                for name, opts in plan.items():
                    need = smem.shared_bytes(name, K, V, dtype, opts)
                    assert 0 < need <= smem.SHARED_LIMIT == 232_448, (name, opts, need)


def test_training_widths_keep_the_measured_launch_table():
    """bfloat16 at K = V = 128 (k3-mini) fits as the table stands: fitting changes nothing there."""
    for walks in (32, 4096):
        fitted = ops.launch_plan(128, 128, torch.bfloat16, walks, 132, (None, None, -5.0), limit=smem.SHARED_LIMIT)
        assert fitted == ops.launch_plan(128, 128, torch.bfloat16, walks, 132, (None, None, -5.0), limit=None)
    assert fitted["dstate"]["num_stages"] == ops.LAUNCH["dstate"]["num_stages"] == 2


def test_wide_heads_give_up_pipelining_where_the_bound_says_so():
    """K = 256 in bfloat16: the backward state walk (three [64, 256] operand tiles, pipelined loads on top) runs
    unpipelined; the forward one still fits pipelined."""
    plan = ops.launch_plan(256, 256, torch.bfloat16, 4096, 132, None, limit=smem.SHARED_LIMIT)
    assert plan["dstate"]["num_stages"] == 1 and plan["state"]["num_stages"] == 2
    assert smem.shared_bytes("dstate", 256, 256, torch.bfloat16, {**plan["dstate"], "num_stages": 2}) > 232_448


def test_fitting_narrows_the_v_tile_once_unpipelined():
    """A limit below the unpipelined need makes the fit halve BV (down to 16) before it gives up."""
    opts = dict(BV=64, num_warps=8, num_stages=2)
    need_bv16 = smem.shared_bytes("state", 128, 128, torch.bfloat16, {**opts, "BV": 16, "num_stages": 1})
    fitted = ops._fit("state", opts, 128, 128, torch.bfloat16, need_bv16)
    assert fitted == dict(BV=16, num_warps=8, num_stages=1)
    with pytest.raises(ValueError, match="state kernel"):
        ops._fit("state", opts, 128, 128, torch.bfloat16, need_bv16 - 1)


# Triton 3.6's shared memory on an H200 (CompiledKernel.metadata.shared, tests/gpu/test_kda_fla_gpu.py,
# 2026-12-02): (kernel, K = V, dtype, BK, BV, num_stages) -> bytes; the decayed-product gradients (dintra,
# dfused) in three TF32 passes for bfloat16. Then, compiled ahead of time for sm_90 with Triton 3.6, the walks'
# 64-wide V tiles (k3-mini's with many sequences; float32's pipelined backward walk at K = 128 came within 2,560
# bytes of the limit) and float32 at K = 256: the pipelined walks exceed the GPU, the unpipelined bound does too.
MEASURED = [
    ("dchunk", 64, torch.bfloat16, 64, 64, 2, 40_960),
    ("dchunk", 64, torch.float32, 64, 64, 2, 98_304),
    ("dchunk", 128, torch.bfloat16, 64, 64, 2, 81_920),
    ("dchunk", 128, torch.float32, 64, 64, 1, 98_304),
    ("dchunk", 256, torch.bfloat16, 64, 32, 2, 45_056),
    ("ddecay", 64, torch.bfloat16, 64, 0, 1, 8_192),
    ("ddecay", 64, torch.float32, 64, 0, 1, 8_192),
    ("decay", 64, torch.bfloat16, 64, 0, 1, 8_192),
    ("decay", 64, torch.float32, 64, 0, 1, 8_192),
    ("dfused", 64, torch.bfloat16, 64, 64, 2, 40_960),
    ("dfused", 64, torch.float32, 64, 64, 1, 98_304),
    ("dfused", 128, torch.bfloat16, 64, 64, 2, 73_728),
    ("dfused", 128, torch.float32, 64, 64, 1, 98_304),
    ("dfused", 256, torch.bfloat16, 64, 32, 2, 40_960),
    ("dintra", 64, torch.bfloat16, 32, 0, 1, 49_152),
    ("dintra", 64, torch.float32, 32, 0, 1, 24_576),
    ("dstate", 64, torch.bfloat16, 64, 32, 2, 86_272),
    ("dstate", 64, torch.float32, 64, 32, 2, 123_136),
    ("dstate", 128, torch.bfloat16, 128, 32, 2, 147_968),
    ("dstate", 128, torch.float32, 128, 32, 1, 90_112),
    ("dstate", 256, torch.bfloat16, 256, 32, 1, 73_728),
    ("output", 64, torch.bfloat16, 64, 64, 2, 16_384),
    ("output", 64, torch.float32, 64, 64, 2, 32_768),
    ("output", 128, torch.bfloat16, 64, 64, 2, 49_152),
    ("output", 128, torch.float32, 64, 64, 2, 65_536),
    ("output", 256, torch.bfloat16, 64, 32, 2, 40_960),
    ("scores", 64, torch.bfloat16, 32, 0, 1, 10_240),
    ("scores", 64, torch.float32, 32, 0, 1, 8_192),
    ("solve", 64, torch.bfloat16, 0, 0, 1, 7_168),
    ("solve", 64, torch.float32, 0, 0, 1, 10_240),
    ("state", 64, torch.bfloat16, 64, 32, 2, 57_600),
    ("state", 64, torch.float32, 64, 32, 2, 82_176),
    ("state", 128, torch.bfloat16, 128, 32, 2, 107_008),
    ("state", 128, torch.float32, 128, 32, 2, 147_968),
    ("state", 256, torch.bfloat16, 256, 32, 2, 205_824),
    ("wy", 64, torch.bfloat16, 64, 64, 2, 16_384),
    ("wy", 64, torch.float32, 64, 64, 2, 32_768),
    ("wy", 128, torch.bfloat16, 64, 64, 2, 40_960),
    ("wy", 128, torch.float32, 64, 64, 2, 65_536),
    ("wy", 256, torch.bfloat16, 64, 32, 2, 40_960),
    ("state", 128, torch.bfloat16, 128, 64, 2, 74_240),
    ("dstate", 128, torch.bfloat16, 128, 64, 2, 98_816),
    ("dchunk", 128, torch.bfloat16, 64, 64, 2, 49_152),
    ("dstate", 128, torch.float32, 128, 64, 2, 229_888),
    ("state", 256, torch.float32, 256, 32, 2, 279_552),
    ("state", 256, torch.float32, 256, 32, 1, 74_752),
    ("dstate", 256, torch.float32, 256, 32, 2, 418_816),
    ("dstate", 256, torch.float32, 256, 16, 1, 151_552),
]


@pytest.mark.parametrize("kernel, KV, dtype, BK, BV, stages, measured", MEASURED)
def test_bound_covers_tritons_allocation(kernel, KV, dtype, BK, BV, stages, measured):
    opts = dict(BK=BK, BV=BV, num_stages=stages)
    assert smem.shared_bytes(kernel, KV, KV, dtype, opts) >= measured


def test_model_args_refuse_heads_wider_than_the_kernels_take():
    """A model asking for KDA heads past the kernels' limit stops when its args are built, before any work."""
    from titan_k3.models.k3.args import KDA_MAX_HEAD_DIM, get_flavor

    debug = get_flavor("debug")
    assert debug.replace(kda_head_dim=KDA_MAX_HEAD_DIM).kda_head_dim == 256
    with pytest.raises(ValueError, match=r"^kda_head_dim=512: the KDA kernels take head widths 1\.\.256$"):
        debug.replace(kda_head_dim=512)


@pytest.mark.parametrize("gate", GATES.values(), ids=GATES.keys())
def test_float32_max_width_is_where_the_launch_plan_stops_fitting(gate):
    """ops.FLOAT32_MAX_WIDTH, which the model's kernel choice checks at start-up, is the widest float32 head whose
    plan fits the H200; bfloat16 fits to 256."""
    for walks in (1, 4096):
        ops.launch_plan(ops.FLOAT32_MAX_WIDTH, ops.FLOAT32_MAX_WIDTH, torch.float32, walks, 132, gate,
                        limit=smem.SHARED_LIMIT)
        wider = ops.FLOAT32_MAX_WIDTH + 1
        with pytest.raises(ValueError, match=rf"^chunk_kda: K={wider}, V={wider} in torch.float32 needs "):
            ops.launch_plan(wider, wider, torch.float32, walks, 132, gate, limit=smem.SHARED_LIMIT)
        ops.launch_plan(256, 256, torch.bfloat16, walks, 132, gate, limit=smem.SHARED_LIMIT)
