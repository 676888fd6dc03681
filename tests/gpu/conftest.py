"""GPU test sessions end when their tests end.

NOTE: on the H200 (torch 2.11) a pytest run of tests/gpu that built a Trainer or compiled a model printed its
result and then hung in interpreter shutdown until killed (session 7, twice: ~130 s of GPU time each). With
CUDA present the session now leaves with its exit status right after the summary, skipping Python's
shutdown; CPU sessions (CI) are untouched.
"""

import os
import sys

import torch


def pytest_unconfigure(config):
    if torch.cuda.is_available() and getattr(config, "_gpu_exitstatus", None) is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(config._gpu_exitstatus)


def pytest_sessionfinish(session, exitstatus):
    if torch.cuda.is_available():
        session.config._gpu_exitstatus = int(exitstatus)
