"""The summary of a resumed run: redone updates counted once (the later session's rows), no window across
sessions, the session rate of the last session alone."""

from __future__ import annotations

import json

import pytest

from titan_k3.tools.summarize import final_records, main, sessions, steady_state, summarize, windows


def _rec(step, session, session_tokens, train_s, session_s, loss=2.0):
    return {"step": step, "tokens_seen": 100 * step, "session_start": session, "session_tokens": session_tokens,
            "training_seconds": train_s, "session_seconds": session_s, "loss": loss, "lr": 1e-3, "grad_norm": 1.0,
            "skipped_updates": 0, "tokens_per_second_training": 0.0, "tokens_per_second_session": 0.0, "mfu": 0.0}


# Session A logged 10..40 and saved at 20; it died; session B resumed from step 20 and redid 30 and 40.
A = [_rec(10, 1.0, 1000, 50.0, 60.0), _rec(20, 1.0, 2000, 60.0, 75.0), _rec(30, 1.0, 3000, 70.0, 90.0, loss=9.0),
     _rec(40, 1.0, 4000, 80.0, 100.0, loss=9.0)]
B = [_rec(30, 2.0, 1000, 30.0, 40.0), _rec(40, 2.0, 2000, 40.0, 50.0), _rec(50, 2.0, 3000, 50.0, 60.0)]


def test_redone_updates_keep_the_later_session():
    kept, redone = final_records(A + B)
    assert [(r["step"], r["session_start"]) for r in kept] == [(10, 1.0), (20, 1.0), (30, 2.0), (40, 2.0), (50, 2.0)]
    assert redone == 2 and sessions(kept) == 2
    steps = [r["step"] for r in kept]
    assert steps == sorted(set(steps))  # a plot over them never runs backwards


def test_no_window_spans_two_sessions():
    kept, _ = final_records(A + B)
    assert [(p["step"], c["step"]) for p, c in windows(kept)] == [(0, 10), (10, 20), (30, 40), (40, 50)]
    # B's 30 -> 40 -> 50: 2000 tokens in 20 s; A's 0 -> 10 -> 20: 2000 tokens in 60 s
    assert steady_state(kept, warmup_step=0).tokens_per_second == pytest.approx(4000 / 80)


def test_summary_counts_each_update_once_and_the_last_session_rate(tmp_path):
    (tmp_path / "config.toml").write_text('[job]\ndescription = "stability: resumed"\n')
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in A + B))
    text, numbers = summarize(tmp_path)
    assert numbers["steps"] == 50 and numbers["tokens_seen"] == 5000
    assert numbers["tokens_per_second_session"] == pytest.approx(3000 / 60)  # B's own tokens over B's time
    assert numbers["sessions"] == 2 and numbers["redone_records"] == 2
    assert "| sessions (start + resumes) | 2 (2 logged records redone after a resume; the later ones kept) |" in text
    assert numbers["loss_end"] == 2.0
    assert main([str(tmp_path), "--out", str(tmp_path / "out")]) == 0
    assert (tmp_path / "out/throughput.png").is_file()
