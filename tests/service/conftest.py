"""Fixtures for the service tests (the harness itself lives in service_harness.py)."""

from __future__ import annotations

import pytest

from service_harness import ServiceProc


@pytest.fixture
def make_service(tmp_path):
    """Factory: make_service(fake=True, gpus=0, ...) -> a started ServiceProc; all closed at teardown."""
    made: list[ServiceProc] = []

    def make(state_name: str = "state", **kwargs) -> ServiceProc:
        svc = ServiceProc(tmp_path / state_name, **kwargs)
        made.append(svc)  # closed at teardown even when it fails to start
        return svc.start()

    yield make
    for svc in made:
        svc.close()


@pytest.fixture(scope="module")
def fake_service(tmp_path_factory):
    """One service over the fake trainer, 2 GPUs to schedule, shared by a test module."""
    svc = ServiceProc(tmp_path_factory.mktemp("fake") / "state", fake=True, gpus=2, step_seconds=0.05).start()
    yield svc
    svc.close()


@pytest.fixture(scope="module")
def fake_service_1gpu(tmp_path_factory):
    """One service over the fake trainer, 1 GPU to schedule (so one run at a time), shared by a test module."""
    svc = ServiceProc(tmp_path_factory.mktemp("fake1") / "state", fake=True, gpus=1, step_seconds=0.05).start()
    yield svc
    svc.close()
