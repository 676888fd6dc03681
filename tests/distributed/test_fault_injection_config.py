"""The [debug] fault-injection keys: off by default, bad values and a run of one rank refused in one line."""

from __future__ import annotations

import pytest

from titan_k3.config import ConfigError, JobConfig, load_job_config
from titan_k3.parallel.faults import active_injections, check_injections

CPU = ["--model.flavor", "debug", "--training.device", "cpu", "--training.seq_len", "64", "--kernels.kda", "torch"]


def test_every_injection_is_off_by_default():
    assert active_injections(JobConfig().debug) == {}
    check_injections(JobConfig().debug, dp_world=1)  # nothing on: any world size


@pytest.mark.parametrize("argv, words", [
    (["--debug.inject_replica_drift", "nan"], "config key 'debug.inject_replica_drift' = nan: expected a finite number"),
    (["--debug.inject_replica_drift", "inf"], "config key 'debug.inject_replica_drift' = inf: expected a finite number"),
    (["--debug.inject_grad_scale", "fsdp_avg"], "debug.inject_grad_scale"),
    (["--debug.inject_same_data", "maybe"], "debug.inject_same_data"),
])
def test_bad_values_stop_with_one_line(argv, words):
    with pytest.raises(ConfigError) as e:
        load_job_config(CPU + argv)
    assert words in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("argv, key, shown", [
    (["--debug.inject_same_data", "true"], "debug.inject_same_data", "true"),
    (["--debug.inject_replica_drift", "1e-3"], "debug.inject_replica_drift", "0.001"),
    (["--debug.inject_grad_scale", "fsdp_average"], "debug.inject_grad_scale", "'fsdp_average'"),
])
def test_an_injection_needs_two_data_parallel_ranks(argv, key, shown):
    cfg = load_job_config(CPU + argv)
    assert list(active_injections(cfg.debug)) == [key]
    check_injections(cfg.debug, dp_world=2)
    # NOTE: the value as the TOML file would hold it (true, not Python's True).
    with pytest.raises(ConfigError, match=f"^config key '{key}' = {shown}: a fault injection needs 2 or more data-parallel ranks"):
        check_injections(cfg.debug, dp_world=1)


def test_the_trainer_refuses_an_injection_in_one_process_before_any_work(tmp_path, capsys):
    from titan_k3.train import main

    code = main(CPU + ["--debug.inject_grad_scale", "local_normaliser", "--job.dump_folder", str(tmp_path),
                       "--job.name", "one"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code != 0 and len(err) == 1 and "a fault injection needs 2 or more data-parallel ranks" in err[0], err
    assert not (tmp_path / "one").exists()
