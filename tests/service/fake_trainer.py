"""A stand-in for `python -m titan_k3.train` that keeps the run-directory contract, in milliseconds.

It parses the real (torch-free) config, then "trains": one update every
$FAKE_TRAINER_STEP_SECONDS, a metrics line per `metrics.log_freq`, checkpoints
as `checkpoints/step-N/` + `latest` (periodic ones with checkpoint.enable; on
SIGTERM also with checkpoint.save_on_stop), resume from `latest`, exit 0 after
the stop's checkpoint ($FAKE_TRAINER_STOP_EXIT: another status, as torchrun
gives when it is signalled itself), exit 3 after `debug.crash_at_step`, exit 2
with one `error:` line for a configuration error (also a metrics port it
cannot listen on, and a reused run directory with nothing to resume unless
job.overwrite, which then deletes the previous run's files). Used by the service tests that need many or fast runs;
the headline flows use the real trainer.
"""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import sys
import time
from pathlib import Path

from titan_k3.config import ConfigError, config_to_toml, load_job_config
from titan_k3.config.check import CONFIG_ERROR_EXIT

# What the trainer refuses to run over without a checkpoint to resume (titan_k3.metrics.run_dir.RUN_FILES).
RUN_FILES = ("config.toml", "manifest.json", "metrics.jsonl", "events.jsonl", "stdout.log")


def main(argv: list[str]) -> int:
    try:
        cfg = load_job_config(argv)
        reused_run_dir(cfg)
        endpoint = listen(cfg)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return CONFIG_ERROR_EXIT
    try:
        return train(cfg)
    finally:
        if endpoint is not None:
            endpoint.close()


def listen(cfg) -> socket.socket | None:
    """Hold the metrics port as the trainer's endpoint does (no HTTP: the tests only need it taken)."""
    m = cfg.metrics
    if not m.prometheus_port:
        return None
    s = socket.socket()
    try:
        s.bind((m.prometheus_host, m.prometheus_port))
        s.listen()
    except OSError as e:
        s.close()
        raise ConfigError(f"config key 'metrics.prometheus_port' = {m.prometheus_port}: cannot listen ({e})") from None
    return s


def reused_run_dir(cfg) -> None:
    """As the trainer's run_dir_problem: a directory holding a previous run and no checkpoint is refused, or with
    job.overwrite cleared of that run's files."""
    run_dir = Path(cfg.job.dump_folder) / cfg.job.name
    previous = [run_dir / name for name in RUN_FILES if (run_dir / name).is_file()]
    resumes = cfg.checkpoint.enable or cfg.checkpoint.save_on_stop
    if not previous or (resumes and (run_dir / cfg.checkpoint.folder / "latest").exists()):
        return
    if not cfg.job.overwrite:
        raise ConfigError(f"config key 'job.name' = '{cfg.job.name}': {run_dir} holds a previous run "
                          f"({previous[0].name}) and nothing to resume; choose another name, or set "
                          "job.overwrite = true to start it over")
    for path in previous:
        path.unlink()


def train(cfg) -> int:
    resumes = cfg.checkpoint.enable or cfg.checkpoint.save_on_stop
    run_dir = Path(cfg.job.dump_folder) / cfg.job.name
    run_dir.mkdir(parents=True, exist_ok=True)
    ckpt_dir = run_dir / cfg.checkpoint.folder
    step_seconds = float(os.environ.get("FAKE_TRAINER_STEP_SECONDS", "0.2"))
    stop = {"requested": False}
    if os.environ.get("FAKE_TRAINER_IGNORE_SIGTERM") == "1":  # a hung trainer: only SIGKILL ends it
        signal.signal(signal.SIGTERM, lambda *_: None)
    else:
        signal.signal(signal.SIGTERM, lambda *_: stop.update(requested=True))

    (run_dir / "config.toml").write_text(config_to_toml(cfg))
    manifest = {"name": cfg.job.name, "trainer": "fake", "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
                "token_in_env": "K3_SERVICE_TOKEN" in os.environ}
    (run_dir / "manifest.json").write_text(json.dumps(manifest))
    events = open(run_dir / "events.jsonl", "a")
    metrics = open(run_dir / "metrics.jsonl", "a")
    stdout_log = open(run_dir / "stdout.log", "a")

    def say(text: str) -> None:
        print(text, flush=True)
        stdout_log.write(text + "\n")
        stdout_log.flush()

    def event(step: int, kind: str, message: str, **extra: object) -> None:
        events.write(json.dumps({"time": time.time(), "step": step, "kind": kind, "message": message, **extra}) + "\n")
        events.flush()

    def save(step: int) -> None:
        if not resumes:
            return
        d = ckpt_dir / f"step-{step}"
        d.mkdir(parents=True, exist_ok=True)
        (d / "state.json").write_text(json.dumps({"step": step}))
        tmp = ckpt_dir / "latest.tmp"
        tmp.write_text(f"step-{step}\n")
        os.replace(tmp, ckpt_dir / "latest")
        event(step, "checkpoint_saved", f"saved step-{step}")
        say(f"checkpoint saved at step {step}")

    start = 0
    latest = ckpt_dir / "latest"
    if resumes and latest.exists():
        start = int(latest.read_text().strip().removeprefix("step-"))
        event(start, "resumed", f"resumed from step-{start}")
        say(f"resumed from step {start}")
    say(f"fake trainer | run {run_dir.resolve()}")  # as the trainer names its run directory
    event(start, "kernel_report", "fake trainer: no kernels")
    t0 = time.time()
    for step in range(start + 1, cfg.training.steps + 1):
        time.sleep(step_seconds)
        if step % cfg.metrics.log_freq == 0 or step == cfg.training.steps:
            loss = 10.0 * math.exp(-0.1 * step)
            tps = 1000.0 + step
            metrics.write(json.dumps({
                "step": step, "loss": loss, "lr": 1e-3, "grad_norm": 1.0 / step,
                "tokens_per_second_training": tps, "tokens_per_second_session": tps / 2,
                "mfu": 0.1, "memory_peak_allocated_gib": 0.5, "tokens_seen": step * 64,
                "skipped_updates": 0, "grad_norm/muon": 0.5, "grad_norm/adamw": 0.25,
                "moe/layers.1/dead_fraction": 0.0, "moe/layers.1/maxvio": 0.3,
                "moe/layers.1/load_cv": 0.2, "moe/layers.1/entropy": 2.0, "elapsed": time.time() - t0,
            }) + "\n")
            metrics.flush()
            say(f"step {step} loss {loss:.4f}")
        if cfg.checkpoint.enable and step % cfg.checkpoint.interval == 0:
            save(step)
        if step == cfg.debug.crash_at_step:
            say(f"crashing at step {step} (debug.crash_at_step)")
            return 3
        if stop["requested"]:
            say(f"SIGTERM: stopping after step {step}")
            save(step)
            return int(os.environ.get("FAKE_TRAINER_STOP_EXIT", "0"))
    if cfg.checkpoint.enable:
        save(cfg.training.steps)
    say("done")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
