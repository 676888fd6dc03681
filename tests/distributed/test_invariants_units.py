"""Invariant checks in one process: the pieces the multi-process tests rely on, and the abort path."""

from types import SimpleNamespace

import pytest
import torch

from titan_k3.invariants import InvariantRunner, InvariantViolationError, replicated_state
from titan_k3.invariants import checks as C
from titan_k3.metrics.events import EventLog


def test_checksum_sees_one_bit_and_a_permutation():
    x = torch.randn(1000)
    flipped = x.clone()
    flipped.view(torch.int32)[123] ^= 1
    assert C.checksum(x) == C.checksum(x.clone())
    assert C.checksum(x) != C.checksum(flipped)
    assert C.checksum(x) != C.checksum(x.flip(0))
    assert C.checksum(torch.tensor([True, False])) != C.checksum(torch.tensor([False, True]))
    assert C.checksum(x.to(torch.bfloat16)) == C.checksum(x.to(torch.bfloat16).clone())


def test_source_mix_flags_a_source_far_from_its_weight():
    weights = {"code": 0.5, "prose": 0.5}
    assert C.check_source_mix({"code": 5100, "prose": 4900}, weights, None, slack_tokens=64) == []
    (v,) = C.check_source_mix({"code": 9000, "prose": 1000}, weights, None, slack_tokens=64)
    assert v.check == "data.source_mix" and "source 'code' is 90.0%" in v.message


def test_grad_norm_audit_and_normaliser_in_one_process():
    assert C.check_grad_norm_audit(5.0, C.layout_grad_norm([torch.full((4,), 2.5)])) == []
    (v,) = C.check_grad_norm_audit(2.5, 5.0)
    assert v.check == "gradient_scale.grad_norm_audit" and v.metric == pytest.approx(0.5)
    assert C.check_loss_normaliser(100.0, 100, None) == []
    (v,) = C.check_loss_normaliser(50.0, 100, None)
    assert v.metric == 0.5


def test_grad_norm_audit_flags_a_finite_clip_over_non_finite_shards():
    """A shard holding NaN that the clipping path never summed: the update's norm is finite, so it is applied with
    the NaN, not skipped; the audit let it pass as a skipped non-finite update."""
    gathered = C.layout_grad_norm([torch.tensor([3.0, 4.0]), torch.tensor([float("nan")])])
    (v,) = C.check_grad_norm_audit(5.0, gathered)
    assert v.check == "gradient_scale.grad_norm_audit" and v.metric == 1.0
    assert "applied with it instead of skipped" in v.message and "misses a sharded dim" in v.message
    assert C.check_grad_norm_audit(float("nan"), gathered) == []  # skipped, and reported as a non-finite update
    assert C.check_grad_norm_audit(float("inf"), 5.0) == []


def test_loss_normaliser_takes_a_float32_count_past_2_to_the_24():
    """The trainer counts targets in float32: a 16,777,217-target update is divided by 16,777,216.0, which is right."""
    targets = 2**24 + 1
    assert C.check_loss_normaliser(float(torch.tensor(float(targets), dtype=torch.float32)), targets, None) == []
    (v,) = C.check_loss_normaliser(targets / 2, targets, None)
    assert v.metric == pytest.approx(0.5) and "rank(s) [0]" in v.message and "never by a local count" in v.message


def test_each_violation_says_what_to_do():
    (mix,) = C.check_source_mix({"code": 9000, "prose": 1000}, {"code": 0.5, "prose": 0.5}, None, slack_tokens=64)
    assert "check data.mixture" in mix.message
    (audit,) = C.check_grad_norm_audit(2.5, 5.0)
    assert "the clipping path" in audit.message
    (ep,) = C.check_ep_token_counts(torch.tensor([7]), torch.tensor([7]), routed_tokens=4, top_k=2, group=None)
    assert "parallelism.expert_dispatch" in ep.message
    ref = {"w": torch.ones(4)}
    (probe,) = C.check_probe_reference({"w": torch.full((4,), 0.5)}, ref, None)
    assert "a gradient reduction is missing, doubled or over the wrong group" in probe.message
    (expert,) = C.check_expert_grad_scale({"w": torch.full((4,), 0.5)}, ref, None)
    assert "over the wrong group" in expert.message


def test_ep_counts_in_one_process():
    assert C.check_ep_token_counts(torch.tensor([8]), torch.tensor([8]), routed_tokens=4, top_k=2, group=None) == []
    (v,) = C.check_ep_token_counts(torch.tensor([7]), torch.tensor([7]), routed_tokens=4, top_k=2, group=None)
    assert "dispatched 7, received 7, k x routed = 8" in v.message


def test_replicated_state_skips_per_rank_accumulators():
    from titan_k3.models.k3.args import get_flavor
    from titan_k3.models.k3.impl import reference_impl
    from titan_k3.models.k3.model import K3Model

    with torch.device("meta"):
        model = K3Model(get_flavor("debug"), reference_impl())
    names = set(replicated_state(model, qk_clip_max_logits={3: torch.ones(2)}))
    assert "buffer:layers.1.ffn.router.qb_bias" in names and "qk_clip:3.max_logit" in names
    assert not any(n.endswith(("load_counts", "max_logit")) and n.startswith("buffer:") for n in names)


def test_abort_raises_after_reporting(tmp_path):
    cfg = SimpleNamespace(enable=True, interval=1, abort=True)
    counted = []
    runner = InvariantRunner(cfg, EventLog(tmp_path / "events.jsonl"), group=None, rank=0, device=torch.device("cpu"),
                             on_violation=counted.append)
    model = torch.nn.Linear(2, 2)
    model(torch.randn(3, 2)).sum().backward()
    batch = SimpleNamespace(fingerprints=torch.arange(2))
    runner.before_clip(1, batches=[batch], model=model, optimizers=None, normaliser=torch.tensor(3.0),
                       local_valid=torch.tensor(6))
    with pytest.raises(InvariantViolationError, match="gradient_scale.loss_normaliser violated at step 1"):
        runner.after_clip(C.layout_grad_norm([p.grad for p in model.parameters()]))
    assert counted == ["gradient_scale.loss_normaliser"]
    assert '"check": "gradient_scale.loss_normaliser"' in (tmp_path / "events.jsonl").read_text()


def test_probes_beside_a_replica_drift_point_at_the_drift():
    """Replicas that drifted apart make the probes fire too (~1.00x, a few percent off), and their own advice (a
    wrong reduction) sent the user after a bug that was not there: beside replicas.checksums they say so."""
    from titan_k3.invariants.runner import blame_drift

    drift = C.Violation("replicas.checksums", 1.0, "1 replicated tensors differ across ranks")
    probe = C.Violation("gradient_scale.probe_reference", 0.05, "gradients off the reference: check the reduction")
    other = C.Violation("data.source_mix", 0.2, "source web off its weight")
    alone = blame_drift([probe, other])
    assert [v.message for v in alone] == [probe.message, other.message]
    both = blame_drift([probe, drift, other])
    assert both[0].message.startswith(probe.message) and "replicas.checksums fired in this update too" in both[0].message
    assert both[1] is drift and both[2] is other
