"""[profiling] memory_peak_updates on a GPU: the report's peak is the allocator's own, and its blocks are named.

A tiny run with the update as a CUDA graph records the allocator's trace from the trainer's start through its last
update (3); the report's peak must be torch.cuda's peak allocated over the run, and what it lists
must hold the model's weights, allocated by the trainer.
"""

import re

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_the_report_reads_the_allocators_peak_and_names_the_weights(tmp_path):
    from titan_k3.config import load_job_config
    from titan_k3.train import Trainer

    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    trainer = Trainer(load_job_config([
        "--model.flavor", "tiny", "--training.seq_len", "512", "--training.local_batch_size", "2",
        "--training.device", "cuda", "--training.steps", "3", "--lr_scheduler.warmup_steps", "1",
        "--compile.cuda_graph", "true", "--metrics.log_freq", "1000", "--invariants.enable", "false",
        "--profiling.memory_peak_updates", "3", "--job.dump_folder", str(tmp_path), "--job.name", "m"]))
    trainer.train()
    text = (tmp_path / "m" / "memory-peak-rank0.md").read_text()
    peak_gib = float(re.search(r"Peak ([0-9.]+) GiB allocated", text).group(1))
    want = torch.cuda.max_memory_allocated() / 2**30  # the report counts what was allocated before its trace too
    assert abs(peak_gib - want) <= max(0.002, 0.01 * want), (peak_gib, want)
    by_repo = text.split("By the innermost frame in the repository:")[1].split("By the innermost frame (")[0]
    assert "titan_k3/train.py" in by_repo  # the weights, materialised by the trainer
    assert "The allocation that reached it" in text
    trainer.close()
