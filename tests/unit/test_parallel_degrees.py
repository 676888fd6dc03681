"""The [parallelism] degrees against a world size: one torch-free function (config/validate.py:resolve_degrees) that
the trainer's ParallelDims calls, so a launcher that knows the world size refuses a layout with the run's own line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from titan_k3.config import ConfigError, load_job_config
from titan_k3.config.validate import resolve_degrees

ROOT = Path(__file__).resolve().parents[2]


def _parallelism(*args: str):
    return load_job_config(["--model.flavor", "debug", *args]).parallelism


@pytest.mark.parametrize("args, world, degrees", [
    ([], 1, (1, 1, 1)),
    ([], 3, (1, 3, 1)),
    (["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.expert_parallel_degree", "2"], 8, (2, 4, 2)),
    (["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "1"], 2, (2, 1, 1)),
])
def test_degrees_resolve(args, world, degrees):
    assert resolve_degrees(_parallelism(*args), world, 8) == degrees


@pytest.mark.parametrize("args, world, line", [
    (["--parallelism.data_parallel_shard_degree", "3"], 2,
     "config key 'parallelism.data_parallel_shard_degree' = 3: replicate 1 x shard 3 must equal the world size 2 "
     "(use -1 for the rest)"),
    (["--parallelism.data_parallel_replicate_degree", "2"], 3,
     "config key 'parallelism.data_parallel_replicate_degree' = 2: must divide the world size 3"),
    (["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "2"], 2,
     "config key 'parallelism.data_parallel_shard_degree' = 2: replicate 2 x shard 2 must equal the world size 2 "
     "(use -1 for the rest)"),
    (["--parallelism.expert_parallel_degree", "4"], 2,
     "config key 'parallelism.expert_parallel_degree' = 4: must divide the data-parallel shard degree 2"),
    # EP is folded over the shard ranks, not the replicas.
    (["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.expert_parallel_degree", "2"], 2,
     "config key 'parallelism.expert_parallel_degree' = 2: must divide the data-parallel shard degree 1 (EP splits the "
     "experts over the shard ranks, not over the 2 replicas)"),
])
def test_a_degree_that_does_not_fit_is_the_runs_line(args, world, line):
    """The function's line is the run's, and the planner's, which the control service refuses a submission with
    (titan_k3/plan/search.py:resolve_layout; it had a copy of the checks whose EP line differed)."""
    from titan_k3.parallel.dims import ParallelDims
    from titan_k3.plan.search import resolve_layout

    p = _parallelism(*args)
    with pytest.raises(ConfigError) as here:
        resolve_degrees(p, world, 8)
    with pytest.raises(ConfigError) as run:
        ParallelDims.from_config(p, world, 8)
    with pytest.raises(ConfigError) as planner:
        resolve_layout(load_job_config(["--model.flavor", "debug", *args]), world, 8)
    assert str(here.value) == str(run.value) == str(planner.value) == line


def test_resolving_degrees_imports_no_torch():
    """The control service never imports torch; it must be able to ask the same function as the run."""
    code = ("import sys\n"
            "from titan_k3.config import load_job_config\n"
            "from titan_k3.config.validate import resolve_degrees\n"
            "p = load_job_config(['--parallelism.expert_parallel_degree', '2']).parallelism\n"
            "assert resolve_degrees(p, 4, 8) == (1, 4, 2)\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
