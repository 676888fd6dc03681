"""Learning-rate schedules: linear warmup, then cosine decay or WSD (docs/k3.md §7).

`lr_factor` is a closed-form function of the update index; `LRSchedule`
applies `base_lr * lr_factor(step)` to the optimizers before each update.
"""

from __future__ import annotations

import math
from typing import Any

DECAY_TYPES = ("linear", "sqrt", "cosine")


def lr_factor(
    step: int,
    *,
    total_steps: int,
    warmup_steps: int,
    decay_type: str,
    decay_ratio: float | None,
    min_lr_factor: float,
) -> float:
    """Multiplier of the base learning rate for update number `step`.

    `step` is the 1-based index of the update about to be applied
    (1 <= step; steps past `total_steps` keep the final value `min_lr_factor`).
    With W = warmup_steps, N = total_steps:

    warmup  (step <= W):        factor = step / W        (1/W at the first update, 1 at update W)
    decay window: the last D updates, where D = N - W if decay_ratio is None
                  (decay right after warmup), else D = round(decay_ratio * N) (WSD)
    stable  (W < step <= N - D): factor = 1
    decay   (N - D < step):     progress p = (step - (N - D)) / D in (0, 1], and with m = min_lr_factor
        "cosine": m + (1 - m) * 0.5 * (1 + cos(pi * p))
        "linear": m + (1 - m) * (1 - p)
        "sqrt":   m + (1 - m) * (1 - sqrt(p))
    so the last update (step N) runs at exactly m (when there is a decay window, D >= 1).
    """
    _check_args(total_steps, warmup_steps, decay_type, decay_ratio, min_lr_factor)
    if not isinstance(step, int) or step < 1:
        raise ValueError(f"lr_factor: step={step!r}; must be an int >= 1 (the 1-based update index)")
    step = min(step, total_steps)
    if step <= warmup_steps:
        return step / warmup_steps
    decay_steps = _decay_steps(total_steps, warmup_steps, decay_ratio)
    decay_start = total_steps - decay_steps
    if step <= decay_start:
        return 1.0
    progress = (step - decay_start) / decay_steps
    if decay_type == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    elif decay_type == "linear":
        shape = 1.0 - progress
    else:
        shape = 1.0 - math.sqrt(progress)
    return min_lr_factor + (1.0 - min_lr_factor) * shape


def _decay_steps(total_steps: int, warmup_steps: int, decay_ratio: float | None) -> int:
    if decay_ratio is None:
        return total_steps - warmup_steps
    return round(decay_ratio * total_steps)


def _check_args(
    total_steps: int, warmup_steps: int, decay_type: str, decay_ratio: float | None, min_lr_factor: float
) -> None:
    if not isinstance(total_steps, int) or total_steps < 1:
        raise ValueError(f"total_steps={total_steps!r}; must be an int >= 1")
    if not isinstance(warmup_steps, int) or not 0 <= warmup_steps <= total_steps:
        raise ValueError(f"warmup_steps={warmup_steps!r}; must be an int in [0, total_steps={total_steps}]")
    if decay_type not in DECAY_TYPES:
        raise ValueError(f"decay_type={decay_type!r}; allowed: {', '.join(DECAY_TYPES)}")
    if decay_ratio is not None:
        if not 0.0 < decay_ratio <= 1.0:
            raise ValueError(f"decay_ratio={decay_ratio!r}; must be None (decay after warmup) or in (0, 1]")
        decay_steps = round(decay_ratio * total_steps)
        if decay_steps == 0:
            raise ValueError(f"decay_ratio={decay_ratio}: rounds to 0 decay steps of total_steps={total_steps}")
        if warmup_steps + decay_steps > total_steps:
            raise ValueError(
                f"decay_ratio={decay_ratio}: warmup_steps={warmup_steps} + {decay_steps} decay steps "
                f"exceed total_steps={total_steps}"
            )
    if not 0.0 <= min_lr_factor <= 1.0:
        raise ValueError(f"min_lr_factor={min_lr_factor!r}; must be in [0, 1]")


class LRSchedule:
    """Sets `base_lr * lr_factor(step)` on the optimizers for the next update.

    `optimizers` is anything with `set_lr(lr)` (an `Optimizers`). Construction
    sets the LR of update 1; call `step()` once after every applied update,
    which sets the LR of the next one. `state_dict()` holds the number of
    updates taken, so a resumed run continues the same curve.
    """

    def __init__(
        self,
        optimizers: Any,
        *,
        base_lr: float,
        total_steps: int,
        warmup_steps: int,
        decay_type: str,
        decay_ratio: float | None,
        min_lr_factor: float,
    ) -> None:
        if not base_lr >= 0:
            raise ValueError(f"base_lr={base_lr!r}; must be >= 0")
        _check_args(total_steps, warmup_steps, decay_type, decay_ratio, min_lr_factor)
        self.optimizers = optimizers
        self.base_lr = base_lr
        self.kwargs = dict(
            total_steps=total_steps, warmup_steps=warmup_steps, decay_type=decay_type,
            decay_ratio=decay_ratio, min_lr_factor=min_lr_factor,
        )
        self.steps_done = 0
        self._apply()

    @property
    def lr(self) -> float:
        """The learning rate of the next update."""
        return self.base_lr * lr_factor(self.steps_done + 1, **self.kwargs)

    def step(self) -> None:
        self.steps_done += 1
        self._apply()

    def state_dict(self) -> dict[str, int]:
        return {"steps_done": self.steps_done}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        self.steps_done = int(state_dict["steps_done"])
        self._apply()

    def _apply(self) -> None:
        self.optimizers.set_lr(self.lr)
