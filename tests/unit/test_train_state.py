"""TrainState: what the checkpointer saves of where a run is, and what it accepts back."""

from __future__ import annotations

import json

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


class Position:
    """A data owner as the loader is one: a JSON-able position it refuses when it is not a whole batch."""

    def __init__(self, batch: int = 4):
        self.batch, self.seq_index = batch, 0

    def state_dict(self):
        return {"seq_index": self.seq_index}

    def load_state_dict(self, state):
        if state["seq_index"] % self.batch:
            raise ValueError(f"seq_index {state['seq_index']}: not a multiple of {self.batch}")
        self.seq_index = state["seq_index"]


def test_the_data_position_is_part_of_the_state_and_is_asked_of_its_owner():
    position = Position()
    state = TrainState(step=2, seq_len=64, data=position)
    position.seq_index = 8  # the loader moves on its own; the state never holds a copy that falls behind
    assert state.state_dict()["data"] == {"seq_index": 8}
    again = TrainState(data=Position())
    again.load_state_dict(json.loads(json.dumps(state.state_dict())))  # as meta.json carries it
    assert again == state and again.data.seq_index == 8


def test_a_data_position_that_does_not_fit_is_refused_and_changes_nothing():
    state = TrainState(seq_len=64, data=Position(batch=3))
    with pytest.raises(ValueError, match=r"^data loader position does not fit this run: seq_index 8: not a multiple"):
        state.load_state_dict({**TrainState(step=2, data=Position()).state_dict(), "data": {"seq_index": 8}})
    assert (state.step, state.data.seq_index) == (0, 0)


def test_a_state_without_data_leaves_the_position_where_it_is():
    position = Position()
    position.seq_index = 4
    state = TrainState(data=position)
    state.load_state_dict(TrainState(step=5).state_dict())  # an old checkpoint's, or a fixed-batch resume
    assert (state.step, position.seq_index) == (5, 4)
    with pytest.raises(ValueError, match="no loader to take it"):
        TrainState().load_state_dict(state.state_dict())


def _loader(local_batch: int, dp_rank: int, dp_world: int):
    from titan_k3.data.loader import build_dataloader
    from titan_k3.data.tokenizer import load_tokenizer

    return build_dataloader("embedded", load_tokenizer("embedded"), 32, local_batch, dp_rank, dp_world, seed=0)


def test_a_resume_through_the_state_continues_at_the_same_global_sequence():
    """Two ranks of one sequence each save after 3 batches; one rank of two sequences resumes from the state."""
    ranks = [_loader(1, r, 2) for r in range(2)]
    for loader in ranks:
        for _ in range(3):
            next(loader)
    saved = json.loads(json.dumps(TrainState(step=3, seq_len=32, data=ranks[0]).state_dict()))
    assert saved["data"]["seq_index"] == 6 and saved["data"] == ranks[1].state_dict()
    one = _loader(2, 0, 1)
    state = TrainState(seq_len=32, data=one)
    state.load_state_dict(saved)
    assert state.step == 3 and one.state_dict()["seq_index"] == 6
    both = {int(f) for loader in ranks for f in next(loader).fingerprints}
    assert {int(f) for f in next(one).fingerprints} == both
    for loader in (*ranks, one):
        loader.close()
