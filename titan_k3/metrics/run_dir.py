"""The run directory: resolved config, manifest, stdout.log.

Created only after every check on the configuration, the data and the model
has passed, so bad input never leaves a half-written run directory.
`check_run_dir` refuses, before any work, a folder the run must not write:
an unwritable or file-blocked dump folder, or one no folder can be created in
(/proc), and a reused name whose previous
run has no checkpoint to resume (unless job.overwrite); the name itself is
checked with the configuration (validate.check_run_name).
`read_jsonl` and `load_run_config` read it back for the offline tools
(summarize, sweep, eval).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from titan_k3.checkpoint import layout
from titan_k3.config import JobConfig, config_to_toml, load_job_config
from titan_k3.config.check import dump_folder_problem
from titan_k3.config.errors import toml_value
from titan_k3.config.run_files import RUN_FILE_PATTERNS, RUN_FILES, RUN_FOLDERS


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


def previous_run_files(path: Path) -> list[Path]:
    """The files an earlier trainer run left in run directory `path` (none for a new or service-made folder)."""
    if not path.is_dir():
        return []
    found = [path / name for name in RUN_FILES if (path / name).is_file()]
    return found + sorted(p for pattern in RUN_FILE_PATTERNS for p in path.glob(pattern) if p.is_file())


def has_checkpoint(cfg: JobConfig, path: Path) -> bool:
    """Whether run directory `path` holds a complete checkpoint this run resumes from (its checksums are checked
    later, by checkpoint.check_resumable)."""
    c = cfg.checkpoint
    return bool(c.enable or getattr(c, "save_on_stop", False)) and bool(layout.complete_steps(path / c.folder))


def is_torchrun_restart() -> bool:
    """Whether this process is a torchrun restart (`--max-restarts`) of a job whose earlier attempt failed."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0


def run_dir_problem(cfg: JobConfig) -> str | None:
    """The one line that refuses this run's directory, or None: a dump folder that cannot hold it, a run
    directory that is a file, or a reused name with nothing to resume (without job.overwrite)."""
    why = dump_folder_problem(cfg)
    if why:
        return why
    path = run_dir_path(cfg)
    if path.exists() and not path.is_dir():
        return f"config key 'job.name' = {toml_value(cfg.job.name)}: {path} is a file, not a run directory"
    if path.is_dir() and not os.access(path, os.W_OK | os.X_OK):
        return f"config key 'job.name' = {toml_value(cfg.job.name)}: run directory {path} is not writable by this user"
    previous = previous_run_files(path)
    # NOTE: a torchrun restart continues its own job, whose earlier attempt wrote these files: with no checkpoint
    # it starts again at update 0 and appends (the summary keeps the later attempt's rows of a redone update).
    if previous and not cfg.job.overwrite and not has_checkpoint(cfg, path) and not is_torchrun_restart():
        damaged = layout.incomplete_steps(path / cfg.checkpoint.folder)
        if damaged and (cfg.checkpoint.enable or getattr(cfg.checkpoint, "save_on_stop", False)):
            # NOTE: damaged, not absent: job.overwrite would not start over on them either (the start refuses that).
            named = ", ".join(f"{d.name}/{layout.DCP_METADATA}" for d in damaged.values())
            return (f"config key 'job.name' = {toml_value(cfg.job.name)}: {path} holds only damaged checkpoints "
                    f"({named}: missing); restore their files, or move them aside to start over")
        why = "checkpoints are off (checkpoint.enable = false)" if not cfg.checkpoint.enable and not getattr(
            cfg.checkpoint, "save_on_stop", False) else f"no complete checkpoint in {path / cfg.checkpoint.folder}"
        return (f"config key 'job.name' = {toml_value(cfg.job.name)}: {path} holds a previous run ({previous[0].name}) and "
                f"nothing to resume: {why}; choose another name, or set job.overwrite = true to start it over")
    return None


def check_run_dir(cfg: JobConfig) -> None:
    """Refuse, before any work, a run directory this run must not write (ValueError, one line).

    Distributed: rank 0 looks at the file system and every rank raises its verdict, so a rank that
    looks late never sees the directory rank 0 has meanwhile created.
    """
    import torch.distributed as dist

    problem = run_dir_problem(cfg) if int(os.environ.get("RANK", 0)) == 0 else None
    if dist.is_available() and dist.is_initialized():
        box = [problem]
        dist.broadcast_object_list(box, src=0)
        problem = box[0]
    if problem:
        raise ValueError(problem)


def _clear_previous_run(path: Path) -> list[str]:
    """job.overwrite: delete the files a previous run left at the top of `path`; returns their names."""
    removed = []
    for p in previous_run_files(path):
        p.unlink(missing_ok=True)
        removed.append(p.name)
    for folder in (path / name for name in RUN_FOLDERS):
        if folder.is_dir():
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder.name)
    return removed


def prepare_run_dir(cfg: JobConfig, manifest_extra: dict[str, Any], resuming: bool = False) -> Path:
    """Create (or reopen, for a resume) the run directory; write config.toml and manifest.json.

    Not resuming under job.overwrite, the previous run's files go first (the
    manifest lists them under "overwrote"). A write that fails (a full disk, a
    read-only folder) is a ValueError naming the file.
    """
    path = run_dir_path(cfg)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        # NOTE: a folder that changed since check_run_dir created one there (unusable_folder).
        raise ValueError(f"config key 'job.dump_folder' = {toml_value(cfg.job.dump_folder)}: cannot create the run "
                         f"directory {path} ({e.strerror})") from None
    overwrote = _clear_previous_run(path) if cfg.job.overwrite and not resuming else []
    if overwrote:
        print(f"job.overwrite = true: removed the previous run's {', '.join(overwrote)} from {path}", flush=True)
    try:
        _write_run_files(cfg, path, {**manifest_extra, **({"overwrote": overwrote} if overwrote else {})})
    except OSError as e:
        name = Path(e.filename).name if e.filename else "its files"
        raise ValueError(f"run directory {path}: cannot write {name} ({e.strerror})") from None
    return path


def _write_run_files(cfg: JobConfig, path: Path, manifest_extra: dict[str, Any]) -> None:
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
    try:
        tmp.write_text(json.dumps(manifest, indent=2, default=str))
    except OSError:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path / "manifest.json")


def read_jsonl(path: Path) -> list[dict]:
    """Every record of a metrics.jsonl / events.jsonl file ([] when absent); ValueError naming a bad line.

    A last line without its newline is no record yet (a write in progress, or one a kill cut short:
    events.append_record drops it at the run's next write) and is left out.
    """
    if not path.exists():
        return []
    out = []
    text = path.read_text()
    lines = text.splitlines()
    if lines and not text.endswith("\n"):
        lines.pop()
    for n, line in enumerate(lines, 1):
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
