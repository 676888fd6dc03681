"""A run resumed inside a context stage continues at that stage's length and its data position, read from its
TrainState; a resume at another rate per update counts the tokens it has done as they were."""

import json

from titan_k3.train import main

FAST = ["--model.flavor", "debug", "--training.seq_len", "64", "--metrics.log_freq", "1"]


def test_resume_inside_a_context_stage_keeps_its_length_and_counts(tmp_path):
    run = [*FAST, "--job.dump_folder", str(tmp_path), "--job.name", "ctx", "--training.context_stages", "3:128",
           "--checkpoint.enable", "true", "--checkpoint.interval", "2"]
    assert main([*run, "--training.steps", "4"]) == 0
    meta = json.loads((tmp_path / "ctx" / "checkpoints" / "step-4" / "meta.json").read_text())
    assert meta["train"]["seq_len"] == 128 and meta["train"]["tokens_seen"] == 64 + 64 + 128 + 128
    # The data position travels in the TrainState: one sequence per update, in windows of the stage's length.
    assert (meta["train"]["data"]["seq_index"], meta["train"]["data"]["seq_len"]) == (4, 128)
    assert main([*run, "--training.steps", "6"]) == 0
    meta = json.loads((tmp_path / "ctx" / "checkpoints" / "step-6" / "meta.json").read_text())
    assert meta["train"]["data"]["seq_index"] == 6
    records = [json.loads(x) for x in (tmp_path / "ctx" / "metrics.jsonl").read_text().splitlines()]
    assert [r["tokens_seen"] for r in records if r["step"] > 4] == [512, 640]
    events = [json.loads(x) for x in (tmp_path / "ctx" / "events.jsonl").read_text().splitlines()]
    # NOTE: the stage began once, at update 3; the resumed session starts inside it and announces nothing.
    assert [e["step"] for e in events if e["kind"] == "context_stage"] == [3]


def test_a_resume_at_another_rate_says_the_tokens_done_plus_the_rest(tmp_path, capsys):
    """Two rows per update for 2 updates (256 tokens), then one row per update (as on half the ranks) for 2 more:
    the run trains on 256 + 2 x 64 tokens, not 4 updates at the new rate."""
    run = [*FAST, "--job.dump_folder", str(tmp_path), "--job.name", "rate", "--training.steps", "2",
           "--checkpoint.enable", "true", "--checkpoint.interval", "2", "--invariants.enable", "false"]
    assert main([*run, "--training.local_batch_size", "2"]) == 0
    capsys.readouterr()
    assert main([*run, "--training.steps", "4", "--training.local_batch_size", "1"]) == 0
    out = capsys.readouterr().out
    assert "the run trains on 384 tokens" in out, out
    manifest = json.loads((tmp_path / "rate" / "manifest.json").read_text())
    assert manifest["dataset"]["run_tokens"] == 384
    records = [json.loads(x) for x in (tmp_path / "rate" / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["tokens_seen"] == 384


def test_a_resume_whose_data_position_does_not_fit_changes_nothing(tmp_path, capsys):
    """A resume refused for its data position (another seed, a batch that does not divide it) had already rewritten
    the run's config.toml and manifest.json (seed = 5 beside a checkpoint of seed 0) and appended to events.jsonl."""
    run = [*FAST, "--job.dump_folder", str(tmp_path), "--job.name", "fit", "--checkpoint.enable", "true",
           "--checkpoint.interval", "1", "--invariants.enable", "false", "--training.local_batch_size", "3"]
    assert main([*run, "--training.steps", "1"]) == 0
    files = {p.name: p.read_bytes() for p in (tmp_path / "fit").iterdir() if p.is_file()}
    capsys.readouterr()
    for other in (["--training.seed", "5"], ["--training.local_batch_size", "2"]):
        assert main([*run, "--training.steps", "2", *other]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: checkpoint {tmp_path}/fit/checkpoints/step-1: data loader position does not "
                              "fit this run: "), err
        assert {p.name: p.read_bytes() for p in (tmp_path / "fit").iterdir() if p.is_file()} == files
