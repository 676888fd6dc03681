"""python -m titan_k3.eval on an export directory scores what the checkpoint it came from scores, with the same
checks: damaged or partial exports and another tokenizer are one line naming the path, exit 2."""

import json
import shutil

import pytest

from titan_k3.checkpoint.export import CONFIG_FILE, EXPORT_KEY, main as export_main
from titan_k3.eval.offline import main as eval_main
from titan_k3.train import main as train_main

TINY = ["--model.flavor", "tiny", "--training.seq_len", "64", "--training.device", "cpu", "--metrics.log_freq", "1",
        "--eval.steps", "1", "--eval.batch_size", "2"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A 2-update tiny run checkpointed at its last update, exported in float32 and in bf16."""
    root = tmp_path_factory.mktemp("runs")
    task = root / "toy.jsonl"
    task.write_text("\n".join(json.dumps(r) for r in [
        {"context": "The cat sat on the", "choices": [" mat", " mountains of the moon"], "gold": 0},
        {"context": "One, two,", "choices": [" three", " green"], "gold": 1},
        {"context": "def f(x):\n    return", "choices": [" x", " the"], "gold": 0},
    ]) + "\n")
    assert train_main([*TINY, "--job.dump_folder", str(root), "--job.name", "ex", "--training.steps", "2",
                       "--lr_scheduler.warmup_steps", "1", "--eval.tasks", str(task),
                       "--checkpoint.enable", "true", "--checkpoint.interval", "2"]) == 0
    step = root / "ex" / "checkpoints" / "step-2"
    assert export_main(["--checkpoint", str(step), "--out", str(root / "f32"), "--dtype", "float32"]) == 0
    assert export_main(["--checkpoint", str(step), "--out", str(root / "bf16")]) == 0
    return root, step


def _eval(capsys, path, *extra) -> list[dict]:
    assert eval_main(["--checkpoint", str(path), "--device", "cpu", "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)


def _error(capsys, path, *extra) -> str:
    assert eval_main(["--checkpoint", str(path), "--device", "cpu", "--val-steps", "0", *extra]) == 2
    captured = capsys.readouterr()
    errors = [line for line in captured.err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and captured.out == "", captured
    return errors[0]


def test_an_export_scores_what_its_checkpoint_scores(run, capsys):
    root, step = run
    [want] = _eval(capsys, step)
    [got] = _eval(capsys, root / "f32")
    assert want["val_tokens"] > 0 and "eval/toy/acc" in want
    assert {k: v for k, v in got.items() if k != "checkpoint"} == {k: v for k, v in want.items() if k != "checkpoint"}
    assert got["checkpoint"] == str(root / "f32")
    [rounded] = _eval(capsys, root / "bf16")
    assert rounded["step"] == 2 and rounded["tokens"] == want["tokens"]
    assert rounded["val_loss"] == pytest.approx(want["val_loss"], abs=0.05)


def test_the_export_holds_what_its_evaluation_needs(run, tmp_path, capsys, monkeypatch):
    """Evaluated with its run directory gone and no tokenizer cache: the export alone suffices."""
    root, step = run
    [want] = _eval(capsys, step, "--val-steps", "0")
    copy = tmp_path / "ex"
    shutil.copytree(step.parent.parent, copy)
    assert export_main(["--checkpoint", str(copy / "checkpoints" / "step-2"), "--out", str(tmp_path / "out"),
                        "--dtype", "float32"]) == 0
    capsys.readouterr()
    config = json.loads((tmp_path / "out" / CONFIG_FILE).read_text())
    assert config["titan_k3_tokenizer"]["file"] == "tokenizer.json"
    assert config[EXPORT_KEY] == {"version": 2, "step": 2, "tokens_seen": want["tokens"],
                                  "run_config": "titan_k3_config.toml"}
    shutil.rmtree(copy)
    monkeypatch.setenv("TITAN_K3_CACHE", str(tmp_path / "empty-cache"))
    [got] = _eval(capsys, tmp_path / "out", "--val-steps", "0")
    assert got["eval/toy/acc"] == want["eval/toy/acc"] and got["eval/toy/acc_norm"] == want["eval/toy/acc_norm"]
    assert not (tmp_path / "empty-cache").exists()


@pytest.mark.parametrize("damage, expected", [
    ("no config.json", "is incomplete: no config.json"),
    ("flipped byte", "model-00001-of-00001.safetensors: bytes 0-"),
    ("no tokenizer", "tokenizer.json: missing"),
    ("no checksums", "checksums.json: missing"),
    ("config edited", "config.json: bytes 0-"),
])
def test_a_damaged_or_partial_export_is_one_line_naming_it(run, tmp_path, capsys, damage, expected):
    root, _ = run
    export = tmp_path / "exp"
    shutil.copytree(root / "f32", export)
    if damage == "no config.json":
        (export / "config.json").unlink()
    elif damage == "flipped byte":
        shard = export / "model-00001-of-00001.safetensors"
        raw = bytearray(shard.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        shard.write_bytes(bytes(raw))
    elif damage == "no tokenizer":
        (export / "tokenizer.json").unlink()
    elif damage == "no checksums":
        (export / "checksums.json").unlink()
    else:
        config = json.loads((export / CONFIG_FILE).read_text())
        (export / CONFIG_FILE).write_text(json.dumps({**config, "rms_norm_eps": 1e-3}, indent=2) + "\n")
    error = _error(capsys, export)
    assert str(export) in error and expected in error


def test_an_older_export_is_checked_against_the_default_tokenizer(run, tmp_path, capsys):
    """An export made before exports held their tokenizer and checksums: evaluated unverified with the defaults,
    its recorded tokenizer checked against data.tokenizer's."""
    root, step = run
    export = tmp_path / "old"
    shutil.copytree(root / "f32", export)
    for name in ("checksums.json", "tokenizer.json", "titan_k3_config.toml"):
        (export / name).unlink()
    config = json.loads((export / CONFIG_FILE).read_text())
    del config[EXPORT_KEY], config["titan_k3_tokenizer"]["file"]
    (export / CONFIG_FILE).write_text(json.dumps(config))
    assert eval_main(["--checkpoint", str(export), "--device", "cpu", "--val-steps", "0", "--tasks",
                      str(root / "toy.jsonl"), "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)[0]["step"] == 2
    assert "made before exports carried checksums: not verified" in captured.err

    config["titan_k3_tokenizer"]["sha256"] = "ab" * 32
    (export / CONFIG_FILE).write_text(json.dumps(config))
    error = _error(capsys, export, "--tasks", str(root / "toy.jsonl"))
    assert "trained with tokenizer" in error and "abababababab" in error and "data.tokenizer = 'embedded'" in error


def test_an_empty_dir_or_a_partial_export_is_named(run, tmp_path, capsys):
    root, _ = run
    assert "nor an export" in _error(capsys, tmp_path)
    partial = tmp_path / "partial"
    partial.mkdir()
    shutil.copy(root / "f32" / "model-00001-of-00001.safetensors", partial)
    assert "is incomplete: no config.json" in _error(capsys, partial)


def test_initial_load_path_refuses_a_damaged_export(run, tmp_path):
    """A weights-only start checked an export's shapes only: flipped weight bytes loaded without a word."""
    from types import SimpleNamespace

    from titan_k3.checkpoint.resume import plan_start

    root, _ = run
    export = tmp_path / "exp"
    shutil.copytree(root / "f32", export)
    c = SimpleNamespace(enable=False, save_on_stop=False, initial_load_path=str(export), load_step=-1)
    assert plan_start(c, tmp_path / "checkpoints").path == export
    shard = export / "model-00001-of-00001.safetensors"
    raw = bytearray(shard.read_bytes())
    raw[-7] ^= 0x01
    shard.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=r"initial_load_path' = '.*exp': damaged: .*safetensors: bytes 0-\d+ changed"):
        plan_start(c, tmp_path / "checkpoints")
    (export / CONFIG_FILE).unlink()
    with pytest.raises(ValueError, match=r"initial_load_path' = '.*exp': export .* is incomplete: no config.json"):
        plan_start(c, tmp_path / "checkpoints")


def test_a_second_export_into_the_dir_leaves_no_tokenizer_or_config_of_the_first(run, tmp_path, capsys):
    """A re-export whose checkpoint lies outside its run left the first export's tokenizer.json and run config
    beside it: tools reading tokenizer.json took another model's tokenizer."""
    root, step = run
    out = tmp_path / "out"
    assert export_main(["--checkpoint", str(step), "--out", str(out)]) == 0
    assert (out / "tokenizer.json").is_file() and (out / "titan_k3_config.toml").is_file()
    bare = tmp_path / "bare" / "checkpoints" / "step-2"
    shutil.copytree(step, bare)
    assert export_main(["--checkpoint", str(bare), "--out", str(out)]) == 0
    assert "the export holds no titan_k3_config.toml" in capsys.readouterr().err
    assert not (out / "tokenizer.json").exists() and not (out / "titan_k3_config.toml").exists()
