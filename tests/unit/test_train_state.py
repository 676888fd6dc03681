"""TrainState: what the checkpointer saves of where a run is, and what it accepts back."""

from __future__ import annotations

import pytest

from titan_k3.train_state import TrainState


def test_state_dict_round_trips_every_field():
    state = TrainState(step=7, tokens_seen=896, skipped_updates=2, skipped_in_row=1, seq_len=256)
    again = TrainState(seq_len=128)
    again.load_state_dict(state.state_dict())
    assert again == state


def test_a_checkpoint_from_before_seq_len_keeps_the_current_length():
    state = TrainState(seq_len=128)
    state.load_state_dict({"step": 3, "tokens_seen": 384, "skipped_updates": 0, "skipped_in_row": 0})
    assert (state.step, state.tokens_seen, state.seq_len) == (3, 384, 128)


@pytest.mark.parametrize("bad, message", [({"step": 1}, "missing keys"), ({**TrainState().state_dict(), "epoch": 1},
                                                                          "unknown keys")])
def test_a_foreign_state_is_refused_by_name(bad, message):
    with pytest.raises(ValueError, match=message):
        TrainState().load_state_dict(bad)
