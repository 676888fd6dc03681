"""metrics.jsonl / events.jsonl after a kill inside a write: the cut-short line is dropped, never glued to the next."""

import json

import pytest

from titan_k3.metrics.events import JsonLines, drop_cut_short_tail
from titan_k3.metrics.run_dir import read_jsonl
from titan_k3.train import main as train_main

FAST = ["--model.flavor", "debug", "--training.seq_len", "64", "--training.device", "cpu", "--metrics.log_freq", "1",
        "--lr_scheduler.warmup_steps", "1", "--checkpoint.enable", "true", "--checkpoint.interval", "2"]


def test_the_first_append_drops_a_cut_short_tail(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"step": 1}) + "\n" + '{"step": 2, "lo')
    records = JsonLines(path)
    records.append({"step": 3})
    assert read_jsonl(path) == [{"step": 1}, {"step": 3}]
    records.append({"step": 4})  # the tail is checked at the first append only
    assert [r["step"] for r in read_jsonl(path)] == [1, 3, 4]


@pytest.mark.parametrize("text, kept", [("", ""), ("{", ""), ('{"a": 1}\n', '{"a": 1}\n'),
                                        ('{"a": 1}\n{"b"', '{"a": 1}\n'), ("x" * 200_000, "")])
def test_drop_cut_short_tail_keeps_every_whole_line(tmp_path, text, kept):
    path = tmp_path / "f.jsonl"
    path.write_text(text)
    assert drop_cut_short_tail(path) == len(text) - len(kept)
    assert path.read_text() == kept


def test_read_jsonl_leaves_out_a_line_still_being_written_and_names_a_bad_one(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2, "lo')
    assert read_jsonl(path) == [{"step": 1}]
    path.write_text('{"step": 1}\n{"step": 2, "lo\n{"step": 3}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: not a JSON object"):
        read_jsonl(path)


def test_a_run_resumed_after_a_kill_inside_a_write_reads_whole(tmp_path):
    """A kill inside a metrics.jsonl write left half a record; the resumed run appended its next record onto it:
    one unreadable line in the middle (summarize and sweep refused the run) and that record lost."""
    args = [*FAST, "--job.dump_folder", str(tmp_path), "--job.name", "r"]
    assert train_main([*args, "--training.steps", "2"]) == 0
    run = tmp_path / "r"
    for name in ("metrics.jsonl", "events.jsonl"):
        with open(run / name, "a") as f:
            f.write('{"step": 3, "loss": 9.')  # what the kill left
    assert train_main([*args, "--training.steps", "4"]) == 0
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == [1, 2, 3, 4]
    for name in ("metrics.jsonl", "events.jsonl"):
        lines = (run / name).read_text().splitlines()
        assert all(json.loads(line) for line in lines), name
