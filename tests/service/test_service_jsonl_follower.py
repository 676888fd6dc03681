"""The service's incremental reader of metrics.jsonl / events.jsonl against a trainer that was killed inside a write."""

import json

from service.rundir import JsonlFollower
from titan_k3.metrics.events import JsonLines, drop_cut_short_tail


def test_a_cut_short_line_dropped_by_the_resumed_trainer_costs_no_record_and_counts_none_twice(tmp_path):
    """The follower kept the cut-short bytes and an offset past them: once the resumed trainer dropped them and
    appended, it glued the fragment to the middle of the next record (lost) or, the file now shorter than its
    offset, read the whole file again (every event counted twice)."""
    path = tmp_path / "events.jsonl"
    follower = JsonlFollower(path)
    path.write_text(json.dumps({"step": 1}) + "\n" + '{"step": 2, "kind": "che')  # the kill
    assert follower.poll() == [{"step": 1}]
    resumed = JsonLines(path)
    resumed.append({"step": 2, "kind": "restart"})
    assert follower.poll() == [{"step": 2, "kind": "restart"}]
    resumed.append({"step": 3})
    assert follower.poll() == [{"step": 3}]

    # Polled between the drop and the append: the file is shorter than what was read, and nothing is read again.
    path = tmp_path / "m.jsonl"
    follower = JsonlFollower(path)
    path.write_text(json.dumps({"step": 1}) + "\n" + '{"step": 2, "loss": 9.1234')
    assert follower.poll() == [{"step": 1}]
    drop_cut_short_tail(path)
    assert follower.poll() == []
    JsonLines(path).append({"step": 2})
    assert follower.poll() == [{"step": 2}]


def test_a_line_in_progress_is_read_once_it_is_whole(tmp_path):
    path = tmp_path / "metrics.jsonl"
    follower = JsonlFollower(path)
    assert follower.poll() == []
    with open(path, "w") as f:
        f.write('{"step": 1, "lo')
        f.flush()
        assert follower.poll() == []
        f.write('ss": 2.5}\n{"step": 2}\n')
    assert follower.poll() == [{"step": 1, "loss": 2.5}, {"step": 2}]
    assert follower.poll() == []
