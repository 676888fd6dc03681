"""Sweeps: one-knob families (generated and hand-made), the guard, service submission, equal-token comparison."""

import json
import math
from pathlib import Path

import httpx
import pytest

from titan_k3.config import config_to_toml, load_job_config
from titan_k3.tools import sweep
from titan_k3.tools.sweep import FREE_KEYS, SweepError, check_family, flat_config, generate, load_member, main

BASE = """
[job]
description = "base"
[model]
flavor = "debug"
[training]
steps = 8
seq_len = 64
local_batch_size = 2
[lr_scheduler]
warmup_steps = 1
"""


@pytest.fixture
def base(tmp_path):
    path = tmp_path / "base.toml"
    path.write_text(BASE)
    return path


def _differing(members):
    flats = [flat_config(m.cfg) for m in members]
    return {k for k in flats[0] if k not in FREE_KEYS and len({repr(f[k]) for f in flats}) > 1}


def test_generated_family_validates_and_differs_only_in_the_knob(base, tmp_path, capsys):
    out = tmp_path / "family"
    assert main(["--base", str(base), "--knob", "optimizer.lr", "--values", "1e-3,3e-3,1e-2", "--out", str(out)]) == 0
    files = sorted(out.glob("*.toml"))
    assert [f.name for f in files] == ["base-lr-1e-2.toml", "base-lr-1e-3.toml", "base-lr-3e-3.toml"]
    members = [load_member(f) for f in files]  # each one loads and validates as a trainer config
    assert _differing(members) == {"optimizer.lr"}
    assert sorted(m.cfg.optimizer.lr for m in members) == [1e-3, 3e-3, 1e-2]
    assert len({m.cfg.job.name for m in members}) == 3
    assert check_family(members) == "optimizer.lr"
    assert "sweep over optimizer.lr: 3 configs" in capsys.readouterr().out


@pytest.mark.parametrize("knob, values, steps", [
    ("training.seq_len", ["64", "128", "256"], [8, 4, 2]),
    ("training.local_batch_size", ["1", "2", "4"], [16, 8, 4]),
])
def test_batch_and_seq_knobs_keep_the_token_budget_by_adjusting_steps(base, knob, values, steps):
    members = generate(base, knob, values)
    assert [m.cfg.training.steps for m in members] == steps
    assert {sweep.token_budget(m.cfg) for m in members} == {8 * 64 * 2}
    assert _differing(members) == {knob, "training.steps"}
    assert "training.steps = " in members[0].cfg.job.description and "keeps the token budget" in members[0].cfg.job.description


def test_generation_refuses_values_without_a_whole_number_of_steps(base):
    with pytest.raises(SweepError, match="training.local_batch_size = 3 gives 192 tokens per update, which does not divide"):
        generate(base, "training.local_batch_size", ["2", "3"])
    with pytest.raises(SweepError, match="expected one of optimizer.lr, training.local_batch_size"):
        generate(base, "model.flavor", ["debug", "tiny"])
    with pytest.raises(SweepError, match="'optimizer.lr'"):
        generate(base, "optimizer.lr", ["1e-3", "-1"])


def _write_config(tmp_path, name, *overrides):
    path = tmp_path / f"{name}.toml"
    path.write_text(config_to_toml(load_job_config(["--model.flavor", "debug", "--job.name", name, *overrides])))
    return path


