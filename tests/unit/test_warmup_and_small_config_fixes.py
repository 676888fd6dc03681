"""Warmup as a fraction of the run (a recipe shortened with --training.steps keeps its shape), and the
one-line refusals for what used to pass or read wrong: both warmup keys, a warmup too long, a negative
float8.min_dim, a directory given as the config file, a recipe that needs a prepared dataset."""

from pathlib import Path

import pytest

from titan_k3.config import ConfigError, load_job_config
from titan_k3.config.validate import warmup_updates

REPO = Path(__file__).resolve().parents[2]
PRETRAIN = ["--job.config_file", str(REPO / "tomls/pretrain.toml"), "--data.dataset", "prepared/web"]


def _warmup(argv):
    cfg = load_job_config(argv)
    return warmup_updates(cfg.lr_scheduler, cfg.training.steps)


def test_pretrain_warms_up_one_percent_at_any_length():
    assert _warmup(PRETRAIN) == 1526  # 1% of 152,588
    assert _warmup([*PRETRAIN, "--training.steps", "50"]) == 1  # 0.5 rounds to 0: a fraction > 0 warms up >= 1
    assert _warmup([*PRETRAIN, "--training.steps", "1000"]) == 10
    assert _warmup([*PRETRAIN, "--training.steps", "1"]) == 0  # a one-update run has no room for warmup
    assert _warmup(["--lr_scheduler.warmup_fraction", "0.9", "--training.steps", "5"]) == 4  # below steps


def test_warmup_steps_and_the_default():
    assert _warmup(["--training.steps", "20"]) == 2  # neither key set: 2 updates
    assert _warmup(["--training.steps", "2"]) == 1  # ... below training.steps
    assert _warmup(["--training.steps", "20", "--lr_scheduler.warmup_steps", "0"]) == 0
    assert _warmup([*PRETRAIN, "--lr_scheduler.warmup_fraction", "0", "--lr_scheduler.warmup_steps", "7"]) == 7


@pytest.mark.parametrize("argv, expected", [
    ([*PRETRAIN, "--lr_scheduler.warmup_steps", "100"],
     "config keys 'lr_scheduler.warmup_steps' = 100 and 'lr_scheduler.warmup_fraction' = 0.01 are both set"),
    (["--lr_scheduler.warmup_steps", "1526", "--training.steps", "50"],
     "must be below training.steps = 50; pass --lr_scheduler.warmup_steps N with N < 50, or "
     "--lr_scheduler.warmup_steps -1 --lr_scheduler.warmup_fraction F"),
    (["--lr_scheduler.warmup_fraction", "1"], "'lr_scheduler.warmup_fraction' = 1.0: must be in [0, 1)"),
    (["--lr_scheduler.warmup_fraction", "-0.1"], "must be in [0, 1)"),
    (["--lr_scheduler.warmup_fraction", "nan"], "config key 'lr_scheduler.warmup_fraction' = nan: "),
    (["--lr_scheduler.warmup_steps", "-2"], "'lr_scheduler.warmup_steps' = -2: must be >= 0 (or -1: unset)"),
    (["--float8.min_dim", "-1"], "config key 'float8.min_dim' = -1: must be > 0"),
    (["--job.config_file", str(REPO / "tomls")], "config key 'job.config_file' = '%s': is a directory" % (REPO / "tomls")),
    (["--job.config_file", str(REPO / "tomls/pretrain.toml")],
     "config key 'data.dataset' is empty: this recipe trains on a prepared dataset, not the embedded probe corpus; "
     "build one with `python -m titan_k3.data.prepare"),
])
def test_refusals_are_one_line(argv, expected):
    with pytest.raises(ConfigError) as e:
        load_job_config(argv)
    assert expected in str(e.value)
    assert "\n" not in str(e.value)


def test_the_trainer_schedule_uses_the_fraction():
    """The LR schedule the trainer builds warms up over warmup_updates: peak LR exactly at that update."""
    from titan_k3.optim.lr_schedule import lr_factor

    cfg = load_job_config([*PRETRAIN, "--training.steps", "400"])
    w = warmup_updates(cfg.lr_scheduler, 400)
    kw = dict(total_steps=400, warmup_steps=w, decay_type="cosine", decay_ratio=None, min_lr_factor=0.1)
    assert w == 4 and lr_factor(3, **kw) == 0.75 and lr_factor(4, **kw) == 1.0 and lr_factor(5, **kw) < 1.0
