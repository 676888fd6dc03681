"""The trainer end to end on one process: overfit probe, run directory, non-finite handling."""

import importlib.util
import json
import os

import pytest
import torch

from titan_k3.config import load_job_config
from titan_k3.train import Trainer, TrainingStopped, main

FAST = ["--model.flavor", "debug", "--training.seq_len", "64", "--metrics.log_freq", "1"]


def test_overfit_probe_memorises_its_batch(tmp_path):
    """A shortened tomls/overfit.toml: loss on the repeated batch falls below 5% of its start."""
    rc = main(["--job.config_file", "tomls/overfit.toml", *FAST, "--job.dump_folder", str(tmp_path), "--job.name", "of",
               "--training.steps", "30", "--optimizer.lr", "1e-2", "--lr_scheduler.warmup_steps", "3"])
    assert rc == 0
    losses = [json.loads(line)["loss"] for line in (tmp_path / "of" / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 30
    assert losses[-1] < 0.05 * losses[0]


def test_run_directory_holds_what_design_promises(tmp_path):
    assert main([*FAST, "--job.dump_folder", str(tmp_path), "--job.name", "r", "--training.steps", "3"]) == 0
    run = tmp_path / "r"
    assert {"config.toml", "manifest.json", "metrics.jsonl", "events.jsonl", "stdout.log"} <= {p.name for p in run.iterdir()}
    manifest = json.loads((run / "manifest.json").read_text())
    for key in ("git_commit", "versions", "hardware", "config_hash", "tokenizer", "dataset", "kernels"):
        assert key in manifest, key
    resolved = load_job_config(["--job.config_file", str(run / "config.toml")])
    assert resolved.model.flavor == "debug" and resolved.training.steps == 3
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(r["session_first_step"] == 1 and r["session_first_loss"] == records[0]["loss"] for r in records)
    assert records[-1]["tokens_seen"] == 3 * 64
    assert all(k in records[-1] for k in ("loss", "lr", "grad_norm", "tokens_per_second_training", "mfu", "moe/1/dead_fraction"))
    events = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
    assert any(e["kind"] == "kernel_report" for e in events)
    startup = [e for e in events if e["kind"] == "startup"]
    assert len(startup) == 1 and startup[0]["step"] == 1 and startup[0]["origin"] == "process start"
    assert startup[0]["seconds"] > 0 and startup[0]["build_seconds"] > 0 and startup[0]["first_update_seconds"] > 0
    assert startup[0]["build_seconds"] + startup[0]["first_update_seconds"] == pytest.approx(startup[0]["seconds"], abs=2e-3)
    assert "tokens per update = 1 batch x 64 seq x 1 accum x 1 dp = 64" in (run / "stdout.log").read_text()


def test_the_last_update_is_checked_whatever_the_interval_and_the_summary_counts_checks(tmp_path):
    """A run shorter than invariants.interval is still checked (at its last update), and the summary says how many
    updates were checked, so "0 violations" is never said of checks that did not run."""
    def log(name, steps, interval):
        assert main([*FAST, "--job.dump_folder", str(tmp_path), "--job.name", name, "--training.steps", str(steps),
                     "--invariants.interval", str(interval)]) == 0
        return (tmp_path / name / "stdout.log").read_text()

    short = log("short", 3, 50)
    assert "invariants at step 3:" in short
    assert "invariant violations: 0 in 1 checked update(s) (every 50 updates and the last)" in short
    both = log("both", 4, 2)  # the last update is on the interval: checked once
    assert "invariants at step 2:" in both and "invariants at step 4:" in both
    assert "invariant violations: 0 in 2 checked update(s) (every 2 updates and the last)" in both


def test_a_closed_trainer_gives_the_process_its_sigterm_handler_back(tmp_path):
    """Stepped from outside and closed without train() (a benchmark, a notebook): SIGTERM ends the process again."""
    import signal

    before = signal.getsignal(signal.SIGTERM)
    trainer = Trainer(load_job_config([*FAST, "--job.dump_folder", str(tmp_path), "--training.steps", "2"]))
    try:
        assert signal.getsignal(signal.SIGTERM) is not before  # the checkpointer's graceful stop, while it lives
        trainer.train_step()
    finally:
        trainer.close()
    assert signal.getsignal(signal.SIGTERM) is before


def test_strict_refuses_fallbacks_before_creating_anything(tmp_path, capsys):
    rc = main([*FAST, "--job.dump_folder", str(tmp_path), "--job.strict", "true"])
    assert rc == 2
    assert "job.strict = true and kda falls back" in capsys.readouterr().err
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


def test_non_finite_updates_are_skipped_counted_and_stop_the_run(tmp_path):
    cfg = load_job_config([*FAST, "--job.dump_folder", str(tmp_path), "--job.name", "nan",
                           "--training.steps", "10", "--training.max_skipped_in_row", "3"])
    trainer = Trainer(cfg)
    with torch.no_grad():
        trainer.model.output.weight[0, 0] = float("nan")
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    try:
        with pytest.raises(TrainingStopped, match="3 updates in a row had a non-finite loss"):
            trainer.train()
    finally:
        trainer.close()
    assert trainer.skipped_updates == 3
    for n, p in trainer.model.named_parameters():
        torch.testing.assert_close(p, before[n], equal_nan=True, rtol=0, atol=0, msg=n)
    kinds = [json.loads(x)["kind"] for x in (tmp_path / "nan" / "events.jsonl").read_text().splitlines()]
    assert kinds.count("nonfinite") == 3 and "stopped" in kinds


def test_context_stages_switch_length_and_keep_every_token(tmp_path):
    """docs/k3.md §8: from update 3 on, sequences of 128; the token stream continues where it was."""
    rc = main([*FAST, "--job.dump_folder", str(tmp_path), "--job.name", "ctx", "--training.steps", "4",
               "--training.context_stages", "3:128"])
    assert rc == 0
    records = [json.loads(x) for x in (tmp_path / "ctx" / "metrics.jsonl").read_text().splitlines()]
    assert [r["tokens_seen"] for r in records] == [64, 128, 256, 384]
    events = [json.loads(x) for x in (tmp_path / "ctx" / "events.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e["kind"] == "context_stage"] == [3]


def test_context_stages_are_validated():
    from titan_k3.config import ConfigError

    with pytest.raises(ConfigError, match="is not a multiple of the KDA chunk size"):
        load_job_config(["--training.context_stages", "5:100"])
    with pytest.raises(ConfigError, match="updates must increase"):
        load_job_config(["--training.context_stages", "5:128,4:256"])


def test_explicit_triton_kernel_without_a_gpu_is_refused_before_any_work(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    rc = main([*FAST, "--job.dump_folder", str(tmp_path), "--kernels.experts", "triton"])
    assert rc == 2
    assert "config key 'kernels.experts' = 'triton': the Triton kernel needs a CUDA device" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_the_step_loop_synchronises_only_where_a_window_ends():
    """Log, eval, checkpoint and last updates end a window (clocks read after the GPU is done); others run ahead."""
    from types import SimpleNamespace

    from titan_k3.config import load_job_config
    from titan_k3.eval.runner import Evaluator
    from titan_k3.train import Trainer

    cfg = load_job_config(["--training.steps", "20", "--metrics.log_freq", "5", "--eval.interval", "4",
                           "--checkpoint.enable", "true", "--checkpoint.interval", "6"])
    fake = SimpleNamespace(cfg=cfg, evaluator=SimpleNamespace(due=lambda step, last: Evaluator.due(fake, step, last)))
    ends = [s for s in range(1, 21) if Trainer._window_ends(fake, s)]
    assert ends == [4, 5, 6, 8, 10, 12, 15, 16, 18, 20]


def test_results_settle_in_update_order_when_their_copy_lands_or_when_read():
    """The step never waits for its loss: results settle in update order, and reading one settles all before it."""
    from collections import deque
    from types import SimpleNamespace

    from titan_k3.train import StepResult, Trainer

    class Copy:  # an asynchronous device-to-host copy that lands when the test says so
        def __init__(self):
            self.landed = False

        def query(self):
            return self.landed

        def synchronize(self):
            self.landed = True

    emitted = []
    fake = SimpleNamespace(_unsettled=deque(), skipped_updates=0, skipped_in_row=0,
                           events=SimpleNamespace(emit=lambda kind, message, step: emitted.append((kind, step))))

    def settle(upto=None, wait=True):
        Trainer._settle(fake, upto, wait)

    results, copies = [], []
    for step, loss in enumerate([1.0, float("nan"), float("inf"), 2.0], start=1):
        results.append(StepResult(step, 10, settle))
        copies.append(Copy())
        fake._unsettled.append((results[-1], torch.tensor([loss, 0.5, 7.0]), copies[-1]))
    settle(wait=False)
    assert fake.skipped_updates == 0 and len(fake._unsettled) == 4, "nothing has landed: nothing settles"
    copies[0].landed = copies[1].landed = True
    settle(wait=False)
    assert len(fake._unsettled) == 2 and fake.skipped_in_row == 1 and emitted == [("nonfinite", 2)]
    assert results[3].loss == 2.0
    assert not fake._unsettled and fake.skipped_updates == 2 and fake.skipped_in_row == 0
    assert emitted == [("nonfinite", 2), ("nonfinite", 3)], "skips are reported with their own update, in order"
    assert [r.skipped for r in results] == [False, True, True, False] and results[0].n_valid == 7


def test_python_gc_is_scheduled_between_updates_and_given_back(tmp_path, monkeypatch):
    """training.gc_every: automatic collection off while the trainer lives, a generation-1 pass before every
    gc_every-th update, the collector's previous state restored by close; 0 leaves it alone."""
    import gc

    calls = []
    collect = gc.collect
    monkeypatch.setattr(gc, "collect", lambda generation=2: calls.append(generation) or collect(generation))
    assert gc.isenabled()
    trainer = Trainer(load_job_config([*FAST, "--job.dump_folder", str(tmp_path), "--training.steps", "5",
                                       "--training.gc_every", "2"]))
    try:
        assert not gc.isenabled()
        assert calls == [1]  # once when the trainer is built
        updates = []
        original = trainer.gc_schedule.before_update
        trainer.gc_schedule.before_update = lambda u: (updates.append((u, len(calls))), original(u))[1]
        trainer.train()
        assert [u for u, _ in updates] == [1, 2, 3, 4, 5]
        assert calls == [1, 1, 1]  # before updates 2 and 4
    finally:
        trainer.close()
    assert gc.isenabled()
    trainer = Trainer(load_job_config([*FAST, "--job.dump_folder", str(tmp_path / "off"), "--training.steps", "3",
                                       "--training.gc_every", "0"]))
    try:
        assert gc.isenabled()
        trainer.train()
    finally:
        trainer.close()
    assert gc.isenabled()


def test_bf16_momentum_reaches_the_optimizer_and_trains(tmp_path):
    """optimizer.momentum_dtype: the Muon buffers the trainer builds are bf16 (AdamW's moments stay float32);
    optimizer.ns_chunk reaches the optimizer too."""
    trainer = Trainer(load_job_config([*FAST, "--job.dump_folder", str(tmp_path), "--training.steps", "2",
                                       "--optimizer.momentum_dtype", "bfloat16", "--optimizer.ns_chunk", "3"]))
    try:
        losses = [trainer.train_step().loss for _ in range(2)]
        muon, adamw = (trainer.optimizers.optimizers[k] for k in ("muon", "adamw"))
        assert muon.state and {s["momentum_buffer"].dtype for s in muon.state.values()} == {torch.bfloat16}
        assert {s["exp_avg"].dtype for s in adamw.state.values()} == {torch.float32}
        assert muon.ns_chunk == 3
        assert all(torch.isfinite(torch.tensor(x)) for x in losses)
    finally:
        trainer.close()


def test_expandable_segments_reach_the_allocator_before_cuda_starts(monkeypatch):
    """training.expandable_segments sets PYTORCH_CUDA_ALLOC_CONF for a CUDA run (kept beside the user's own
    settings), leaves a CPU run alone, and refuses an environment that says otherwise."""
    from titan_k3.config.errors import ConfigError
    from titan_k3.trainer_setup import set_allocator

    on = load_job_config(["--training.expandable_segments", "true"])
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    set_allocator(on, torch.device("cpu"))
    set_allocator(load_job_config([]), cuda)
    assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ
    set_allocator(on, cuda)
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128")
    set_allocator(on, cuda)
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:128,expandable_segments:True"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")
    with pytest.raises(ConfigError, match="'training.expandable_segments' = true: PYTORCH_CUDA_ALLOC_CONF="):
        set_allocator(on, cuda)
    # CUDA started before the trainer: the setting goes to the running allocator (through torch's own setter, which
    # must exist under that name: setattr refuses a missing attribute) and the environment is left as it is.
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    told = []
    monkeypatch.setattr(torch.cuda.memory, "_set_allocator_settings", told.append)
    set_allocator(on, cuda)
    assert told == ["expandable_segments:True"] and "PYTORCH_CUDA_ALLOC_CONF" not in os.environ


def test_loss_chunk_rows_reaches_the_loss_and_keeps_its_value(monkeypatch):
    """kernels.loss_chunk_rows is the chunk the model's loss runs with; the loss and its gradients do not depend on it."""
    from kernels.fused_ce import reference
    from titan_k3.config.errors import ConfigError
    from titan_k3.models.k3.impl import resolve_impl

    with pytest.raises(ConfigError, match="'kernels.loss_chunk_rows' = -1: must be >= 0"):
        load_job_config(["--kernels.loss_chunk_rows", "-1"])
    seen = []
    real = reference.linear_cross_entropy

    def spy(*args, chunk_rows=None, **kwargs):
        seen.append(chunk_rows)
        return real(*args, chunk_rows=chunk_rows, **kwargs)

    monkeypatch.setattr(reference, "linear_cross_entropy", spy)
    g = torch.Generator().manual_seed(3)
    h = torch.randn(37, 8, dtype=torch.float64, generator=g)
    w = torch.randn(50, 8, dtype=torch.float64, generator=g)
    targets = torch.randint(0, 50, (37,), generator=g)
    results = []
    for rows in (0, 5):
        impl = resolve_impl(load_job_config(["--kernels.loss_chunk_rows", str(rows)]).kernels, torch.device("cpu"))
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        loss, n = impl.loss(hh, ww, targets)
        loss.backward()
        results.append((loss.detach(), n, hh.grad, ww.grad))
    assert seen == [None, 5]
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_loss_grad_fp8_is_refused_without_the_fused_loss_on_an_fp8_gpu(monkeypatch):
    """kernels.loss_grad_fp8 names what it lacks before any work: the fused loss (a CPU run takes the torch
    reference), a GPU with FP8 matmuls; granted, the fused loss is called with FP8 gradient products. Without the
    key the kernel report's loss_grads entry names the loss's own precision path."""
    import kernels.fused_ce.grad_fp8 as grad_fp8
    from titan_k3.models.k3 import impl as impl_module

    cfg = load_job_config(["--kernels.loss_grad_fp8", "true"])
    with pytest.raises(ValueError, match=r"'kernels.loss_grad_fp8' = true: needs the fused Triton loss.*reference"):
        impl_module.resolve_impl(cfg.kernels, torch.device("cpu"))
    cuda = torch.device("cuda")
    fused = impl_module.KernelChoice("loss", "auto", "triton", False)
    monkeypatch.setattr(grad_fp8, "fp8_supported", lambda device: False)
    with pytest.raises(ValueError, match=r"'kernels.loss_grad_fp8' = true: needs a CUDA GPU with FP8 matmuls"):
        impl_module._fp8_loss_grads(lambda *a, **k: None, fused, cuda)
    monkeypatch.setattr(grad_fp8, "fp8_supported", lambda device: True)
    calls = []
    loss = impl_module._fp8_loss_grads(lambda *a, **k: calls.append(k), fused, cuda)
    loss(1, 2, 3)
    assert calls == [{"fp8_grads": True}]
    plain = impl_module.resolve_impl(load_job_config([]).kernels, torch.device("cpu"))
    assert [c.chosen for c in plain.choices if c.op == "loss_grads"] == ["torch"]


def test_loss_one_pass_reaches_the_fused_loss_and_is_refused_where_it_cannot_run(monkeypatch):
    """kernels.loss_one_pass: with loss_grad_fp8 too, one config error; with the loss set to the torch reference,
    one line naming both keys before any work; with the loss on auto where it fell back (a CPU run), a fallback in
    the kernel report; with the fused loss (here in Triton's interpreter), the loss and its gradients of the one-pass
    row kernel, equal to the reference's."""
    from titan_k3.config.errors import ConfigError
    from titan_k3.models.k3.impl import resolve_impl

    with pytest.raises(ConfigError, match="'kernels.loss_one_pass' and 'kernels.loss_grad_fp8' are both true"):
        load_job_config(["--kernels.loss_one_pass", "true", "--kernels.loss_grad_fp8", "true"])
    asked = ["--kernels.loss_one_pass", "true"]
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match=r"'kernels.loss_one_pass' = true: needs the fused Triton loss.*'torch'"):
        resolve_impl(load_job_config([*asked, "--kernels.loss", "torch"]).kernels, cpu)
    (rows,) = [c for c in resolve_impl(load_job_config(asked).kernels, cpu).choices if c.op == "loss_rows"]
    assert rows.fallback and rows.chosen == "two_pass" and "kernels.loss_one_pass" in rows.reason
    plain = resolve_impl(load_job_config([]).kernels, cpu)
    assert [(c.chosen, c.fallback) for c in plain.choices if c.op == "loss_rows"] == [("two_pass", False)]

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    import kernels.fused_ce.ce_one_pass as one_pass_module

    seen = []
    real = one_pass_module.ce_rows_one_pass
    monkeypatch.setattr("kernels.fused_ce.ops.ce_rows_one_pass", lambda *a, **k: (seen.append(1), real(*a, **k)))
    g = torch.Generator().manual_seed(3)
    h = torch.randn(37, 8, generator=g)
    w = torch.randn(50, 8, generator=g)
    targets = torch.randint(0, 50, (37,), generator=g)
    results = []
    for args in ([*asked, "--kernels.loss", "triton"], ["--kernels.loss", "torch"]):
        impl = resolve_impl(load_job_config(args).kernels, cpu)
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        loss, n = impl.loss(hh, ww, targets)
        loss.backward()
        results.append((loss.detach(), n, hh.grad, ww.grad))
    assert seen, "the one-pass row kernel did not run"
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_a_resume_at_or_past_training_steps_says_nothing_is_left_to_train(tmp_path, capsys):
    """A finished run started again (or with training.steps lowered below its checkpoint) says so, without nan."""
    args = [*FAST, "--job.dump_folder", str(tmp_path), "--job.name", "done", "--checkpoint.enable", "true",
            "--checkpoint.interval", "2", "--lr_scheduler.warmup_steps", "0"]
    assert main([*args, "--training.steps", "2"]) == 0
    capsys.readouterr()
    assert main([*args, "--training.steps", "1"]) == 0
    out = capsys.readouterr().out
    assert "nothing to train: the run is at update 2 and training.steps = 1 (raise training.steps to train on)" in out
    assert "nan" not in out


def test_bf16_compute_in_one_cpu_process_is_a_named_fallback(tmp_path, capsys):
    """One CPU process has neither CUDA's bf16 autocast nor FSDP's parameter dtype: it computes in float32, and says so
    (the run recorded compute_dtype = 'bfloat16' and trained in float32 without a word)."""
    args = [*FAST, "--job.dump_folder", str(tmp_path), "--training.steps", "1", "--training.compute_dtype", "bfloat16"]
    assert main([*args, "--job.name", "bf16"]) == 0
    events = [json.loads(x) for x in (tmp_path / "bf16" / "events.jsonl").read_text().splitlines()]
    (fallback,) = [e for e in events if e["kind"] == "fallback" and e.get("op") == "compute_dtype"]
    assert fallback["requested"] == "bfloat16" and fallback["chosen"] == "float32"
    torch_kernels = [x for op in ("kda", "experts", "loss", "attn_res", "router", "max_logit", "conv")
                     for x in (f"--kernels.{op}", "torch")]
    capsys.readouterr()
    assert main([*args, "--job.name", "strict", "--job.strict", "true", *torch_kernels,
                 "--kernels.attention", "math"]) == 2
    assert "job.strict = true and compute_dtype falls back to 'float32'" in capsys.readouterr().err
    assert not (tmp_path / "strict").exists()


@pytest.mark.parametrize("argv, line", [
    (["--data.mixture", "prose:1"], "error: config key 'data.mixture' = 'prose:1': no weight for source(s) ['code'] "
                                    "(0 leaves one out); the dataset has ['code', 'prose']"),
    (["--eval.tasks", "/nonexistent/a.jsonl"], "error: config key 'eval.tasks' = '/nonexistent/a.jsonl': no such file"),
])
def test_data_and_file_refusals_name_their_key_as_validate_only_does(tmp_path, capsys, argv, line):
    """The trainer said 'mixture: no weight for source(s) ...' and 'task file ...', without the key --job.validate_only
    and the control service name."""
    assert main([*FAST, "--job.dump_folder", str(tmp_path), "--job.name", "refused", *argv]) == 2
    assert capsys.readouterr().err.startswith(line)
    assert not (tmp_path / "refused").exists()


def test_validate_only_refuses_the_run_directory_the_run_would_refuse(tmp_path, capsys):
    """--job.validate_only said 'config ok' for a reused name with nothing to resume and for a dump folder that is a
    file, and the run then stopped on them."""
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "config.toml").write_text("")
    (tmp_path / "afile").write_text("")
    assert main(["--job.dump_folder", str(tmp_path), "--job.name", "old", "--job.validate_only"]) == 2
    assert capsys.readouterr().err.startswith(f"error: config key 'job.name' = 'old': {tmp_path}/old holds a previous run")
    assert main(["--job.dump_folder", str(tmp_path / "afile"), "--job.validate_only"]) == 2
    assert "config key 'job.dump_folder'" in capsys.readouterr().err
    assert main(["--job.dump_folder", str(tmp_path), "--job.name", "new", "--job.validate_only"]) == 0
    assert capsys.readouterr().out == "config ok\n" and not (tmp_path / "new").exists()


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="no /proc")
def test_validate_only_refuses_a_dump_folder_the_run_cannot_create_its_directory_in(tmp_path, capsys):
    """/proc reads as writable to root: --job.validate_only said 'config ok', and the run built its model and then
    stopped on 'cannot create the run directory'. Both stop on the same line, the run before its model."""
    argv = [*FAST, "--job.dump_folder", "/proc/titan_k3-runs", "--job.name", "r"]
    assert main([*argv, "--job.validate_only"]) == 2
    line = capsys.readouterr().err
    assert line.startswith("error: config key 'job.dump_folder' = '/proc/titan_k3-runs': ")
    assert main(argv) == 2
    assert capsys.readouterr().err == line


REFERENCE_KERNELS = ["--kernels.kda", "torch", "--kernels.experts", "torch", "--kernels.loss", "torch",
                     "--kernels.attn_res", "torch", "--kernels.router", "torch", "--kernels.max_logit", "torch",
                     "--kernels.conv", "torch", "--kernels.attention", "math"]
"""Every kernel asked as the reference: none falls back on a CPU, so job.strict reaches the checks after them."""


@pytest.mark.parametrize("argv, line", [
    pytest.param(["--compile.enable", "--compile.backend", "eager", "--compile.cache_dir", "/proc/titan_k3-cache"],
                 "error: config key 'compile.cache_dir' = '/proc/titan_k3-cache': ", id="compile.cache_dir"),
    pytest.param(["--profiling.memory_peak_updates", "1"], "error: config key 'profiling.memory_peak_updates' = 1: "
                 "the allocator's trace needs a CUDA device; this run is on cpu", id="profiling.memory_peak_updates",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is visible")),
    pytest.param(["--eval.tasks", "{tmp}/tasks.jsonl"], "error: config key 'eval.tasks' = '{tmp}/tasks.jsonl': task file "
                 "'{tmp}/tasks.jsonl' line 1: expected", id="eval.tasks"),
    pytest.param(["--job.strict", *REFERENCE_KERNELS, "--training.compute_dtype", "bfloat16"],
                 "error: job.strict = true and compute_dtype falls back to 'float32': one process without CUDA",
                 id="job.strict-compute_dtype",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is visible")),
    pytest.param(["--job.strict", *REFERENCE_KERNELS, "--training.compute_dtype", "bfloat16", "--float8.enable"],
                 "error: job.strict = true and float8 falls back to 'bf16': no CUDA device", id="job.strict-float8",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is visible")),
    pytest.param(["--training.steps", "10", "--lr_scheduler.warmup_steps", "5", "--lr_scheduler.decay_ratio", "0.9"],
                 "error: config key 'lr_scheduler.decay_ratio' = 0.9: its 9 decay updates", id="lr_scheduler.decay_ratio"),
    pytest.param(["--checkpoint.enable", "--checkpoint.load_step", "5"], "error: config key 'checkpoint.load_step' = 5: "
                 "no complete checkpoint of that step in {tmp}/r/checkpoints", id="checkpoint.load_step"),
    pytest.param(["--checkpoint.initial_load_path", "{tmp}"],
                 "error: config key 'checkpoint.initial_load_path' = '{tmp}': no checkpoint there",
                 id="checkpoint.initial_load_path"),
    pytest.param(["--metrics.enable_tensorboard"], "error: config key 'metrics.enable_tensorboard' = true: the tensorboard "
                 "package is not installed;", id="metrics.enable_tensorboard",
                 marks=pytest.mark.skipif(importlib.util.find_spec("tensorboard") is not None,
                                          reason="tensorboard is installed")),
])
def test_validate_only_refuses_with_the_line_the_run_gives(tmp_path, capsys, argv, line):
    """--job.validate_only said 'config ok' to each, and the run stopped on it (the compile cache after building its
    model, on a bare '[Errno 2] No such file or directory')."""
    (tmp_path / "tasks.jsonl").write_text("not a task\n")
    argv = [*FAST, "--job.dump_folder", str(tmp_path), "--job.name", "r", *(a.format(tmp=tmp_path) for a in argv)]
    assert main([*argv, "--job.validate_only"]) == 2
    refused = capsys.readouterr().err
    assert refused.startswith(line.format(tmp=tmp_path))
    assert main(argv) == 2
    assert capsys.readouterr().err == refused
    assert not (tmp_path / "r").exists()


def test_validate_only_refuses_an_allocator_setting_the_cuda_run_refuses(tmp_path, capsys, monkeypatch):
    """training.expandable_segments under a PYTORCH_CUDA_ALLOC_CONF that sets it otherwise stops a CUDA run at its
    start; --job.validate_only said 'config ok'. The device is said to be CUDA: both stop before they use it."""
    monkeypatch.setattr("titan_k3.train.pick_device", lambda cfg: torch.device("cuda", 0))
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")
    argv = [*FAST, "--job.dump_folder", str(tmp_path), "--job.name", "r", "--training.expandable_segments", "true"]
    assert main([*argv, "--job.validate_only"]) == 2
    refused = capsys.readouterr().err
    assert refused.startswith("error: config key 'training.expandable_segments' = true: PYTORCH_CUDA_ALLOC_CONF=")
    assert main(argv) == 2
    assert capsys.readouterr().err == refused


def test_validate_only_refuses_a_taken_metrics_port_with_the_line_the_run_gives(tmp_path, capsys):
    """Both refused it, the run after building its model with the exporter's own 'cannot listen ([Errno 98] ...)'."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        argv = [*FAST, "--job.dump_folder", str(tmp_path), "--job.name", "r", "--metrics.prometheus_port", str(port)]
        assert main([*argv, "--job.validate_only"]) == 2
        refused = capsys.readouterr().err
        assert refused.startswith(f"error: config key 'metrics.prometheus_port' = {port}: cannot listen on 127.0.0.1:{port}")
        assert main(argv) == 2
        assert capsys.readouterr().err == refused


def test_validate_only_refuses_an_eval_batch_the_launchs_ranks_do_not_divide(tmp_path, capsys, monkeypatch):
    """The run's evaluator refuses it at the start of a two-rank launch; --job.validate_only said 'config ok'."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["--job.dump_folder", str(tmp_path), "--job.validate_only", "--eval.batch_size", "3",
                 "--eval.interval", "10"]) == 2
    assert capsys.readouterr().err.startswith(
        "error: config key 'eval.batch_size' = 3: must be a multiple of the 2 data-parallel ranks")


def test_validate_only_checks_the_mesh_against_the_launchs_world_size(tmp_path, capsys, monkeypatch):
    """tomls/debug/hsdp.toml (2 x 2) in one process: the run refuses it, and --job.validate_only said 'config ok'."""
    argv = ["--job.config_file", "tomls/debug/hsdp.toml", "--job.dump_folder", str(tmp_path), "--job.validate_only"]
    assert main(argv) == 2
    assert capsys.readouterr().err.startswith(
        "error: config key 'parallelism.data_parallel_replicate_degree' = 2: must divide the world size 1")
    monkeypatch.setenv("WORLD_SIZE", "4")  # the torchrun the recipe is for
    assert main(argv) == 0 and capsys.readouterr().out == "config ok\n"


@pytest.mark.parametrize("argv, line", [
    (["--model.vocab_size", "10"], "error: config key 'model.vocab_size' = 10: below the tokenizer's vocabulary of"),
    (["--training.device", "cuda"], "error: config key 'training.device' = 'cuda': no CUDA device is visible"),
    (["--debug.inject_same_data", "true"], "error: config key 'debug.inject_same_data' = "),
    (["--job.strict", "true"], "error: job.strict = true and kda falls back to 'torch' (asked 'auto')"),
])
def test_validate_only_refuses_what_the_trainer_refuses_before_its_model(tmp_path, capsys, argv, line):
    """--job.validate_only said 'config ok' to each, and the run then stopped on it."""
    if argv[0] in ("--training.device", "--job.strict") and torch.cuda.is_available():
        pytest.skip("a CUDA device is visible")
    assert main(["--job.dump_folder", str(tmp_path), "--job.validate_only", *argv]) == 2
    assert capsys.readouterr().err.startswith(line)


def test_validate_only_refuses_a_side_stream_that_job_strict_refuses(tmp_path, capsys):
    """optimizer.side_stream falls back on a CPU (and under torchrun), which the run's start refuses under job.strict;
    --job.validate_only said 'config ok'."""
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible")
    argv = ["--job.dump_folder", str(tmp_path), "--job.validate_only", "--job.strict", *REFERENCE_KERNELS]
    assert main(argv) == 0 and capsys.readouterr().out == "config ok\n"
    assert main([*argv, "--optimizer.side_stream", "true"]) == 2
    assert capsys.readouterr().err.startswith("error: job.strict = true and optimizer.side_stream falls back to 'off'")


@pytest.mark.parametrize("argv, why", [
    (["--training.seed", "7"], "loader state seed 0: this loader has seed 7"),
    (["--training.local_batch_size", "3"], "loader state seq_index 2: not a multiple of local_batch_size x dp_world = 3"),
])
def test_validate_only_refuses_a_data_position_the_resume_would_refuse(tmp_path, capsys, argv, why):
    """--job.validate_only said 'config ok' for a resume whose saved data position does not fit the run (another seed,
    a batch that does not divide it), and the run then stopped on it after building its model."""
    run = [*FAST, "--job.dump_folder", str(tmp_path), "--job.name", "r", "--training.local_batch_size", "1",
           "--checkpoint.enable", "true", "--checkpoint.interval", "2"]
    assert main([*run, "--training.steps", "2"]) == 0
    capsys.readouterr()
    line = f"error: checkpoint {tmp_path}/r/checkpoints/step-2: data loader position does not fit this run: {why}"
    assert main([*run, "--training.steps", "4", *argv, "--job.validate_only"]) == 2
    assert capsys.readouterr().err.splitlines()[0] == line
    assert main([*run, "--training.steps", "4", *argv]) == 2
    assert capsys.readouterr().err.splitlines()[0] == line
    assert main([*run, "--training.steps", "4", "--job.validate_only"]) == 0
