"""The compiled model on its fast path (our Triton kernels) has no graph break, and dynamo has nothing to warn about.

A graph break splits a compiled sublayer and silently costs speed (two
sessions lost ~7% of a step to them). On a machine without CUDA the kernels
run in Triton's interpreter (tests/conftest.py) and the graphs are traced with
aot_eager, which partitions like inductor without generating code.
"""

import warnings

import torch
from torch._dynamo.utils import counters

from titan_k3.config import load_job_config
from titan_k3.models.k3.args import get_flavor
from titan_k3.models.k3.impl import resolve_impl, reference_impl
from titan_k3.models.k3.model import K3Model
from titan_k3.parallel.parallelize import apply_compile


def test_compiled_model_with_our_kernels_has_no_graph_break():
    torch._dynamo.reset()
    counters.clear()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = load_job_config(["--kernels.kda", "triton", "--kernels.experts", "triton", "--kernels.loss", "triton",
                           "--kernels.attn_res", "triton", "--kernels.conv", "triton"])
    impl = resolve_impl(cfg.kernels, device)
    chosen = {c.op: c.chosen for c in impl.choices}
    assert [chosen[op] for op in ("kda", "experts", "loss", "attn_res", "conv")] == ["triton"] * 5
    compiled = K3Model(get_flavor("debug", 256), impl).to(device)
    compiled.init_weights(seed=0)
    eager = K3Model(get_flavor("debug", 256), reference_impl()).to(device)
    eager.load_state_dict(compiled.state_dict())
    apply_compile(compiled, "inductor" if device.type == "cuda" else "aot_eager")
    ids = torch.randint(0, 256, (1, 128), generator=torch.Generator().manual_seed(0)).to(device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for cu in ([0, 50, 128], [0, 50, 128], [0, 30, 90, 128]):  # packed documents; then a new document count
            cu = torch.tensor(cu)
            loss = compiled(ids, ids, cu).loss_sum
            loss.backward()
            torch.testing.assert_close(loss, eager(ids, ids, cu).loss_sum, rtol=2e-3, atol=0.0)
    assert not counters["graph_break"], dict(counters["graph_break"])
    # NOTE: a warning from dynamo names code it traces in a way it does not trust (an lru_cache it skips, say).
    dynamo = [str(w.message) for w in caught if "_dynamo" in w.filename]
    assert not dynamo, dynamo
    assert counters["stats"]["unique_graphs"] > 0
