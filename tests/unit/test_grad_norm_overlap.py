"""training.grad_norm_overlap on the CPU: the blocks, the counting, the norm against float64, and the trainer.

On the CPU each block is summed as the backward leaves it, on the one stream; the second CUDA stream is exercised in
tests/gpu/test_grad_norm_overlap_gpu.py.
"""

import math

import pytest
import torch
from torch import nn

from titan_k3.config import ConfigError, load_job_config
from titan_k3.parallel.distributed import grad_norm_and_clip_coef
from titan_k3.parallel.grad_norm_overlap import OverlappedGradNorm, block_of, grad_norm_overlap_choice
from titan_k3.train import Trainer

FAST = ["--model.flavor", "debug", "--training.seq_len", "64", "--training.local_batch_size", "2",
        "--metrics.log_freq", "1", "--lr_scheduler.warmup_steps", "1"]


class Stack(nn.Module):
    """embed -> layers (the last one's `spare` never used) -> output, named like the trainer's models."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(11, 8)
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.layers[2].spare = nn.Parameter(torch.ones(4))
        self.output = nn.Linear(8, 5)

    def forward(self, ids):
        h = self.embed(ids)
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return self.output(h).square().mean()


def float64_norm(model: nn.Module) -> float:
    return math.sqrt(sum(p.grad.double().square().sum().item() for p in model.parameters() if p.grad is not None))


def test_blocks_are_the_top_level_children():
    assert [block_of(n) for n in ("tok_embeddings.weight", "layers.3.ffn.w1", "layers.10.norm.weight",
                                  "output.weight", "norm.weight")] == ["tok_embeddings", "layers.3", "layers.10",
                                                                        "output", "norm"]
    norm = OverlappedGradNorm(Stack(), torch.device("cpu"))
    assert norm.blocks == [(0, 1), (1, 3), (3, 5), (5, 8), (8, 10)]


@pytest.mark.parametrize("micro_batches", [1, 3])
def test_the_norm_is_that_of_the_last_backwards_final_gradients(micro_batches):
    """Summed block by block as the last backward leaves each block, over gradients that earlier micro-batches added
    to; the unused parameter's block is summed at join. Equal to the float64 norm and to the after-backward path."""
    torch.manual_seed(0)
    model = Stack()
    norm = OverlappedGradNorm(model, torch.device("cpu"))
    for i in range(micro_batches):
        if i == micro_batches - 1:
            norm.arm()
        model(torch.randint(0, 11, (4, 6))).backward()
    assert model.layers[2].spare.grad is None
    sums = norm.squares.clone()
    norm.join()
    got, coef = norm.norm_and_clip_coef(0.5)
    want, want_coef = grad_norm_and_clip_coef([p for p in model.parameters() if p.grad is not None], 0.5)
    assert got.item() == pytest.approx(float64_norm(model), rel=1e-6)
    assert got.item() == pytest.approx(want.item(), rel=1e-6) and coef.item() == pytest.approx(want_coef.item(), rel=1e-6)
    # every block but the unused parameter's was summed during the backward; that one at join, its slot zero
    spare = [n for n, _ in model.named_parameters()].index("layers.2.spare")
    assert (sums[:5] > 0).all() and (sums[8:] > 0).all() and norm.squares[spare] == 0


def test_an_unarmed_backward_counts_nothing_and_every_update_rewrites_every_slot():
    """A backward before arm() launches no sums; a later update whose gradients are smaller leaves no trace of the
    earlier one (each slot is written again, zero where a parameter has no gradient)."""
    torch.manual_seed(1)
    model = Stack()
    norm = OverlappedGradNorm(model, torch.device("cpu"))
    model(torch.randint(0, 11, (4, 6))).backward()
    assert (norm.squares == 0).all()
    norm.arm()
    model(torch.randint(0, 11, (4, 6))).backward()
    norm.join()
    first = norm.norm_and_clip_coef(1.0)[0].item()
    for p in model.parameters():
        p.grad = None
    model.output.weight.requires_grad_(False)
    norm.arm()
    model(torch.randint(0, 11, (4, 6))).backward()
    norm.join()
    assert norm.norm_and_clip_coef(1.0)[0].item() == pytest.approx(float64_norm(model), rel=1e-6) != first


def test_join_without_arm_is_an_error():
    norm = OverlappedGradNorm(Stack(), torch.device("cpu"))
    with pytest.raises(AssertionError, match="join"):
        norm.join()


def test_several_processes_fall_back_and_job_strict_refuses():
    cfg = load_job_config(["--training.grad_norm_overlap", "true"])
    assert grad_norm_overlap_choice(cfg, 1).chosen == "overlap"
    choice = grad_norm_overlap_choice(cfg, 2)
    assert choice.fallback and choice.chosen == "after backward" and "one process only" in choice.reason
    assert grad_norm_overlap_choice(load_job_config([]), 2) is None
    strict = load_job_config(["--training.grad_norm_overlap", "true", "--job.strict", "true"])
    with pytest.raises(ConfigError, match="job.strict = true and training.grad_norm_overlap falls back"):
        grad_norm_overlap_choice(strict, 2)


@pytest.mark.parametrize("accum", [1, 2])
def test_trainer_updates_equal_those_with_the_norm_after_backward(tmp_path, accum):
    """Losses, grad norms (within float32 summation order) and weights of four updates, with and without the overlap;
    the kernel report names it."""
    flags = [*FAST, "--training.steps", "4", "--training.grad_accum", str(accum), "--training.max_norm", "0.05",
             "--job.dump_folder", str(tmp_path)]
    after = Trainer(load_job_config([*flags, "--job.name", "after"]))
    beside = Trainer(load_job_config([*flags, "--job.name", "beside", "--training.grad_norm_overlap", "true"]))
    try:
        assert after.grad_norm is None and beside.grad_norm is not None
        assert [c.chosen for c in beside.impl.choices if c.op == "grad_norm"] == ["overlap"]
        for update in range(1, 5):
            a, b = after.train_step(), beside.train_step()
            after.step = beside.step = update
            assert b.loss == pytest.approx(a.loss, rel=1e-5)
            assert b.grad_norm == pytest.approx(a.grad_norm, rel=1e-5) and a.grad_norm > 0.05  # clipped every update
        for (name, p), q in zip(after.model.named_parameters(), beside.model.parameters()):
            torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-6, msg=name)
    finally:
        after.close()
        beside.close()
