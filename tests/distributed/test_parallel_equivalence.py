"""FSDP2, FSDP2 + EP and HSDP (gloo, 2 and 4 CPU processes) equal one process on the same global batch.

Each distributed run trains the debug flavor for 5 updates with grad
accumulation 2 and QK-Clip active (tau 0.05), and is compared step by step
with a single process that takes the whole global batch: loss within 1e-5
relative, grad norm within 1e-4 relative, the routing state bit-identical on
every rank after every step, and the ranks' sequences together exactly the
single process's sequences. Activation checkpointing (selective, full) and
torch.compile ride along on some runs, and one keeps FSDP2's parameters
gathered from forward to backward, and one reduces the gradients after every
micro-batch instead of once per update: they must not move the numbers either.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from dist_harness import GLOBAL_BATCH, GRAD_ACCUM, STEPS, check_equivalent as _check, run_distributed, run_trainer

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available"),
]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    assert "WORLD_SIZE" not in os.environ, "the reference must be a plain single process"
    ref = run_trainer(["--training.local_batch_size", str(GLOBAL_BATCH)], str(tmp_path_factory.mktemp("ref")), "ref")
    assert max(ref["max_logit"]) > 0.05, "QK-Clip never triggered: the MAX-reduction would go untested"
    return ref


def test_two_processes_fsdp2_and_ep(reference, tmp_path):
    runs = [
        # Parameters kept gathered from forward to backward (one all-gather per block instead of two).
        ("fsdp2_ac_selective", ["--activation_checkpoint.mode", "selective", "--parallelism.fsdp_reshard_after_forward",
                                "false"], STEPS),
        ("fsdp2_ep2_ac_full", ["--parallelism.expert_parallel_degree", "2", "--activation_checkpoint.mode", "full"], STEPS),
        ("fsdp2_ep2_a2a_ac_full", ["--parallelism.expert_parallel_degree", "2", "--parallelism.expert_dispatch",
                                   "all_to_all", "--activation_checkpoint.mode", "full"], STEPS),
        # Gradients reduced after every micro-batch instead of once per update: the same numbers, twice the reductions.
        ("fsdp2_reduce_each_micro_batch", ["--parallelism.fsdp_defer_grad_reduce", "false"], STEPS),
        ("fsdp2_compile", ["--compile.enable", "true", "--compile.backend", "aot_eager"], 2),
        ("fsdp2_ep2_compile", ["--parallelism.expert_parallel_degree", "2", "--compile.enable", "true",
                               "--compile.backend", "aot_eager"], 2),
    ]
    ranks = run_distributed(2, runs, tmp_path)
    for name, _, steps in runs:
        _check(ranks, reference, name, steps)
    # By default the micro-batches of an update sum their gradients unsharded and reduce them once.
    deferred, each = (ranks[0][run]["reduce_scatters"] for run in ("fsdp2_ac_selective", "fsdp2_reduce_each_micro_batch"))
    assert 0 < deferred and each == GRAD_ACCUM * deferred, (deferred, each)
    # The routers stay out of FSDP, and so do the experts where the expert mesh has one rank (EP 2 of 2):
    # no FSDP hook inside a compiled sublayer breaks its graph.
    for run in ("fsdp2_compile", "fsdp2_ep2_compile"):
        assert [rank[run]["skipped_function_breaks"] for rank in ranks] == [0, 0], run
    # The all-gather dispatch has fixed sizes: no count exchange (that it compiles as one graph:
    # test_expert_parallel.py).
    assert [rank["fsdp2_ep2_ac_full"]["count_exchanges"] for rank in ranks] == [0, 0]
    for run in (rank["fsdp2_ep2_a2a_ac_full"] for rank in ranks):
        # One host wait per MoE layer and microbatch forward: the full-checkpoint recompute reuses the splits.
        assert run["count_exchanges"] == STEPS * GRAD_ACCUM * run["moe_layers"] > 0, run["count_exchanges"]


def test_four_processes_hsdp_and_ep(reference, tmp_path):
    runs = [
        ("hsdp_2x2", ["--parallelism.data_parallel_replicate_degree", "2"], STEPS),
        ("fsdp4_ep2", ["--parallelism.expert_parallel_degree", "2"], STEPS),
        # EP as wide as the shard degree: each rank holds its experts whole, which FSDP only replicates
        ("hsdp_2x2_ep2", ["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.expert_parallel_degree",
                          "2"], STEPS),
    ]
    ranks = run_distributed(4, runs, tmp_path)
    for name, _, steps in runs:
        _check(ranks, reference, name, steps)


def test_two_processes_fsdp2_with_the_triton_mixes_summing_gradients_in_place(reference, tmp_path, monkeypatch):
    """kernels.attn_res_grad_in_place under FSDP2 (its hooks wrap each block's inputs, the sinks ride beside them)
    and full activation checkpointing (the recompute runs each mix's forward again): the single process's numbers.
    The mixes run in Triton's interpreter in the spawned processes."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    runs = [("fsdp2_mix_in_place_ac_full", ["--kernels.attn_res", "triton", "--kernels.attn_res_grad_in_place", "true",
                                            "--activation_checkpoint.mode", "full"], STEPS)]
    ranks = run_distributed(2, runs, tmp_path)
    _check(ranks, reference, *runs[0][::2])


def test_two_processes_fsdp2_with_the_norms_in_the_triton_mixes(reference, tmp_path, monkeypatch):
    """kernels.attn_res_norm_in_mix (with the gradients in place too) under FSDP2: each block's norm weights are
    gathered for the mixes, outside the compiled sublayers, and their gradients reduced like every other parameter's;
    the single process's numbers. The mixes run in Triton's interpreter in the spawned processes."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    runs = [("fsdp2_norm_in_mix", ["--kernels.attn_res", "triton", "--kernels.attn_res_norm_in_mix", "true",
                                   "--kernels.attn_res_grad_in_place", "true"], STEPS)]
    ranks = run_distributed(2, runs, tmp_path)
    _check(ranks, reference, *runs[0][::2])
