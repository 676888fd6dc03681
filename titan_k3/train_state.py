"""TrainState: where a run is, as one Stateful object the checkpointer saves and restores.

Where a run is: the updates done, the tokens seen, the skipped updates, the
current sequence length, and the data position. The trainer advances the
counters after every update and reads the current sequence length from here
alone (a context curriculum changes it mid-run). The data position (global
sequence index, per-source positions, the loader's sequence length:
titan_k3/data/loader.py) is kept by the loader, which moves it with every batch
it hands out; the TrainState holds the loader as `data` and asks it in
`state_dict()`, so what is saved is always the position of the last batch
received, never a copy that could fall behind.

The checkpointer writes `state_dict()` (JSON-able) into the checkpoint's
meta.json and hands it back through `load_state_dict`; the loader's position is
global (the same on every rank), so one copy serves any world size.
Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Protocol


class Stateful(Protocol):
    """What owns a part of the state: the data loader for the data position."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


DATA_KEY = "data"


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
    data: Stateful | None = field(default=None, repr=False, compare=False)
    """The data position's owner (the trainer's loader): its state_dict() is the "data" entry of this state's.
    None: a state without a data position."""

    def _counters(self) -> list[str]:
        return [f.name for f in fields(self) if f.name != DATA_KEY]

    def state_dict(self) -> dict[str, Any]:
        """{counter: int} plus, with a data owner, "data": the loader's position (a JSON-able dict)."""
        state: dict[str, Any] = {name: int(getattr(self, name)) for name in self._counters()}
        if self.data is not None:
            state[DATA_KEY] = self.data.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from `state_dict()` output; the data position first, so one that does not fit changes nothing.

        Raises ValueError for unknown or missing keys, and for a data position the loader refuses (another
        dataset, seed, or a position that is not a whole number of this run's global batches).

        NOTE: checkpoints written before the sequence length was part of the state lack `seq_len`; it then keeps
        its current value and the trainer's curriculum check puts the right one back before the next update.
        A state without "data" (a checkpoint from before the data position was part of it, or one whose data
        the checkpointer leaves out: training.fixed_batch) leaves the data position where it is.
        """
        counters = self._counters()
        unknown = sorted(set(state) - set(counters) - {DATA_KEY})
        if unknown:
            raise ValueError(f"train state: unknown keys {unknown}; expected {counters + [DATA_KEY]}")
        missing = sorted(set(counters) - set(state) - {"seq_len"})
        if missing:
            raise ValueError(f"train state: missing keys {missing}")
        if DATA_KEY in state:
            if self.data is None:
                raise ValueError("train state: it holds a data position, and this state has no loader to take it")
            try:
                self.data.load_state_dict(state[DATA_KEY])
            except ValueError as e:
                raise ValueError(f"data loader position does not fit this run: {e}") from None
        for name in counters:
            if name in state:
                setattr(self, name, int(state[name]))
