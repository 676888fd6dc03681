"""lr_factor closed forms (warmup, cosine, WSD) and LRSchedule's resume behaviour."""

import math

import pytest

from titan_k3.optim import LRSchedule, lr_factor


def _f(step, **kw):
    args = dict(total_steps=110, warmup_steps=10, decay_type="cosine", decay_ratio=None, min_lr_factor=0.1)
    args.update(kw)
    return lr_factor(step, **args)


def test_warmup_is_linear_from_first_update_to_one():
    assert _f(1) == pytest.approx(0.1)
    assert _f(5) == pytest.approx(0.5)
    assert _f(10) == 1.0
    assert _f(1, warmup_steps=0) < 1.0  # no warmup: update 1 already decays (cosine from update 1)


def test_cosine_midpoint_end_and_monotone():
    assert _f(60) == pytest.approx((1 + 0.1) / 2)  # progress 50/100
    assert _f(35) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.25)))
    assert _f(110) == pytest.approx(0.1)
    assert _f(500) == pytest.approx(0.1)  # past the end: held
    values = [_f(s) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(values, values[1:]))


@pytest.mark.parametrize(
    "decay_type, shape",
    [
        ("linear", lambda p: 1 - p),
        ("sqrt", lambda p: 1 - math.sqrt(p)),
        ("cosine", lambda p: 0.5 * (1 + math.cos(math.pi * p))),
    ],
)
def test_wsd_stable_then_decay_over_last_ratio(decay_type, shape):
    kw = dict(total_steps=100, warmup_steps=10, decay_type=decay_type, decay_ratio=0.2, min_lr_factor=0.05)
    assert lr_factor(10, **kw) == 1.0
    assert all(lr_factor(s, **kw) == 1.0 for s in range(11, 81))  # stable through update 80
    for step in (81, 85, 90, 99):
        p = (step - 80) / 20
        assert lr_factor(step, **kw) == pytest.approx(0.05 + 0.95 * shape(p))
    assert lr_factor(100, **kw) == pytest.approx(0.05)


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(step=0), "step"),
        (dict(total_steps=0), "total_steps"),
        (dict(warmup_steps=200), "warmup_steps"),
        (dict(warmup_steps=-1), "warmup_steps"),
        (dict(decay_type="exp"), "decay_type"),
        (dict(decay_ratio=0.0), "decay_ratio"),
        (dict(decay_ratio=1.5), "decay_ratio"),
        (dict(decay_ratio=0.95), "decay_ratio"),  # 10 warmup + 105 decay > 110
        (dict(decay_ratio=0.001), "decay_ratio"),  # rounds to 0 decay steps
        (dict(min_lr_factor=1.5), "min_lr_factor"),
    ],
)
def test_invalid_arguments_raise_naming_them(bad, match):
    step = bad.pop("step", 5)
    with pytest.raises(ValueError, match=match):
        _f(step, **bad)


class _Recorder:
    def __init__(self):
        self.lrs = []

    def set_lr(self, lr):
        self.lrs.append(lr)


def test_schedule_sets_lr_before_each_update_and_resumes():
    kw = dict(base_lr=2.0, total_steps=20, warmup_steps=4, decay_type="linear", decay_ratio=0.5, min_lr_factor=0.0)
    rec = _Recorder()
    sched = LRSchedule(rec, **kw)
    for _ in range(7):
        sched.step()
    expected = [2.0 * lr_factor(s, **{k: v for k, v in kw.items() if k != "base_lr"}) for s in range(1, 9)]
    assert rec.lrs == pytest.approx(expected)

    rec2 = _Recorder()
    resumed = LRSchedule(rec2, **kw)
    resumed.load_state_dict(sched.state_dict())
    assert rec2.lrs[-1] == rec.lrs[-1] == resumed.lr
    sched.step()
    resumed.step()
    assert rec2.lrs[-1] == rec.lrs[-1]
