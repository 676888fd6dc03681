"""A run resumed with another data.mixture continues at its data position with the new weights, and its resumed event
says so: the data order from there on is not the checkpointed run's."""

import json

from titan_k3.train import main

FAST = ["--model.flavor", "debug", "--training.seq_len", "64", "--invariants.enable", "false"]


def test_a_resume_with_another_mixture_says_so_in_its_resumed_event(tmp_path):
    run = [*FAST, "--job.dump_folder", str(tmp_path), "--job.name", "mix", "--checkpoint.enable", "true",
           "--checkpoint.interval", "2"]
    assert main([*run, "--training.steps", "2"]) == 0
    assert main([*run, "--training.steps", "3", "--data.mixture", "code:1,prose:0"]) == 0
    events = [json.loads(x) for x in (tmp_path / "mix" / "events.jsonl").read_text().splitlines()]
    [resumed] = [e["message"] for e in events if e["kind"] == "resumed"]
    assert resumed.endswith("at update 2; data mixture changed since the checkpoint, from this update on: "
                            "code 0.76 -> 1, prose 0.24 -> 0 (per-source counts restart)"), resumed
