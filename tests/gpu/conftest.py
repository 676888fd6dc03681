"""GPU test sessions end when their tests end.

NOTE: on the H200 (torch 2.11) a pytest run of tests/gpu that built a Trainer or compiled a model printed its
result and then hung in interpreter shutdown until killed (session 7, twice: ~130 s of GPU time each). With
CUDA present the session now leaves with its exit status right after the summary, skipping Python's
shutdown; CPU sessions (CI) are untouched.

`inductor_picks_configs_without_timing`: the fixture of the tests that compare two compiled trainers.
"""

import os
import sys

import pytest
import torch


def pytest_unconfigure(config):
    if torch.cuda.is_available() and getattr(config, "_gpu_exitstatus", None) is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(config._gpu_exitstatus)


def pytest_sessionfinish(session, exitstatus):
    if torch.cuda.is_available():
        session.config._gpu_exitstatus = int(exitstatus)


@pytest.fixture
def inductor_picks_configs_without_timing():
    """Inductor's deterministic mode for the compiled trainers these tests compare.

    NOTE: each trainer compiles its own kernels, and inductor times a reduction's candidate configs (its block and
    warps: the summation order) on the GPU as it first runs them; near-tied candidates can fall either way in each
    trainer, and two trainers of one process then differ in the last bits, which a test comparing them would read
    as a fault of what it tests. The mode picks those configs without timing, so both run the same kernels.
    """
    import torch._inductor.config

    with torch._inductor.config.patch(deterministic=True):
        yield
