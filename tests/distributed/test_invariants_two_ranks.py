"""Cross-rank checks on two gloo ranks, fed their inputs directly: what only two ranks can show."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from gloo_workers import spawn_gloo

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")


def _checks(rank: int, world: int, events: str) -> dict:
    from titan_k3.invariants import InvariantRunner
    from titan_k3.invariants import checks as C
    from titan_k3.invariants import probe
    from titan_k3.metrics.events import EventLog

    group = dist.group.WORLD
    out = {
        "one_rank_nan": C.check_grad_norm_agreement(1.0 if rank == 0 else float("nan"), group),
        "every_rank_nan": C.check_grad_norm_agreement(float("nan"), group),
        "agree": C.check_grad_norm_agreement(2.0, group),
    }
    # The probe as the runner runs it, its gradients averaged over the 2 ranks where they must be summed.
    reference = {"layers.1.ffn.w1": torch.ones(2, 3, 4), "output.weight": torch.ones(4, 4)}
    probe.probe_gradients = lambda *a, **kw: ({n: 0.5 * g for n, g in reference.items()}, reference)
    cfg = SimpleNamespace(enable=True, interval=1, abort=False)
    runner = InvariantRunner(cfg, EventLog(None), group=group, rank=rank, device=torch.device("cpu"))
    runner.probe(1, None, model=torch.nn.Linear(2, 2), build_copy=None, autocast=None)
    out["probe"] = runner._probed[1]
    return out


@pytest.fixture(scope="module")
def found(tmp_path_factory):
    out = tmp_path_factory.mktemp("two_ranks")
    return spawn_gloo(2, _checks, str(out), result_file=out / "results.pt")


def test_a_norm_non_finite_on_one_rank_only_is_a_disagreement(found):
    """That rank skips the update the other applies (the replicas part); the check called it a skipped update."""
    for rank in found:
        (v,) = rank["one_rank_nan"]
        assert v.check == "gradient_scale.grad_norm_agreement" and v.details["ranks"] == [1], v
        assert "rank(s) [1] clipped with a non-finite global grad norm" in v.message
        assert rank["every_rank_nan"] == [] and rank["agree"] == []


def test_the_probes_advice_names_averaging_for_the_experts_too(found):
    """The expert probe's gathered gradients are checked without a group, and its advice read as one process's
    (a generic 'missing, doubled or over the wrong group') where the dense probe beside it named averaging."""
    by_check = {v.check: v for v in found[0]["probe"]}
    assert set(by_check) == {"gradient_scale.probe_reference", "gradient_scale.expert_grad_scale"}
    for v in by_check.values():
        assert v.metric == pytest.approx(0.5)
        assert "1/2 of the right gradient: a reduction averages over the 2 ranks" in v.message, v.message
