"""optimizer.side_stream where no second stream exists: a reported fallback, refused under job.strict.

The stream itself (AdamW and Muon's update passes beside Newton-Schulz, bit-identical to one stream) is checked on
a GPU: tests/gpu/test_muon_graphs_gpu.py and tests/gpu/test_step_graph_gpu.py.
"""

import json

import pytest
import torch

from titan_k3.config import ConfigError, load_job_config
from titan_k3.models.k3.impl import KernelChoice
from titan_k3.optim import ParamSpec, build_optimizers
from titan_k3.step_graph import side_stream_choice
from titan_k3.train import Trainer


@pytest.mark.parametrize("device, world, reason", [
    ("cpu", 1, "a second stream needs a CUDA device (this run trains on cpu)"),
    ("cuda", 2, "one process only; this run has 2"),
])
def test_a_side_stream_where_none_can_run_is_a_reported_fallback(device, world, reason):
    cfg = load_job_config(["--optimizer.side_stream", "true"])
    choice = side_stream_choice(cfg, torch.device(device), world)
    assert (choice.op, choice.requested, choice.chosen, choice.fallback) == ("optimizer_stream", "on", "off", True)
    assert choice.reason.startswith(reason)


def test_one_gpu_process_takes_the_side_stream_and_none_is_asked_by_default():
    assert side_stream_choice(load_job_config([]), torch.device("cuda", 0), 1) is None
    choice = side_stream_choice(load_job_config(["--optimizer.side_stream", "true"]), torch.device("cuda", 0), 1)
    assert (choice.chosen, choice.fallback) == ("on", False)


def test_strict_refuses_a_side_stream_that_falls_back():
    cfg = load_job_config(["--optimizer.side_stream", "true", "--job.strict", "true"])
    with pytest.raises(ConfigError, match="job.strict = true and optimizer.side_stream falls back to 'off': a second"):
        side_stream_choice(cfg, torch.device("cpu"), 1)


def test_build_optimizers_refuses_a_side_stream_for_cpu_parameters():
    params = [("w", torch.nn.Parameter(torch.randn(16, 16)))]
    with pytest.raises(ValueError, match="side_stream needs parameters on a CUDA device; they are on cpu"):
        build_optimizers(params, lambda n, p: ParamSpec(use_muon=True), lr=1e-2, side_stream=True)


def test_a_cpu_run_asking_for_the_side_stream_trains_on_one_and_says_so(tmp_path):
    trainer = Trainer(load_job_config([
        "--model.flavor", "debug", "--training.seq_len", "64", "--training.local_batch_size", "2",
        "--training.steps", "2", "--lr_scheduler.warmup_steps", "1", "--optimizer.side_stream", "true",
        "--job.dump_folder", str(tmp_path), "--job.name", "cpu"]))
    try:
        assert trainer.optimizers.side_stream is None
        trainer.train()
    finally:
        trainer.close()
    kernels = json.loads((tmp_path / "cpu" / "manifest.json").read_text())["kernels"]
    want = KernelChoice("optimizer_stream", "on", "off", True,
                        "a second stream needs a CUDA device (this run trains on cpu)").as_dict()
    assert want in kernels
