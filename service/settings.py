"""Service settings: command-line flags with environment-variable defaults."""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from service.rundir import LINE_BYTES, READ_BYTES
from titan_k3.textfiles import unreadable

TOKEN_ENV = "K3_SERVICE_TOKEN"
REPO_ROOT = Path(__file__).resolve().parent.parent


def detect_gpus() -> int:
    """GPUs on this host per `nvidia-smi -L`; 0 when it is missing or fails."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return 0
    try:
        out = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


@dataclass
class Settings:
    state_dir: Path = Path("./k3-service")
    """Registry, run directories and the generated token live here."""
    host: str = "127.0.0.1"
    port: int = 8080
    advertise_host: str = ""
    """Host name Prometheus reaches trainings at (service discovery); empty: the bind host, or this
    machine's name when bound to all interfaces."""
    token: str = ""
    """Bearer token for mutating endpoints; empty means read it from the state dir (generated once)."""
    recipes_dir: Path = REPO_ROOT / "tomls"
    gpus: int = -1
    """GPUs the queue hands out; -1 asks nvidia-smi."""
    max_running: int = -1
    """Runs allowed to run at once; -1 takes it from the host: one per GPU, one at a time without GPUs; 0: no limit."""
    cpus: int = 0
    """CPU cores a run without GPUs may spread its processes over (nproc_per_node); 0: this host's."""
    launcher: str = "torchrun"
    """'torchrun' (torch.distributed.run --standalone) or 'python' (one process, no torchrun; tests)."""
    trainer_module: str = "titan_k3.train"
    python: str = sys.executable
    stop_timeout: float = 120.0
    """Seconds a stopping trainer has to save: torchrun's worker shutdown timeout (TORCH_ELASTIC_SHUTDOWN_TIMEOUT,
    when torchrun itself is signalled). A k3-mini checkpoint took 24 s to save on an H200: 120 s leaves 5x."""
    grace_seconds: float = 150.0
    """Seconds between SIGTERM and SIGKILL on stop (above stop_timeout, so torchrun's own timeout acts first)."""
    poll_seconds: float = 0.25
    max_body_bytes: int = 1 << 20
    data_roots: list[Path] = field(default_factory=list)
    """Absolute folders a config may read datasets, tokenizers and checkpoints from."""
    child_env: dict[str, str] = field(default_factory=dict)
    """Extra environment for every child (e.g. PYTHONPATH of a test trainer)."""
    read_auth: str = "auto"
    """'on': GET endpoints need the token too; 'off': reads are open; 'auto': on unless bound to loopback."""
    allowed_hosts: list[str] = field(default_factory=list)
    """Host header values accepted ('*' any); empty: loopback names, the bind host and the advertised host."""
    max_streams: int = 32
    """Concurrent log streams (SSE); past it a stream request gets 429."""
    finished_series_seconds: float = 600.0
    """A run's trainer series (titan_k3_run_*) stay in /metrics this long after it ends, then leave."""
    check_timeout: float = 120.0
    """Seconds the trainer's configuration check may take before a submission is refused."""
    log_line_bytes: int = LINE_BYTES
    """What the logs endpoint and stream keep of one console line: its last this many bytes, the cut named."""
    log_read_bytes: int = READ_BYTES
    """What one logs request (or a stream's opening tail) reads of the console logs at most."""

    def __post_init__(self) -> None:
        if self.launcher not in ("torchrun", "python"):
            raise ValueError(f"launcher {self.launcher!r}: expected 'torchrun' or 'python'")
        if self.read_auth not in ("auto", "on", "off"):
            raise ValueError(f"read_auth {self.read_auth!r}: expected 'auto', 'on' or 'off'")
        if self.log_line_bytes < 1 or self.log_read_bytes < 1:
            raise ValueError(f"log_line_bytes {self.log_line_bytes}, log_read_bytes {self.log_read_bytes}: expected "
                             "at least 1 byte each")
        self.state_dir = Path(self.state_dir).resolve()
        self.recipes_dir = Path(self.recipes_dir).resolve()
        self.data_roots = [Path(p).resolve() for p in self.data_roots]
        if self.gpus < 0:
            self.gpus = detect_gpus()
        if not self.advertise_host:
            self.advertise_host = socket.gethostname() if self.host in ("0.0.0.0", "::") else self.host
        if self.max_running < 0:
            self.max_running = max(1, self.gpus)
        if self.cpus <= 0:
            self.cpus = len(os.sched_getaffinity(0))
        if not self.allowed_hosts:
            self.allowed_hosts = sorted({"127.0.0.1", "localhost", "::1", self.advertise_host}
                                        | ({self.host} if self.host not in ("0.0.0.0", "::") else set()))
        if self.read_auth == "auto":
            self.read_auth = "off" if self.loopback else "on"

    @property
    def loopback(self) -> bool:
        """Whether the service listens on loopback only (then reads need no token unless read_auth says so)."""
        return self.host in ("127.0.0.1", "localhost", "::1") or self.host.startswith("127.")

    @property
    def runs_dir(self) -> Path:
        return self.state_dir / "runs"

    @property
    def compile_cache_dir(self) -> Path:
        """Compiled kernels shared by every run of this service: a restart loads them instead of compiling."""
        return self.state_dir / "compile-cache"

    def run_args(self, run_id: str) -> list[str]:
        """The trainer overrides the service sets for every run (reserved: a request cannot set them).

        Every run saves when stopped (resume keeps its word even without periodic checkpoints), and its
        metrics endpoint, if any, listens where the service does (loopback unless the service is exposed).
        """
        return ["--job.dump_folder", str(self.runs_dir), "--job.name", run_id,
                "--compile.cache_dir", str(self.compile_cache_dir), "--checkpoint.save_on_stop", "true",
                "--metrics.prometheus_host", self.metrics_host]

    @property
    def metrics_host(self) -> str:
        """Where trainings' metrics endpoints listen: the service's own bind address."""
        return "127.0.0.1" if self.host == "localhost" else self.host

    def child_environ(self) -> dict[str, str]:
        """Environment of every process the service starts: never the bearer token; this repository importable."""
        env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
        env = {**env, **self.child_env, "PYTHONUNBUFFERED": "1"}
        # NOTE: the service package must be importable by the attempt wrapper whatever the child's cwd.
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
        return env

    def ensure_token(self) -> str:
        """The configured token, else the one in `<state>/token`, created (0600) on first start."""
        if self.token:
            return self.token
        path = self.state_dir / "token"
        if not path.exists():
            self.state_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_urlsafe(32))
        self.token = path.read_text().strip()
        return self.token


