"""Validation loss does not depend on the number of data-parallel ranks (1 process vs 2 gloo processes)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from gloo_workers import spawn_gloo

GLOBAL_BATCH, N_BATCHES, SEQ_LEN, SEED = 4, 2, 64, 7


def _evaluate(dp_rank: int, dp_world: int, dp_group) -> tuple[dict, list[int]]:
    """(validation_loss result, fingerprints of the sequences this rank evaluated)."""
    from titan_k3.data.tokenizer import load_tokenizer
    from titan_k3.eval.validation import validation_batches, validation_loss
    from titan_k3.models.k3.args import get_flavor
    from titan_k3.models.k3.bundle import k3_batch_inputs
    from titan_k3.models.k3.impl import reference_impl
    from titan_k3.models.k3.model import K3Model

    tokenizer = load_tokenizer("embedded")
    torch.manual_seed(0)
    model = K3Model(get_flavor("debug", -(-tokenizer.vocab_size // 64) * 64), reference_impl())
    model.init_weights(SEED)
    batches = list(validation_batches("embedded", tokenizer, SEQ_LEN, GLOBAL_BATCH, N_BATCHES, dp_rank, dp_world, SEED))
    seen = [f for b in batches for f in b.fingerprints.tolist()]
    return validation_loss(model, k3_batch_inputs, batches, torch.device("cpu"), dp_group), seen


def _evaluate_rank(rank: int, world: int) -> tuple[dict, list[int]]:
    return _evaluate(rank, world, dist.group.WORLD)


def test_validation_loss_is_identical_on_one_and_two_ranks(tmp_path):
    single, single_seen = _evaluate(0, 1, None)
    (r0, seen0), (r1, seen1) = spawn_gloo(2, _evaluate_rank, result_file=tmp_path / "two.pt")
    # The ranks evaluated disjoint halves whose union is the single-rank set ...
    assert len(seen0) == len(seen1) == GLOBAL_BATCH * N_BATCHES // 2
    assert not set(seen0) & set(seen1)
    assert sorted(seen0 + seen1) == sorted(single_seen)
    # ... and every rank reports the same, rank-count-independent value.
    assert r0 == r1
    assert r0["val_tokens"] == single["val_tokens"] > 0
    assert r0["val_loss"] == pytest.approx(single["val_loss"], rel=1e-6)
