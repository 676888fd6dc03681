"""The run directory (DESIGN.md): resolved config, manifest, stdout.log.

Created only after every check on the configuration, the data and the model
has passed, so bad input never leaves a half-written run directory.
`read_jsonl` and `load_run_config` read it back for the offline tools
(summarize, sweep, eval).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from titan_k3.config import JobConfig, config_to_toml, load_job_config


def run_dir_path(cfg: JobConfig) -> Path:
    """dump_folder/name; with no name, '<recipe stem>-<UTC timestamp>' (fixed once per process)."""
    name = cfg.job.name
    if not name:
        stem = Path(cfg.job.config_file).stem if cfg.job.config_file else "default"
        name = f"{stem}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}"
        cfg.job.name = name
    return Path(cfg.job.dump_folder) / name


def config_hash(cfg: JobConfig) -> str:
    return hashlib.sha256(config_to_toml(cfg).encode()).hexdigest()[:16]


def git_commit() -> str:
    here = Path(__file__).resolve().parents[2]
    with contextlib.suppress(OSError, subprocess.SubprocessError):  # no git, or not a checkout: say "unknown"
        out = subprocess.run(["git", "-C", str(here), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
        dirty = subprocess.run(["git", "-C", str(here), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5)
        if out.returncode == 0:
            return out.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    return "unknown"


def hardware() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {"host": platform.node(), "cpu_count": os.cpu_count(), "platform": platform.platform()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["gpu_count"] = torch.cuda.device_count()
    return info


def versions() -> dict[str, str]:
    import torch

    from importlib.metadata import PackageNotFoundError, version

    v = {"python": sys.version.split()[0], "torch": torch.__version__}
    # NOTE: read package metadata rather than importing (torchao's import is slow and noisy).
    for dist_name in ("triton", "torchao", "torchdata", "tokenizers"):
        try:
            v[dist_name] = version(dist_name)
        except PackageNotFoundError:
            v[dist_name] = "absent"
    return v


def prepare_run_dir(cfg: JobConfig, manifest_extra: dict[str, Any]) -> Path:
    """Create (or reopen, for a resume) the run directory; write config.toml and manifest.json."""
    path = run_dir_path(cfg)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.toml").write_text(config_to_toml(cfg))
    manifest = {
        "run": path.name,
        "created_unix": time.time(),
        "git_commit": git_commit(),
        "versions": versions(),
        "hardware": hardware(),
        "config_hash": config_hash(cfg),
        "argv": sys.argv,
        **manifest_extra,
    }
    tmp = path / "manifest.json.tmp"
    tmp.write_text(json.dumps(manifest, indent=2, default=str))
    os.replace(tmp, path / "manifest.json")
    return path


def read_jsonl(path: Path) -> list[dict]:
    """Every record of a metrics.jsonl / events.jsonl file ([] when absent); ValueError naming a bad line."""
    if not path.exists():
        return []
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not a JSON object ({e.msg})") from None
    return out


def load_run_config(run_dir: Path) -> JobConfig:
    """The run's resolved config.toml, as a JobConfig."""
    path = Path(run_dir) / "config.toml"
    if not path.is_file():
        raise ValueError(f"run directory {str(run_dir)!r}: no config.toml (is it a titan_k3 run directory?)")
    return load_job_config([], toml_text=path.read_text())


class Tee:
    """Copy everything written to a stream into a file (stdout.log)."""

    def __init__(self, stream, path: Path):
        self.stream, self.file = stream, open(path, "a", buffering=1)

    def write(self, text: str) -> int:
        self.file.write(text)
        return self.stream.write(text)

    def flush(self) -> None:
        self.file.flush()
        self.stream.flush()

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        return self.stream.fileno()
