"""Evaluation in the trainer (metrics.jsonl) and offline on its checkpoints (python -m titan_k3.eval) agree."""

import json

import pytest
import torch

from titan_k3.config import ConfigError, load_job_config
from titan_k3.eval.offline import main as eval_main
from titan_k3.eval.runner import Evaluator
from titan_k3.train import main as train_main

FAST = ["--model.flavor", "debug", "--training.seq_len", "64", "--training.device", "cpu", "--metrics.log_freq", "5",
        "--eval.steps", "1", "--eval.batch_size", "2"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A 2-update run evaluated at both updates and checkpointed at both."""
    dump = tmp_path_factory.mktemp("runs")
    task = dump / "toy.jsonl"
    task.write_text("\n".join(json.dumps(r) for r in [
        {"context": "The cat sat on the", "choices": [" mat", " mountains of the moon"], "gold": 0},
        {"context": "One, two,", "choices": [" three", " green"], "gold": 1},
    ]) + "\n")
    assert train_main([*FAST, "--job.dump_folder", str(dump), "--job.name", "ev", "--training.steps", "2",
                       "--lr_scheduler.warmup_steps", "1", "--eval.interval", "1", "--eval.tasks", str(task),
                       "--checkpoint.enable", "true", "--checkpoint.interval", "1"]) == 0
    return dump / "ev", task


def test_trainer_writes_eval_metrics_into_the_step_records(run):
    run_dir, _ = run
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # log_freq is 5, so both records exist because they are evaluation steps.
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert r["val_tokens"] > 0 and 0 < r["val_loss"] < 20
        assert {r["eval/toy/acc"], r["eval/toy/acc_norm"]} <= {0.0, 0.5, 1.0}
        assert "loss" in r and "tokens_seen" in r
        assert {"grad_norm/experts", "grad_norm/head"} <= r.keys()  # an evaluation step's record is a full one


def test_offline_eval_reproduces_the_logged_values(run, capsys):
    run_dir, task = run
    records = {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}
    assert eval_main(["--runs", str(run_dir), "--json", "--device", "cpu"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["step"] for r in rows] == [1, 2]
    assert [r["tokens"] for r in rows] == [64, 128]
    for row in rows:
        logged = records[row["step"]]
        assert row["val_loss"] == pytest.approx(logged["val_loss"], rel=1e-6)
        assert row["eval/toy/acc"] == logged["eval/toy/acc"]
    table = (run_dir / "eval_table.md").read_text()
    assert "| step | tokens | val_loss | toy acc | toy acc_norm |" in table
    assert f"| 2 | 128 | {records[2]['val_loss']:.4f} |" in table

    assert eval_main(["--checkpoint", str(run_dir / "checkpoints" / "step-1"), "--tasks", str(task),
                      "--val-steps", "0", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "| step | tokens | toy acc | toy acc_norm |" in out and "val_loss" not in out


def test_offline_eval_bad_input_is_one_line_and_exit_2(run, tmp_path, capsys):
    run_dir, _ = run
    assert eval_main(["--checkpoint", str(run_dir / "checkpoints" / "step-9"), "--device", "cpu"]) == 2
    assert eval_main(["--runs", str(tmp_path), "--device", "cpu"]) == 2
    assert eval_main(["--checkpoint", str(run_dir / "checkpoints" / "step-1"), "--tasks", str(tmp_path / "no.jsonl"),
                      "--device", "cpu"]) == 2
    assert eval_main(["--checkpoint", str(run_dir / "checkpoints"), "--device", "cpu"]) == 2  # the folder, not a step
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 4
    assert "step-9': not a complete step-N checkpoint" in errors[0]
    assert "no config.toml" in errors[1]
    assert "no.jsonl': no such file" in errors[2]
    assert "checkpoints': not a complete step-N checkpoint directory" in errors[3] and "--runs RUN_DIR" in errors[3]


def test_eval_batch_must_split_evenly_over_ranks():
    cfg = load_job_config(["--eval.batch_size", "8", "--eval.interval", "10"])
    with pytest.raises(ConfigError, match="'eval.batch_size' = 8: must be a multiple of the 3 data-parallel ranks"):
        Evaluator(cfg, tokenizer=None, device=torch.device("cpu"), dp_rank=0, dp_world=3)
    # Evaluation off (eval.interval = 0, the default) or without validation batches: nothing is split over the ranks,
    # and a world of 3 was refused on the defaults.
    Evaluator(load_job_config(["--eval.batch_size", "8"]), tokenizer=None, device=torch.device("cpu"), dp_world=3)
    Evaluator(cfg, tokenizer=None, device=torch.device("cpu"), dp_world=3, val_steps=0)


def test_evaluation_without_a_validation_split_stops_at_start(monkeypatch):
    from titan_k3.eval import runner

    monkeypatch.setattr(runner, "validation_split_tokens", lambda dataset: 0)
    cfg = load_job_config(["--eval.interval", "10"])
    with pytest.raises(ConfigError, match="'eval.steps' = 4: dataset 'embedded' has no validation split"):
        Evaluator(cfg, tokenizer=None, device=torch.device("cpu"))
    Evaluator(load_job_config(["--eval.interval", "10", "--eval.steps", "1", "--eval.tasks", ""]),
              tokenizer=None, device=torch.device("cpu"), val_steps=0, offline=True)


def test_offline_eval_refuses_a_damaged_checkpoint(run, tmp_path, capsys):
    """A checkpoint whose bytes changed since the save is named, not evaluated (the trainer would pass it over)."""
    import shutil

    run_dir, _ = run
    copy = tmp_path / "ev"
    shutil.copytree(run_dir, copy, ignore=shutil.ignore_patterns("eval_table.md"))
    data = copy / "checkpoints" / "step-2" / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    assert eval_main(["--checkpoint", str(copy / "checkpoints" / "step-2"), "--val-steps", "0", "--device", "cpu"]) == 2
    assert eval_main(["--runs", str(copy), "--val-steps", "0", "--device", "cpu"]) == 2
    captured = capsys.readouterr()
    errors = [line for line in captured.err.splitlines() if line.startswith("error:")]
    assert len(errors) == 2 and captured.out == ""
    for line in errors:
        assert "step-2' is damaged" in line and "__0_0.distcp" in line and "changed since the save" in line
    assert not (copy / "eval_table.md").exists()


def test_offline_eval_names_a_step_dir_without_metadata_and_another_tokenizer(run, tmp_path, capsys):
    """--runs left a step dir without .metadata out of its table without a word; a checkpoint trained with
    another tokenizer than the run's data.tokenizer now loads was scored on other token ids."""
    import shutil

    from titan_k3.checkpoint import verify

    run_dir, _ = run
    copy = tmp_path / "ev"
    shutil.copytree(run_dir, copy, ignore=shutil.ignore_patterns("eval_table.md"))
    (copy / "checkpoints" / "step-1" / ".metadata").unlink()
    assert eval_main(["--runs", str(copy), "--val-steps", "0", "--device", "cpu"]) == 2
    error = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(error) == 1 and "step-1' is damaged: no .metadata" in error[0]
    assert not (copy / "eval_table.md").exists()

    step = copy / "checkpoints" / "step-2"
    meta = json.loads((step / "meta.json").read_text())
    (step / "meta.json").write_text(json.dumps({**meta, "tokenizer": "other.json", "tokenizer_sha256": "ab" * 32}))
    verify.seal(step, None)
    assert eval_main(["--checkpoint", str(step), "--val-steps", "0", "--device", "cpu"]) == 2
    error = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(error) == 1 and "trained with tokenizer 'other.json' (sha256 abababababab...)" in error[0]


def test_offline_eval_checks_what_was_asked_before_reading_a_checkpoint(run, tmp_path, monkeypatch, capsys):
    """A task-file typo, a negative --val-steps or nothing to evaluate stopped only after every checkpoint's bytes
    were hashed and the model built (minutes for a large one); a negative --val-steps named a Python argument."""
    from titan_k3.eval import offline

    def hashed(*args, **kwargs):
        raise AssertionError("the checkpoint was read before the request was checked")

    monkeypatch.setattr(offline.verify, "verify", hashed)
    monkeypatch.setattr(offline, "build_model", hashed)
    run_dir, task = run
    step = str(run_dir / "checkpoints" / "step-1")
    cases = [
        (["--tasks", str(tmp_path / "no.jsonl")], "no.jsonl': no such file"),
        (["--tasks", str(tmp_path)], f"{tmp_path}': a directory, not a JSONL file"),
        (["--val-steps", "-1"], "--val-steps -1: must be >= 0"),
        (["--val-steps", "0", "--tasks", ""], "nothing to evaluate"),
    ]
    for extra, expected in cases:
        for where in (["--checkpoint", step], ["--runs", str(run_dir)]):
            assert eval_main([*where, "--device", "cpu", *extra]) == 2
            captured = capsys.readouterr()
            errors = [line for line in captured.err.splitlines() if line.startswith("error:")]
            assert len(errors) == 1 and expected in errors[0] and captured.out == "", (extra, captured)


def test_a_nested_checkpoint_folder_finds_its_run(tmp_path, capsys):
    """checkpoint.folder = "ckpt/main" is valid, but --checkpoint and the export looked for the run's config.toml two
    levels up only: eval stopped on 'no config.toml' and the export left the run config out. A config.toml further
    up that names another folder is not taken for the run's."""
    import shutil

    from titan_k3.checkpoint.export import main as export_main

    assert train_main([*FAST, "--job.dump_folder", str(tmp_path), "--job.name", "nest", "--training.steps", "1",
                       "--lr_scheduler.warmup_steps", "0", "--checkpoint.enable", "true",
                       "--checkpoint.folder", "ckpt/main"]) == 0
    step = tmp_path / "nest" / "ckpt" / "main" / "step-1"
    capsys.readouterr()
    assert eval_main(["--checkpoint", str(step), "--device", "cpu", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["val_tokens"] > 0
    assert export_main(["--checkpoint", str(step), "--out", str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "titan_k3_config.toml").is_file()

    stray = tmp_path / "stray" / "a" / "b" / "step-1"
    shutil.copytree(step, stray)
    shutil.copy(tmp_path / "nest" / "config.toml", tmp_path / "stray" / "config.toml")  # names ckpt/main, not a/b
    capsys.readouterr()
    assert eval_main(["--checkpoint", str(stray), "--device", "cpu"]) == 2
    assert f"run directory '{tmp_path / 'stray' / 'a'}': no config.toml" in capsys.readouterr().err


def test_a_table_that_cannot_be_written_is_said_before_the_evaluation_and_never_lost(run, capsys, monkeypatch):
    """--runs wrote RUN_DIR/eval_table.md after the whole evaluation and before printing: a path it could not write
    ended in a traceback and the evaluated table was lost."""
    import pathlib
    import shutil

    run_dir, _ = run
    table = run_dir / "eval_table.md"
    saved = table.read_bytes() if table.exists() else None
    table.unlink(missing_ok=True)
    table.mkdir()
    try:
        assert eval_main(["--runs", str(run_dir), "--val-steps", "1", "--device", "cpu"]) == 2
        captured = capsys.readouterr()
        assert captured.out == "" and captured.err.startswith(f"error: {table}: a directory")
    finally:
        shutil.rmtree(table)
        if saved is not None:
            table.write_bytes(saved)

    real = pathlib.Path.write_text

    def full_disk(self, *args, **kwargs):
        if self.name == "eval_table.md":
            raise OSError(28, "No space left on device")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "write_text", full_disk)
    assert eval_main(["--runs", str(run_dir), "--val-steps", "1", "--device", "cpu"]) == 1
    captured = capsys.readouterr()
    assert "| step | tokens | val_loss |" in captured.out
    assert "eval_table.md: not written (No space left on device); the table is printed above" in captured.err