def test_guard_rejects_a_config_differing_in_two_knobs(tmp_path, capsys):
    a = _write_config(tmp_path, "a", "--optimizer.lr", "1e-3")
    b = _write_config(tmp_path, "b", "--optimizer.lr", "1e-2", "--training.seq_len", "256")
    assert main(["--configs", str(a), str(b)]) == 2
    assert main(["--configs", str(a), str(b), "--knob", "optimizer.lr"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2
    for line in lines:
        assert line.startswith("error: configs differ in optimizer.lr and training.seq_len")
    assert "a.toml 128 vs" in lines[1] and "b.toml 256" in lines[1]


def test_guard_rejects_non_knob_differences_and_accepts_a_clean_family(tmp_path):
    a = load_member(_write_config(tmp_path, "a", "--optimizer.lr", "1e-3"))
    b = load_member(_write_config(tmp_path, "b", "--optimizer.lr", "1e-2", "--training.seed", "5"))
    with pytest.raises(SweepError, match=r"configs differ in optimizer.lr and training.seed \(training.seed: .*a.toml 0 vs"):
        check_family([a, b])
    c = load_member(_write_config(tmp_path, "c", "--optimizer.lr", "1e-2", "--job.description", "other words"))
    assert check_family([a, c]) == "optimizer.lr"
    same_name = load_member(_write_config(tmp_path, "d", "--optimizer.lr", "3e-3", "--job.name", "a"))
    with pytest.raises(SweepError, match="share the run name 'a'"):
        check_family([a, same_name])
    longer = load_member(_write_config(tmp_path, "e", "--optimizer.lr", "3e-3", "--training.steps", "40"))
    with pytest.raises(SweepError, match="optimizer.lr and training.steps"):
        check_family([a, longer], "optimizer.lr")
    more_tokens = load_member(_write_config(tmp_path, "f", "--optimizer.lr", "1e-3", "--training.seq_len", "256"))
    with pytest.raises(SweepError, match="token budgets .* differ"):
        check_family([a, more_tokens], "training.seq_len")


def test_submission_posts_inline_toml_the_service_accepts(base, monkeypatch):
    from service.schemas import RunCreate

    members = generate(base, "optimizer.lr", ["1e-3", "1e-2"])
    sent = []

    def fake_post(url, json, headers, timeout):
        sent.append((url, json, headers))
        RunCreate(**json)  # the service's own request schema
        load_job_config(["--job.name", json["name"]], toml_text=json["toml"])  # what the service runs
        if json["name"].endswith("1e-2"):
            return httpx.Response(422, json={"detail": "config key 'x' bad"})
        return httpx.Response(201, json={"id": json["name"], "state": "queued"})

    monkeypatch.setattr(httpx, "post", fake_post)
    with pytest.raises(SweepError, match=r"run 'base-lr-1e-2' refused \(422\): config key 'x' bad"):
        sweep.submit(members, "http://svc:8080/", "T0K", gpus=1, nproc_per_node=1)
    assert [s[0] for s in sent] == ["http://svc:8080/v1/runs"] * 2
    assert sent[0][2] == {"Authorization": "Bearer T0K"}
    assert sent[0][1]["name"] == "base-lr-1e-3" and sent[0][1]["gpus"] == 1


# ---------------------------------------------------------------------- compare
def _run_dir(root, name, lr, records, events=(), *extra):
    d = root / name
    d.mkdir()
    cfg = load_job_config(["--model.flavor", "debug", "--job.name", name, "--optimizer.lr", str(lr), *extra])
    (d / "config.toml").write_text(config_to_toml(cfg))
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (d / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    return d


def _rec(step, loss, grad_norm=1.0, skipped=0, **kw):
    return {"step": step, "loss": loss, "tokens_seen": 100 * step, "grad_norm": grad_norm, "skipped_updates": skipped, **kw}


@pytest.fixture
def two_runs(tmp_path):
    # a: logged at odd steps to 900 tokens; a grad-norm spike and a non-finite update at step 7, another at step 9.
    a = _run_dir(tmp_path, "a", 1e-3,
                 [_rec(s, 10 - 0.1 * s, 5.0 if s == 7 else 1.0, int(s >= 7)) for s in (1, 3, 5, 7, 9)],
                 [{"step": 0, "kind": "kernel_report"}, {"step": 7, "kind": "nonfinite"}, {"step": 9, "kind": "nonfinite"}])
    # b: every step to 800 tokens, with a validation loss at step 8.
    b = _run_dir(tmp_path, "b", 1e-2, [_rec(s, 9 - 0.2 * s, **({"val_loss": 7.7} if s == 8 else {})) for s in range(1, 9)])
    return a, b


def test_compare_at_the_common_token_budget(two_runs):
    runs = [sweep.load_run(d) for d in two_runs]
    budget, knob, differing, rows = sweep.compare_runs(runs, window=0.25)
    assert (budget, knob, differing) == (800, "optimizer.lr", ["optimizer.lr"])
    a, b = rows
    assert a.steps_at_budget == pytest.approx(8) and b.steps_at_budget == pytest.approx(8)
    assert a.loss_at_budget == pytest.approx(9.2)  # halfway between step 7 (9.3) and step 9 (9.1)
    assert (a.window_mean, a.window_records) == (pytest.approx(9.3), 1)  # only step 7 lies in (600, 800]
    assert b.loss_at_budget == pytest.approx(7.4)
    assert b.window_mean == pytest.approx(7.5) and b.window_std == pytest.approx(0.1 * math.sqrt(2))
    assert (a.spikes, a.skipped, a.nonfinite) == ([7], 1, 1)  # the step-9 event lies past the budget
    assert (b.spikes, b.skipped, b.nonfinite, b.val_loss) == ([], 0, 0, 7.7)
    assert math.isnan(a.val_loss)


def test_compare_report_table_and_limits(two_runs, tmp_path, capsys):
    out = tmp_path / "report.md"
    assert main(["--compare", *map(str, two_runs), "--window", "0.25", "--report", str(out)]) == 0
    text = out.read_text()
    assert text == capsys.readouterr().out.split("report written to")[0]
    assert "Compared at **800 tokens**, the largest count every run reached (`b` stops there)" in text
    assert "| `a` | 0.001 | 8 | 9.2000 | 9.3000 ± n/a (1) | n/a | 1 (steps 7) | 1 | 1 |" in text
    assert "| `b` | 0.01 | 8 | 7.4000 | 7.5000 ± 0.1414 (2) | 7.7000 | 0 | 0 | 0 |" in text
    assert "Lowest window-mean loss: `b` (7.5000), ahead of `a` by 1.8000 nats" in text
    # same seed and data: the reading is the paired difference, here from the one update both logged (step 7)
    assert "1.7000 ± n/a over the 1 updates both logged in the window; the gap is **not** consistent" in text
    assert "Instability up to the budget: `a`" in text
    assert "## What this comparison can and cannot conclude" in text
    for phrase in ("one seed", "equal tokens is not equal compute", "predict the ranking later in training"):
        assert phrase in text


def test_compare_says_when_runs_differ_in_more_than_the_knob(two_runs, tmp_path):
    c = _run_dir(tmp_path, "c", 3e-3, [_rec(s, 8.0) for s in range(1, 9)], (), "--training.seed", "3")
    text = sweep.report([sweep.load_run(d) for d in (*two_runs, c)])
    assert "attribute a difference to one knob: the runs differ in optimizer.lr, training.seed" in text
    assert "a different seed per run" in text


def test_compare_refuses_what_it_cannot_read(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main(["--compare", str(tmp_path / "empty"), str(tmp_path / "empty")]) == 2
    assert "no metrics.jsonl (is it a titan_k3 run directory?)" in capsys.readouterr().err


def test_compare_refuses_run_files_the_trainer_does_not_write_in_one_line(two_runs, tmp_path, capsys):
    """Each was a traceback (a null loss, a line that is no object, an event without a kind, a folder for
    metrics.jsonl) or dropped records without a loss silently; a missing directory was called one without records."""
    a, b = two_runs
    good = (b / "metrics.jsonl").read_text()

    def error(run, text=None, events=None):
        if text is not None:
            (run / "metrics.jsonl").write_text(text)
        if events is not None:
            (run / "events.jsonl").write_text(events)
        assert main(["--compare", str(a), str(run), "--report", str(tmp_path / "r.md")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: "), err
        assert not (tmp_path / "r.md").exists()
        return err[0]

    assert error(tmp_path / "missing") == f"error: run '{tmp_path}/missing': no such directory"
    no_loss = json.dumps({k: v for k, v in _rec(9, 1.0).items() if k != "loss"})
    assert error(b, good + no_loss + "\n") == (f"error: {b}/metrics.jsonl:9: record without a number for 'loss' (the "
                                             "trainer writes each in every record)")
    assert error(b, good + json.dumps(_rec(9, None)) + "\n").startswith(f"error: {b}/metrics.jsonl:9: record without")
    assert error(b, good + "5\n") == f"error: {b}/metrics.jsonl:9: not a JSON object"
    assert error(b, good + json.dumps(_rec(9, 1.0, val_loss="7.7")) + "\n") == (
        f"error: {b}/metrics.jsonl:9: 'val_loss' = '7.7', not a number (the trainer writes no such record)")
    assert error(b, good, '{"step": 3}\n') == (f"error: {b}/events.jsonl: event 1 is not an object with a 'kind' (the "
                                               "trainer writes no such line)")
    assert error(b, events='{"step": "3", "kind": "nonfinite"}\n').startswith(f"error: {b}/events.jsonl: event 1: 'step'")
    (b / "events.jsonl").write_text("")
    (b / "metrics.jsonl").unlink()
    (b / "metrics.jsonl").mkdir()
    assert error(b) == f"error: {b}/metrics.jsonl: cannot read it (Is a directory)"


def test_compare_refuses_a_run_whose_first_record_is_past_the_common_budget(two_runs, tmp_path, capsys):
    """A run logged less often than another had gone (one still early, or logging every 100 updates) ended in an
    IndexError."""
    a, _ = two_runs
    early = _run_dir(tmp_path, "early", 1e-2, [_rec(s, 9.0) for s in (1, 2)])
    assert main(["--compare", str(a), str(early), "--report", str(tmp_path / "r.md")]) == 0
    capsys.readouterr()
    (early / "metrics.jsonl").write_text(json.dumps(dict(_rec(1, 9.0), tokens_seen=50)) + "\n")
    assert main(["--compare", str(a), str(early), "--report", str(tmp_path / "r.md")]) == 2
    assert capsys.readouterr().err == (
        "error: --compare: run 'a' logged its first record at 100 tokens, past the 50 that 'early' reached: nothing of "
        "it to compare at that budget (compare once that run has gone further)\n")


class _FakeTrainer:
    """Stands in for `python -m titan_k3.train`: writes a finished run directory, exits with `status`."""

    calls: list[tuple[list[str], str | None]] = []

    def __init__(self, cmd, env=None, *, root: Path, status: int = 0):
        self.calls.append((cmd, (env or {}).get("CUDA_VISIBLE_DEVICES")))
        name = cmd[cmd.index("--job.name") + 1]
        lr = load_job_config(["--job.config_file", cmd[cmd.index("--job.config_file") + 1]]).optimizer.lr
        _run_dir(root, name, lr, [_rec(s, 9 - lr * s) for s in range(1, 9)])
        self.returncode = status

    def poll(self):
        return self.returncode


@pytest.mark.parametrize("parallel", [1, 2])
def test_local_run_trains_each_config_then_compares_with_a_plot(base, tmp_path, monkeypatch, parallel):
    _FakeTrainer.calls = []
    (tmp_path / "runs").mkdir()
    monkeypatch.setattr(sweep.subprocess, "Popen", lambda cmd, env=None: _FakeTrainer(cmd, env, root=tmp_path / "runs"))
    out = tmp_path / "family"
    assert main(["--base", str(base), "--knob", "optimizer.lr", "--values", "1e-3,1e-2,3e-2", "--out", str(out), "--run",
                 "--parallel", str(parallel), "--dump-folder", str(tmp_path / "runs")]) == 0
    cmds = [c for c, _ in _FakeTrainer.calls]
    assert [c[1:4] for c in cmds] == [["-m", "titan_k3.train", "--job.config_file"]] * 3
    assert [c[c.index("--job.name") + 1] for c in cmds] == ["base-lr-1e-3", "base-lr-1e-2", "base-lr-3e-2"]
    # one run per GPU slot when parallel; no pinning when running one at a time
    assert [gpu for _, gpu in _FakeTrainer.calls] == (["0", "1", "0"] if parallel == 2 else [None] * 3)
    text = (out / "compare.md").read_text()
    assert "# Sweep comparison: optimizer.lr" in text and "| `base-lr-1e-2` | 0.01 |" in text
    assert "![loss against tokens](compare.png)" in text
    assert (out / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_local_run_reports_a_failed_run(base, tmp_path, monkeypatch, capsys):
    _FakeTrainer.calls = []
    (tmp_path / "runs").mkdir()
    monkeypatch.setattr(sweep.subprocess, "Popen", lambda cmd, env=None: _FakeTrainer(
        cmd, env, root=tmp_path / "runs", status=1 if "base-lr-1e-2" in cmd else 0))
    assert main(["--base", str(base), "--knob", "optimizer.lr", "--values", "1e-3,1e-2", "--out", str(tmp_path / "f"),
                 "--run", "--dump-folder", str(tmp_path / "runs")]) == 1
    assert "error: runs failed: base-lr-1e-2 (status 1)" in capsys.readouterr().err


def test_a_run_that_failed_before_the_others_first_record_is_reported_as_failed(base, tmp_path, monkeypatch, capsys):
    """The comparison's refusal of a run that stopped early (here: before the others' first record) was the only line,
    and the failed run went unnamed."""
    class Early(_FakeTrainer):
        def __init__(self, cmd, env=None, *, root):
            super().__init__(cmd, env, root=root, status=1 if "base-lr-1e-2" in cmd else 0)
            if self.returncode:
                name = cmd[cmd.index("--job.name") + 1]
                (root / name / "metrics.jsonl").write_text(json.dumps(dict(_rec(1, 9.0), tokens_seen=50)) + "\n")

    (tmp_path / "runs").mkdir()
    monkeypatch.setattr(sweep.subprocess, "Popen", lambda cmd, env=None: Early(cmd, env, root=tmp_path / "runs"))
    assert main(["--base", str(base), "--knob", "optimizer.lr", "--values", "1e-3,1e-2", "--out", str(tmp_path / "f"),
                 "--run", "--dump-folder", str(tmp_path / "runs")]) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("error: runs failed: base-lr-1e-2 (status 1); the others are not "
                                               "compared: --compare: run 'base-lr-1e-3' logged its first record"), err


def test_paired_reading_sees_a_consistent_gap_that_the_spread_hides(tmp_path):
    """Both runs read the same batches: the loss swings by ±1 from batch to batch, the difference stays 0.1."""
    swing = [((-1) ** s) * 1.0 for s in range(1, 21)]
    a = _run_dir(tmp_path, "a", 1e-3, [_rec(s, 5 + w) for s, w in zip(range(1, 21), swing)])
    b = _run_dir(tmp_path, "b", 3e-3, [_rec(s, 5.1 + w + 0.01 * (s % 3)) for s, w in zip(range(1, 21), swing)])
    text = sweep.report([sweep.load_run(a), sweep.load_run(b)], window=0.5)
    assert "ahead of `b` by" in text and "the gap is consistent (its mean exceeds twice its spread)." in text
    # another seed: batches differ, so only the within-window spread is available, and it swamps the gap
    c = _run_dir(tmp_path, "c", 3e-3, [_rec(s, 5.1 + w) for s, w in zip(range(1, 21), swing)], (), "--training.seed", "3")
    text = sweep.report([sweep.load_run(a), sweep.load_run(c)], window=0.5)
    assert "both read the same batches" not in text and "within the noise of one seed" in text


@pytest.mark.parametrize("knob", ["kernels.loss_grad_fp8", "kernels.loss_one_pass"])
def test_a_true_or_false_knob_is_written_as_toml_writes_it(base, tmp_path, capsys, knob):
    """kernels.loss_grad_fp8's values showed as Python's False / True in the listing and each job.description."""
    out = tmp_path / "family"
    assert main(["--base", str(base), "--knob", knob, "--values", "false,true", "--out", str(out)]) == 0
    listing = capsys.readouterr().out
    assert f"{knob} = false," in listing and f"{knob} = true," in listing
    assert "True" not in listing and "False" not in listing
    descriptions = sorted(load_member(f).cfg.job.description for f in out.glob("*.toml"))
    assert [d.split(": ", 1)[1] for d in descriptions] == [f"{knob} = false", f"{knob} = true"]


def test_a_hand_made_config_naming_another_file_is_refused_as_the_trainer_refuses_it(tmp_path, capsys):
    """The check accepted it and every run it launched was then refused at its start (a TOML cannot name a file)."""
    a = _write_config(tmp_path, "a", "--optimizer.lr", "1e-3")
    b = _write_config(tmp_path, "b", "--optimizer.lr", "1e-2")
    b.write_text(b.read_text().replace('config_file = ""', 'config_file = "tomls/smoke.toml"'))
    assert main(["--configs", str(a), str(b)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {b}: config key 'job.config_file' = "
                                               "'tomls/smoke.toml': a config file cannot name another"), err


def test_a_members_error_names_its_file_once(tmp_path):
    """It read "config 'a.toml': <inline TOML>: config key ..."."""
    path = tmp_path / "a.toml"
    path.write_text("[training]\nsteps = 'many'\n")
    with pytest.raises(SweepError) as e:
        load_member(path)
    assert str(e.value) == f"{path}: config key 'training.steps' = 'many': expected an integer"


def test_bad_arguments_stop_with_one_line_before_any_work(base, tmp_path, two_runs, capsys, monkeypatch):
    """--parallel 0 waited forever for runs it never started; an --out or --report it cannot write ended in a
    traceback; a run given twice was compared with itself; two --values of the same number said the configs "do not
    differ in the declared knob"."""
    monkeypatch.setattr(sweep.subprocess, "Popen", lambda *a, **k: pytest.fail("a run was started"))
    a, b = two_runs
    latin1 = tmp_path / "latin1.toml"
    latin1.write_bytes(b'[job]\nname = "caf\xe9"\n')
    for argv, expected in [
        (["--base", str(base), "--knob", "optimizer.lr", "--values", "1e-3,2e-3", "--run", "--parallel", "0"],
         "error: --parallel=0: must be >= 1"),
        (["--base", str(base), "--knob", "optimizer.lr", "--values", "1e-3,2e-3", "--service", "http://h", "--token",
          "t", "--gpus", "-1"], "error: --gpus=-1: must be >= 0"),
        (["--base", str(base), "--knob", "optimizer.lr", "--values", "1e-3,0.001,2e-3"],
         "error: --values 1e-3 and 0.001: the same optimizer.lr (0.001) twice"),
        (["--base", str(base), "--knob", "optimizer.lr", "--values", "1e-3,2e-3", "--out", str(base / "x")],
         f"error: --out '{base}/x': cannot write the configs there ("),
        (["--compare", str(a), str(b), "--report", str(base / "r.md")], f"error: --report '{base}/r.md': cannot write"),
        (["--compare", str(a), str(a.parent / ".." / a.parent.name / a.name)],
         f"error: --compare: run '{a.parent}/../{a.parent.name}/{a.name}' is given twice (as '{a}')"),
        # a config file that is not UTF-8 was a UnicodeDecodeError traceback, as --base and in --configs
        (["--base", str(latin1), "--knob", "optimizer.lr", "--values", "1e-3,2e-3"],
         f"error: config '{latin1}': not UTF-8 text (byte 17: invalid continuation byte)"),
        (["--configs", str(base), str(latin1)], f"error: config '{latin1}': not UTF-8 text (byte 17: invalid continuation byte)"),
    ]:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(expected), (argv, err)
