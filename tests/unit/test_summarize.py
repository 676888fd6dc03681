"""The summarizer's arithmetic on hand-written records: time-weighted windows, warm-up, restarts, probes."""

import json
import math

import pytest

from titan_k3.tools.summarize import checked_updates, main, probe_of, steady_state, summarize


def _rec(step, tokens, train_s, session_s, loss=2.0, **kw):
    return {"step": step, "tokens_seen": tokens, "training_seconds": train_s, "session_seconds": session_s, "loss": loss,
            "lr": 1e-3, "grad_norm": 1.0, "skipped_updates": 0, "tokens_per_second_training": 0.0,
            "tokens_per_second_session": 0.0, "mfu": kw.pop("mfu", 0.0), **kw}


RECORDS = [
    _rec(10, 1000, 50.0, 60.0, mfu=0.01),   # window 0 -> 10 holds a slow first step (compile, autotune)
    _rec(20, 2000, 60.0, 75.0, mfu=0.05),   # 10 -> 20: 1000 tokens in 10 s
    _rec(30, 3000, 80.0, 100.0, mfu=0.025),  # 20 -> 30: 1000 tokens in 20 s
    _rec(40, 4000, 90.0, 120.0, mfu=0.05),  # 30 -> 40: 1000 tokens in 10 s
]


def test_steady_rate_is_time_weighted_over_windows_after_warmup():
    steady = steady_state(RECORDS, warmup_step=10)
    assert steady.windows == 3
    assert steady.tokens_per_second == pytest.approx(3000 / 40)  # not the mean of the rates (83.3)
    assert steady.mfu == pytest.approx((0.05 * 10 + 0.025 * 20 + 0.05 * 10) / 40)
    assert steady_state(RECORDS, warmup_step=0).tokens_per_second == pytest.approx(4000 / 90)
    assert steady_state(RECORDS, warmup_step=15).windows == 2  # the window starting at 10 is excluded
    assert steady.rates == pytest.approx((100, 50, 100)) and steady.spread == pytest.approx((50, 100, 100))
    assert steady_state(RECORDS, warmup_step=15).spread == pytest.approx((50, 75, 100))  # even count: mean of two
    assert all(math.isnan(x) for x in steady_state(RECORDS, warmup_step=99).spread)


def test_a_restart_opens_no_window_across_it():
    resumed = RECORDS[:2] + [_rec(30, 3000, 5.0, 8.0), _rec(40, 4000, 15.0, 20.0)]  # clocks restart after step 20
    steady = steady_state(resumed, warmup_step=10)
    assert steady.windows == 2
    assert steady.tokens_per_second == pytest.approx(2000 / 20)


def _run_dir(tmp_path, description, records):
    (tmp_path / "config.toml").write_text(f'[job]\ndescription = "{description}"\n[training]\nsteps = 40\n')
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (tmp_path / "events.jsonl").write_text(json.dumps({"kind": "invariant_violation", "step": 5}) + "\n")
    return tmp_path


def test_overfit_probe_answer_and_markdown(tmp_path):
    records = [dict(r, loss=10.0 / (1 + i * 100)) for i, r in enumerate(RECORDS)]
    text, numbers = summarize(_run_dir(tmp_path, "overfit: memorise one repeated batch", records), warmup_step=10)
    assert numbers["probe"] == "overfit"
    assert "**Answer:** yes" in text
    assert numbers["events"] == {"invariant_violation": 1}
    assert numbers["tokens_per_second_session"] == pytest.approx(4000 / 120)
    assert numbers["loss_start"] == 10.0
    assert "| loss at update 10 (first logged) -> 40 | 10.0000 -> " in text


def test_overfit_probe_compares_with_the_first_update_not_the_first_logged_one(tmp_path):
    """By its first log step (50 in tomls/overfit.toml) one repeated batch is memorised: comparing the last loss with
    that one answered 'no' (or a ratio of two near-zero losses) for a run that went from 9.4 to 1e-5."""
    losses = (8e-5, 2e-5, 1e-5, 8e-6)
    records = [dict(r, loss=x, session_first_step=1, session_first_loss=9.38) for r, x in zip(RECORDS, losses)]
    text, _ = summarize(_run_dir(tmp_path, "overfit: memorise one repeated batch", records))
    assert "**Answer:** yes: final loss is 0.00% of update 1's 9.3800 (target < 5%)" in text


def test_probe_from_description_or_recipe_name():
    assert probe_of({"job": {"description": "stability: successive batches"}}) == "stability"
    assert probe_of({"job": {"config_file": "tomls/pilot.toml"}}) == "throughput"
    assert probe_of({"job": {"description": "my experiment"}}) is None


