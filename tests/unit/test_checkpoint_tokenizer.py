"""A weights-only load (checkpoint.initial_load_path) checks the tokenizer the weights were trained with.

Token ids mean nothing without their tokenizer: weights of another tokenizer of
the same vocabulary size load without any shape mismatch. meta.json (and an
export's config.json) records the tokenizer's name and sha256; a different one
stops the start with one line naming both; a checkpoint saved before the record
loads, with one `tokenizer_unchecked` event saying so. One process, CPU.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace

import pytest

from test_checkpoint_manager import Run, _events
from titan_k3.checkpoint import layout, verify
from titan_k3.checkpoint.export import export_checkpoint
from titan_k3.checkpoint.resume import check_resumable
from titan_k3.data.tokenizer import file_sha256, tokenizer_identity
from titan_k3.models.k3.args import get_flavor


def _tokenizer_file(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def _source(folder: Path, tokenizer: Path | None) -> Path:
    """One saved update of the debug model; meta.json records `tokenizer` as the trainer's would (None: not at all)."""
    run = Run(folder, save_on_stop=False)
    run.manager.meta = {"flavor": "debug", "model_args": asdict(get_flavor("debug", 512)), "qb_eta": 1.0}
    if tokenizer is not None:
        run.manager.meta.update(tokenizer=tokenizer.name, tokenizer_sha256=file_sha256(tokenizer))
    run.update(1)
    run.manager.save(1)
    run.close()
    return folder / "checkpoints" / "step-1"


def _cfg(initial: Path, tokenizer: Path) -> SimpleNamespace:
    ckpt = SimpleNamespace(enable=False, save_on_stop=False, folder="checkpoints", load_step=-1,
                           initial_load_path=str(initial))
    return SimpleNamespace(checkpoint=ckpt, data=SimpleNamespace(tokenizer=str(tokenizer)))


def test_identity_is_the_loaded_tokenizers():
    from titan_k3.data.tokenizer import load_tokenizer

    tok = load_tokenizer("embedded")
    assert tokenizer_identity("embedded") == (tok.name, tok.sha256)


def test_weights_of_another_tokenizer_stop_with_one_line_naming_both(tmp_path):
    mine = _tokenizer_file(tmp_path / "mine.json", '{"a": 1}')
    theirs = _tokenizer_file(tmp_path / "theirs.json", '{"a": 2}')
    step = _source(tmp_path / "src", theirs)
    export = tmp_path / "export"
    export_checkpoint(step, export)
    assert json.loads((export / "config.json").read_text())[layout.TOKENIZER_KEY] == {
        "name": "theirs.json", "sha256": file_sha256(theirs)}
    dst = Run(tmp_path / "dst")
    for source in (step, step.parent, export):
        with pytest.raises(ValueError) as e:
            check_resumable(_cfg(source, mine), tmp_path / "dst", dst.model, dst.optimizers)
        line = str(e.value)
        assert "\n" not in line and "'theirs.json' (sha256 " + file_sha256(theirs)[:12] in line
        assert "'mine.json' (sha256 " + file_sha256(mine)[:12] in line
        # The same tokenizer loads, unannounced.
        plan = check_resumable(_cfg(source, theirs), tmp_path / "dst", dst.model, dst.optimizers)
        assert plan.initial and plan.tokenizer_unchecked == ""


def test_a_checkpoint_without_the_record_loads_and_says_so(tmp_path):
    mine = _tokenizer_file(tmp_path / "mine.json", '{"a": 1}')
    step = _source(tmp_path / "src", None)
    meta = json.loads((step / layout.META_FILE).read_text())
    meta["tokenizer"] = "old.json"  # what checkpoints recorded before the hash: the name alone
    (step / layout.META_FILE).write_text(json.dumps(meta))
    verify.seal(step, None)
    dst = Run(tmp_path / "dst", enable=False, initial_load_path=str(step))
    plan = check_resumable(_cfg(step, mine), tmp_path / "dst", dst.model, dst.optimizers)
    assert "'old.json'" in plan.tokenizer_unchecked and "could not be checked" in plan.tokenizer_unchecked
    assert dst.manager.load(plan) is None
    unchecked = [e for e in _events(tmp_path / "dst") if e["kind"] == "tokenizer_unchecked"]
    assert len(unchecked) == 1 and "\n" not in unchecked[0]["message"] and "mine.json" in unchecked[0]["message"]
    assert [e["kind"] for e in _events(tmp_path / "dst")][-1] == "initial_load"


def test_the_trainer_records_its_tokenizer_and_a_weights_only_start_checks_it(tmp_path):
    from titan_k3.train import main

    args = ["--model.flavor", "debug", "--training.seq_len", "64", "--metrics.log_freq", "1", "--training.steps", "1",
            "--job.dump_folder", str(tmp_path)]
    assert main([*args, "--job.name", "a", "--checkpoint.enable", "true"]) == 0
    step = tmp_path / "a" / "checkpoints" / "step-1"
    meta = json.loads((step / layout.META_FILE).read_text())
    assert (meta["tokenizer"], meta["tokenizer_sha256"]) == tokenizer_identity("embedded")
    assert main([*args, "--job.name", "b", "--checkpoint.initial_load_path", str(step)]) == 0
    kinds = [e["kind"] for e in _events(tmp_path / "b")]
    assert "initial_load" in kinds and "tokenizer_unchecked" not in kinds
