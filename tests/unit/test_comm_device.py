"""Small collectives go where the group's backend takes them: NCCL refuses host tensors, gloo device ones."""

import pytest
import torch

from titan_k3.parallel import distributed as d


@pytest.mark.parametrize("backend, expected", [
    ("nccl", torch.device("cuda", 3)),
    ("gloo", torch.device("cpu")),
    ("cpu:gloo,cuda:nccl", torch.device("cpu")),  # a mixed group takes host tensors as they are
])
def test_comm_device_follows_the_backend(monkeypatch, backend, expected):
    monkeypatch.setattr(d.dist, "get_backend", lambda group: backend)
    monkeypatch.setattr(d.torch.cuda, "current_device", lambda: 3)
    assert d.comm_device(object()) == expected


def test_small_collectives_without_a_group_are_local_copies():
    x = torch.tensor([1.0, 2.0])
    y = d.all_reduce_small(x, None)
    assert torch.equal(y, x) and y.data_ptr() != x.data_ptr()


def test_invariant_checks_use_only_the_device_aware_collectives():
    """The checks gather host tensors; a raw dist.all_reduce / all_gather there crashed every NCCL run at its first check."""
    import inspect

    from titan_k3.invariants import checks

    source = inspect.getsource(checks)
    assert "dist.all_reduce(" not in source and "dist.all_gather(" not in source
