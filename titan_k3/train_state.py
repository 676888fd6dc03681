"""TrainState: where a run is, as one Stateful object the checkpointer saves and restores.

The trainer advances it after every update and reads the current sequence
length from it alone (a context curriculum changes it mid-run); the
checkpointer writes `state_dict()` into the checkpoint's meta.json and hands it
back through `load_state_dict`. The data position itself is the loader's own
Stateful state (global sequence index, per-source positions, its sequence
length), saved beside it in each rank's file: the loader is its one owner.
Torch-free.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any


@dataclass
class TrainState:
    step: int = 0
    """Updates done (the last one finished; the next is step + 1)."""
    tokens_seen: int = 0
    """Input tokens of every update done, over all data-parallel ranks."""
    skipped_updates: int = 0
    """Updates skipped for a non-finite loss or gradient norm."""
    skipped_in_row: int = 0
    """Skipped updates since the last applied one (training.max_skipped_in_row stops the run)."""
    seq_len: int = 0
    """Tokens per sequence of the current update: training.seq_len, or its context stage's length."""

    def state_dict(self) -> dict[str, int]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from `state_dict()` output.

        NOTE: checkpoints written before the sequence length was part of the state lack `seq_len`; it then keeps
        its current value and the trainer's curriculum check puts the right one back before the next update.
        """
        names = {f.name for f in fields(self)}
        unknown = sorted(set(state) - names)
        if unknown:
            raise ValueError(f"train state: unknown keys {unknown}; expected {sorted(names)}")
        missing = sorted(names - set(state) - {"seq_len"})
        if missing:
            raise ValueError(f"train state: missing keys {missing}")
        for name, value in state.items():
            setattr(self, name, int(value))
