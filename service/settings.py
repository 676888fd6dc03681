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
    max_running: int = 0
    """Runs allowed to run at once regardless of GPUs; 0 means no limit."""
    launcher: str = "torchrun"
    """'torchrun' (torch.distributed.run --standalone) or 'python' (one process, no torchrun; tests)."""
    trainer_module: str = "titan_k3.train"
    python: str = sys.executable
    grace_seconds: float = 60.0
    """Seconds between SIGTERM and SIGKILL on stop."""
    poll_seconds: float = 0.25
    max_body_bytes: int = 1 << 20
    data_roots: list[Path] = field(default_factory=list)
    """Absolute folders a config may read datasets, tokenizers and checkpoints from."""
    child_env: dict[str, str] = field(default_factory=dict)
    """Extra environment for every child (e.g. PYTHONPATH of a test trainer)."""

    def __post_init__(self) -> None:
        if self.launcher not in ("torchrun", "python"):
            raise ValueError(f"launcher {self.launcher!r}: expected 'torchrun' or 'python'")
        self.state_dir = Path(self.state_dir).resolve()
        self.recipes_dir = Path(self.recipes_dir).resolve()
        self.data_roots = [Path(p).resolve() for p in self.data_roots]
        if self.gpus < 0:
            self.gpus = detect_gpus()
        if not self.advertise_host:
            self.advertise_host = socket.gethostname() if self.host in ("0.0.0.0", "::") else self.host

    @property
    def runs_dir(self) -> Path:
        return self.state_dir / "runs"

    @property
    def compile_cache_dir(self) -> Path:
        """Compiled kernels shared by every run of this service: a restart loads them instead of compiling."""
        return self.state_dir / "compile-cache"

    def run_args(self, run_id: str) -> list[str]:
        """The trainer overrides the service sets for every run (reserved: a request cannot set them)."""
        return ["--job.dump_folder", str(self.runs_dir), "--job.name", run_id,
                "--compile.cache_dir", str(self.compile_cache_dir)]

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
    p.add_argument("--max-running", type=int, default=int(os.environ.get("K3_SERVICE_MAX_RUNNING", "0")))
    p.add_argument("--launcher", choices=["torchrun", "python"], default=os.environ.get("K3_SERVICE_LAUNCHER", "torchrun"))
    p.add_argument("--trainer-module", default=os.environ.get("K3_SERVICE_TRAINER_MODULE", "titan_k3.train"))
    p.add_argument("--grace-seconds", type=float, default=float(os.environ.get("K3_SERVICE_GRACE_SECONDS", "60")))
    p.add_argument("--max-body-bytes", type=int, default=1 << 20)
    p.add_argument("--data-root", action="append", default=[], help="folder configs may read data from (repeatable)")
    a = p.parse_args(argv)
    token = os.environ.get(TOKEN_ENV, "")
    if a.token_file:
        token = Path(a.token_file).read_text().strip()
        if not token:
            p.error(f"--token-file {a.token_file!r}: file is empty")
    return Settings(
        state_dir=Path(a.state_dir), host=a.host, port=a.port, advertise_host=a.advertise_host, token=token, recipes_dir=Path(a.recipes_dir),
        gpus=a.gpus, max_running=a.max_running, launcher=a.launcher, trainer_module=a.trainer_module,
        grace_seconds=a.grace_seconds, max_body_bytes=a.max_body_bytes, data_roots=[Path(d) for d in a.data_root],
    )