def test_cli_errors_are_one_line(tmp_path, capsys):
    assert main([str(tmp_path)]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err
    assert main([str(tmp_path), "--warmup-step", "-1"]) == 2


def test_checked_updates_sum_over_sessions_and_zero_checks_are_not_called_clean(tmp_path):
    # Two sessions (the clocks restart after step 20), each counting its own checked updates from 0.
    counts = [0, 1, 1, 2]
    resumed = [dict(r, invariant_checked_updates=n) for r, n in
               zip(RECORDS[:2] + [_rec(30, 3000, 5.0, 8.0), _rec(40, 4000, 15.0, 20.0)], counts)]
    assert checked_updates(resumed) == 1 + 2
    assert checked_updates(RECORDS) is None  # records from before the count
    text, numbers = summarize(_run_dir(tmp_path, "smoke", resumed))
    assert numbers["invariant_checked_updates"] == 3
    assert "| invariant violations | unnamed: 1 in 3 checked updates |" in text
    none = [dict(r, invariant_checked_updates=0) for r in RECORDS]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in none))
    (tmp_path / "events.jsonl").write_text("")
    assert "| invariant violations | 0 (no update was checked) |" in summarize(tmp_path)[0]


def test_what_the_summary_cannot_read_or_write_is_one_line(tmp_path, capsys):
    """Each ended in a traceback: a config.toml that is not TOML (or named no file), a line that is not a trainer's
    record, an --out that cannot be written; a --warmup-step past every window gave a summary of nan."""
    run = _run_dir(tmp_path, "smoke", RECORDS)

    def error(*argv):
        assert main([str(run), *argv]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: "), err
        return err[0]

    assert error("--out", str(run / "metrics.jsonl")).startswith(f"error: --out '{run}/metrics.jsonl': cannot write")
    assert error("--warmup-step", "35") == ("error: --warmup-step=35: no logging window starts at or after it (the last "
                                            "starts at update 30: the run's steady rate would be nan)")
    (run / "config.toml").write_text("[job\n")
    assert error().startswith(f"error: {run}/config.toml: not valid TOML (")
    (run / "config.toml").write_bytes(b"[job]\nname = 'caf\xe9'\n")
    assert error() == f"error: {run}/config.toml: not UTF-8 text (byte 17: invalid continuation byte)"
    (run / "config.toml").write_text("")
    for line, expected in [("[1, 2]", "not a JSON object"),
                           ('{"step": 50}', "record without a number for 'tokens_seen', 'training_seconds'")]:
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS) + line + "\n")
        assert error().startswith(f"error: {run}/metrics.jsonl:5: {expected}")
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    (run / "events.jsonl").write_text('"text"\n')
    assert error() == f"error: {run}/events.jsonl: event 1 is not an object with a 'kind' (the trainer writes no such line)"


def test_a_run_directory_the_summary_cannot_read_is_one_line_before_anything_is_written(tmp_path, capsys):
    """Each ended in a traceback (a record without a key the plots read, after summary.md was written; a folder
    where a file should be; a file that is not UTF-8, named by no path) or in a line that did not say the
    directory was missing."""
    def error(run):
        assert main([str(run)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: "), err
        assert not (run / "summary").exists()
        return err[0]

    assert error(tmp_path / "missing") == f"error: run_dir='{tmp_path}/missing': no such directory"
    (tmp_path / "r").mkdir()
    run = _run_dir(tmp_path / "r", "smoke", RECORDS)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS[:3]) + json.dumps(
        {k: v for k, v in RECORDS[3].items() if k != "tokens_per_second_session"}) + "\n")
    assert error(run) == (f"error: {run}/metrics.jsonl:4: record without a number for 'tokens_per_second_session' "
                          "(the trainer writes each in every record)")
    (run / "metrics.jsonl").write_bytes(b"\xff\n")
    assert error(run) == f"error: {run}/metrics.jsonl: not UTF-8 text (byte 0: invalid start byte)"
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    for name in ("events.jsonl", "config.toml"):
        (run / name).unlink()
        (run / name).mkdir()
        assert error(run) == f"error: {run}/{name}: cannot read it (Is a directory)"
        (run / name).rmdir()
    (run / "metrics.jsonl").unlink()
    (run / "metrics.jsonl").mkdir()
    assert error(run) == f"error: {run}/metrics.jsonl: cannot read it (Is a directory)"


def test_a_run_being_written_is_summarised_and_plotted_from_one_reading(tmp_path, monkeypatch):
    """The plots re-read metrics.jsonl after the summary: a record the run appended in between was plotted beside a
    summary that did not count it."""
    from titan_k3.tools import summarize as summarize_module

    run = _run_dir(tmp_path, "smoke", RECORDS)
    plotted = []
    monkeypatch.setattr(summarize_module, "plot", lambda records, out: plotted.append(records))
    real = summarize_module.summarize

    def summarize_then_append(*args, **kwargs):
        result = real(*args, **kwargs)
        with open(run / "metrics.jsonl", "a") as f:
            f.write(json.dumps(_rec(50, 5000, 100.0, 130.0)) + "\n" + '{"step": 60, "cut short')
        return result

    monkeypatch.setattr(summarize_module, "summarize", summarize_then_append)
    assert main([str(run)]) == 0
    assert [r["step"] for r in plotted[0]] == [10, 20, 30, 40]
