"""The invariant checks' time is their own: off the trainer's training clock, on the session clock, and reported."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from titan_k3.invariants import InvariantRunner, InvariantViolationError
from titan_k3.invariants import checks as C
from titan_k3.metrics.clocks import TwoClocks
from titan_k3.metrics.events import EventLog

UPDATE_S, CHECK_S = 2.0, 0.5


class FakeNow:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_outside_training_is_taken_off_the_training_clock_and_kept_apart():
    now = FakeNow()
    clocks = TwoClocks(now=now, start=0.0)
    with clocks.training():
        now.t += 2.0
        with clocks.outside_training("invariants"):
            now.t += 3.0
        now.t += 1.0
    with clocks.outside_training("invariants"):  # outside an update: nothing to take off
        now.t += 0.5
    with pytest.raises(RuntimeError), clocks.training():
        now.t += 1.0
        with clocks.outside_training("invariants"):
            now.t += 4.0
            raise RuntimeError("a check that aborts the run")
    assert clocks.training_seconds == 4.0
    assert clocks.own_seconds == {"invariants": 7.5}
    assert clocks.session_seconds == 11.5


def _runner(tmp_path, clocks, abort=False):
    cfg = SimpleNamespace(enable=True, interval=2, abort=abort)
    return InvariantRunner(cfg, EventLog(tmp_path / "events.jsonl"), group=None, rank=0, device=torch.device("cpu"),
                           clocks=clocks)


def _update(runner, clocks, now, step, model):
    """One update as the trainer runs it: its work on the training clock, the checks inside it."""
    batch = SimpleNamespace(fingerprints=torch.arange(2), input_ids=torch.zeros(2, 8, dtype=torch.int64))
    with clocks.training():
        now.t += UPDATE_S
        runner.before_clip(step, batches=[batch], model=model, optimizers=None, normaliser=torch.tensor(6.0),
                           local_valid=torch.tensor(6))
        runner.after_clip(1.0)


def test_check_updates_keep_the_training_clock_of_any_other_update(tmp_path, monkeypatch, capsys):
    now = FakeNow()
    clocks = TwoClocks(now=now, start=0.0)
    normaliser = C.check_loss_normaliser

    def slow_check(*a, **kw):
        now.t += CHECK_S
        return normaliser(*a, **kw)

    monkeypatch.setattr(C, "check_loss_normaliser", slow_check)
    runner = _runner(tmp_path, clocks)
    model = torch.nn.Linear(2, 2)
    model(torch.randn(3, 2)).sum().backward()
    per_update = []
    for step in (1, 2, 3, 4):
        before = clocks.training_seconds
        _update(runner, clocks, now, step, model)
        per_update.append(clocks.training_seconds - before)
    assert per_update == [UPDATE_S] * 4  # updates 2 and 4 ran the checks
    assert clocks.own_seconds["invariants"] == pytest.approx(2 * CHECK_S)
    assert clocks.session_seconds == pytest.approx(4 * UPDATE_S + 2 * CHECK_S)
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("invariants at step")]
    assert len(lines) == 2
    # The cost line's yardstick: the update before, on the training clock.
    assert all(", off the training clock (" in x and f"of a {1e3 * UPDATE_S:.0f} ms update, " in x for x in lines), lines


def test_an_aborting_check_still_keeps_its_time_off_the_training_clock(tmp_path, monkeypatch):
    now = FakeNow()
    clocks = TwoClocks(now=now, start=0.0)

    def failing_check(*a, **kw):
        now.t += CHECK_S
        return [C.Violation("gradient_scale.loss_normaliser", 2.0, "divided by the wrong count")]

    monkeypatch.setattr(C, "check_loss_normaliser", failing_check)
    runner = _runner(tmp_path, clocks, abort=True)
    model = torch.nn.Linear(2, 2)
    model(torch.randn(3, 2)).sum().backward()
    with pytest.raises(InvariantViolationError, match="loss_normaliser"):
        _update(runner, clocks, now, 2, model)
    assert clocks.training_seconds == UPDATE_S and clocks.own_seconds["invariants"] == CHECK_S
