"""training.grad_norm_overlap on a GPU: the blocks' sums on the second stream give the norm the pass after backward gives.

Two trainers from one seed read the same batches, one summing the norm after the backward, one beside it; the second
also under the update's CUDA graph, where the side stream's work is captured with the backward. Each block must
have been summed from its hooks (on the side stream), not left to `join`, but for blocks a parameter of which gets
no gradient.
"""

import pytest
import torch
from tiny_trainer import tiny_trainer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.usefixtures("inductor_picks_configs_without_timing")]

# NOTE: flash attention's backward adds dq up with atomics: two trainers would differ in the last bits
# (tests/gpu/test_step_graph_gpu.py). SDPA's math path is bitwise repeatable.
FLAGS = ["--training.seq_len", "512", "--training.local_batch_size", "2", "--training.grad_accum", "2",
         "--training.steps", "5", "--lr_scheduler.warmup_steps", "1", "--training.max_norm", "0.05",
         "--invariants.enable", "false", "--kernels.attention", "math"]


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_norm_beside_the_backward_equals_the_norm_after_it(tmp_path, graph):
    extra = (["--compile.enable", "true", "--compile.cuda_graph", "true", "--compile.cuda_graph_warmup", "1",
              "--compile.cuda_graph_max_documents", "32"] if graph else [])
    after = tiny_trainer(tmp_path, "after", *FLAGS, *extra)
    beside = tiny_trainer(tmp_path, "beside", *FLAGS, *extra, "--training.grad_norm_overlap", "true")
    try:
        norm = beside.grad_norm
        assert norm is not None and norm.stream is not None
        for update in range(1, 6):
            a, b = after.train_step(), beside.train_step()
            after.step = beside.step = update
            # the same per-tensor foreach norms, summed in one vector (with a zero for each parameter without a
            # gradient, which the pass after backward leaves out: the sum's rounding may differ in the last bit)
            assert b.loss == pytest.approx(a.loss, rel=1e-5) and b.grad_norm == pytest.approx(a.grad_norm, rel=1e-5)
            assert a.grad_norm > 0.05, "clipped in every update, so the norm steers every update"
        # no block left to join but those that hold a parameter without a gradient (the first layer's mix query)
        late = [norm.blocks[i] for i, left in enumerate(norm._left) if left]
        names = [n for n, _ in beside.model.named_parameters()]
        assert len(late) <= 1 and all(names[s].startswith("layers.0.") for s, _ in late), late
        if graph:
            assert beside.step_graph.captures == 1
        for (name, p), q in zip(after.model.named_parameters(), beside.model.parameters()):
            torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-6, msg=name)
    finally:
        after.close()
        beside.close()
