"""The invariant runner's source-mix slack follows the sequence length of the update it checks (a context stage)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from titan_k3.invariants import InvariantRunner
from titan_k3.invariants import checks as C
from titan_k3.metrics.events import EventLog


@pytest.mark.parametrize("seq_len", [64, 256])
def test_source_mix_slack_is_four_windows_of_this_updates_length(seq_len, tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(C, "check_source_mix", lambda tokens, weights, group, slack_tokens: seen.append(slack_tokens) or [])
    cfg = SimpleNamespace(enable=True, interval=1, abort=False)
    runner = InvariantRunner(cfg, EventLog(tmp_path / "events.jsonl"), group=None, rank=0, device=torch.device("cpu"))
    model = torch.nn.Linear(2, 2)
    model(torch.randn(3, 2)).sum().backward()
    batch = SimpleNamespace(fingerprints=torch.arange(2), input_ids=torch.zeros(2, seq_len, dtype=torch.int64))
    loader = SimpleNamespace(weights={"code": 0.5, "prose": 0.5}, source_tokens_total={"code": 512, "prose": 512})
    runner.before_clip(1, batches=[batch], model=model, optimizers=None, normaliser=torch.tensor(6.0),
                       local_valid=torch.tensor(6), loader=loader)
    assert seen == [4 * seq_len]