def parse_args(argv: list[str] | None = None) -> Settings:
    p = argparse.ArgumentParser(prog="python -m service", description="titan_k3 control service")
    p.add_argument("--host", default=os.environ.get("K3_SERVICE_HOST", "127.0.0.1"),
                   help="bind address (loopback by default; 0.0.0.0 exposes it to the network)")
    p.add_argument("--port", type=int, default=int(os.environ.get("K3_SERVICE_PORT", "8080")))
    p.add_argument("--advertise-host", default=os.environ.get("K3_SERVICE_ADVERTISE_HOST", ""),
                   help="host name in /v1/prometheus/targets (default: the bind host, or the machine's name)")
    p.add_argument("--state-dir", default=os.environ.get("K3_SERVICE_STATE_DIR", "./k3-service"))
    p.add_argument("--token-file", default=os.environ.get("K3_SERVICE_TOKEN_FILE", ""),
                   help=f"file holding the bearer token (else ${TOKEN_ENV}, else <state-dir>/token, generated)")
    p.add_argument("--recipes-dir", default=os.environ.get("K3_SERVICE_RECIPES_DIR", str(REPO_ROOT / "tomls")))
    p.add_argument("--gpus", type=int, default=int(os.environ.get("K3_SERVICE_GPUS", "-1")),
                   help="GPUs to schedule; -1 counts them with nvidia-smi")
    p.add_argument("--max-running", type=int, default=int(os.environ.get("K3_SERVICE_MAX_RUNNING", "-1")),
                   help="runs at once; -1: one per GPU, one at a time without GPUs; 0: no limit")
    p.add_argument("--launcher", choices=["torchrun", "python"], default=os.environ.get("K3_SERVICE_LAUNCHER", "torchrun"))
    p.add_argument("--trainer-module", default=os.environ.get("K3_SERVICE_TRAINER_MODULE", "titan_k3.train"))
    p.add_argument("--grace-seconds", type=float, default=float(os.environ.get("K3_SERVICE_GRACE_SECONDS", "150")),
                   help="seconds from a stop's SIGTERM to SIGKILL")
    p.add_argument("--stop-timeout", type=float, default=float(os.environ.get("K3_SERVICE_STOP_TIMEOUT", "120")),
                   help="torchrun's worker shutdown timeout (seconds a stopping trainer has to save)")
    p.add_argument("--read-auth", choices=["auto", "on", "off"], default=os.environ.get("K3_SERVICE_READ_AUTH", "auto"),
                   help="token on GET endpoints too; auto: on unless bound to loopback")
    p.add_argument("--allowed-host", action="append", default=[],
                   help="accepted Host header (repeatable; '*' any); default: loopback names, bind and advertised host")
    p.add_argument("--max-streams", type=int, default=32, help="concurrent log streams (SSE); more get 429")
    p.add_argument("--finished-series-seconds", type=float, default=600.0,
                   help="seconds a finished run's trainer series stay in /metrics")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20)
    p.add_argument("--log-line-bytes", type=int, default=LINE_BYTES,
                   help="what the logs endpoint and stream keep of one console line (its end; the cut is named)")
    p.add_argument("--log-read-bytes", type=int, default=READ_BYTES,
                   help="what one logs request reads of the console logs at most")
    p.add_argument("--data-root", action="append", default=[], help="folder configs may read data from (repeatable)")
    a = p.parse_args(argv)
    token = os.environ.get(TOKEN_ENV, "")
    if a.token_file:
        try:
            token = Path(a.token_file).read_text().strip()
        except (OSError, UnicodeDecodeError) as e:
            p.error(unreadable(f"--token-file {a.token_file!r}", e))
        if not token:
            p.error(f"--token-file {a.token_file!r}: file is empty")
    return Settings(
        state_dir=Path(a.state_dir), host=a.host, port=a.port, advertise_host=a.advertise_host, token=token, recipes_dir=Path(a.recipes_dir),
        gpus=a.gpus, max_running=a.max_running, launcher=a.launcher, trainer_module=a.trainer_module,
        grace_seconds=a.grace_seconds, stop_timeout=a.stop_timeout, max_body_bytes=a.max_body_bytes,
        data_roots=[Path(d) for d in a.data_root], read_auth=a.read_auth, allowed_hosts=a.allowed_host,
        max_streams=a.max_streams, finished_series_seconds=a.finished_series_seconds,
        log_line_bytes=a.log_line_bytes, log_read_bytes=a.log_read_bytes,
    )
