"""kernels.expert_weight_shadows on a GPU: a trainer whose experts read Muon-kept bf16 shadows trains exactly like
one whose experts cast their masters each forward, eager and as the recipe runs (compiled, the update graphed)."""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(autouse=True)
def inductor_picks_configs_without_timing():
    """Inductor's deterministic mode: both trainers run the same compiled kernels (tests/gpu/test_step_graph_gpu.py)."""
    import torch._inductor.config

    with torch._inductor.config.patch(deterministic=True):
        yield


def _trainer(tmp_path, name: str, *extra: str):
    from titan_k3.config import load_job_config
    from titan_k3.train import Trainer

    return Trainer(load_job_config([
        "--model.flavor", "tiny", "--training.seq_len", "512", "--training.local_batch_size", "2",
        "--training.compute_dtype", "bfloat16", "--training.device", "cuda", "--training.steps", "5",
        "--lr_scheduler.warmup_steps", "1", "--metrics.log_freq", "1000", "--invariants.interval", "2",
        "--job.dump_folder", str(tmp_path), "--job.name", name, *extra]))


@pytest.mark.parametrize("recipe", [False, True], ids=["eager", "compiled-graphed"])
def test_shadowed_experts_train_exactly_like_casting_ones(tmp_path, recipe):
    flags = ["--compile.enable", "true", "--compile.cuda_graph", "true", "--compile.cuda_graph_warmup", "1",
             "--compile.cuda_graph_max_documents", "32", "--optimizer.side_stream", "true"] if recipe else []
    cast = _trainer(tmp_path, "cast", *flags)
    kept = _trainer(tmp_path, "kept", *flags, "--kernels.expert_weight_shadows", "true")
    try:
        assert [c.chosen for c in kept.impl.choices if c.op == "expert_weights"] == ["shadows"]
        assert kept.optimizers.optimizers["muon"].shadows, "Muon was given no shadows"
        for update in range(1, 6):
            a, b = cast.train_step(), kept.train_step()
            cast.step = kept.step = update
            assert (b.loss, b.grad_norm) == (a.loss, a.grad_norm), update
        for (name, p), q in zip(cast.model.named_parameters(), kept.model.parameters()):
            assert torch.equal(p, q), name
        lines = [line for m in kept.model.modules() if getattr(m, "shadowed", False) for line in m.shadow_mismatches()]
        assert not lines, lines
        assert kept.invariants.total_violations == 0 and kept.invariants.checked_updates >= 2
    finally:
        cast.close()
        kept.close()
