"""The checkpoint folder on disk: names, atomic commit, `latest`, retention, leftovers.

    checkpoints/
      step-8/              a complete checkpoint (DCP files + .metadata + rank-R.pt + meta.json + checksums.json)
      step-12/
      step-16.tmp-3f9a2c/  a save in progress, or one a crash interrupted: never read
      latest               text file holding the name of the newest complete step dir ("step-12")

A save writes everything under `step-N.tmp-<nonce>`, then renames it to
`step-N` (rename is atomic on POSIX file systems), then replaces `latest`
(temp file + os.replace). A kill at any point leaves either the old `latest`
and a tmp dir that the next start deletes, or the new complete checkpoint.
Torch-free: the control service may read these helpers too.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
from pathlib import Path

LATEST = "latest"
_STEP_RE = re.compile(r"^step-(\d+)$")
_TMP_RE = re.compile(r"^step-(\d+)\.(tmp|old)-[0-9a-f]+$")
# DCP's coordinator writes this file last, after every rank's data files are written.
DCP_METADATA = ".metadata"
META_FILE = "meta.json"
# meta.json's "tokenizer" / "tokenizer_sha256" and an export config.json's TOKENIZER_KEY ({"name", "sha256"}) record
# the tokenizer the weights were trained with; a weights-only load (initial_load_path) compares it with the run's.
TOKENIZER_KEY = "titan_k3_tokenizer"


def step_dir_name(step: int) -> str:
    return f"step-{step}"


def new_tmp_dir(folder: Path, step: int) -> Path:
    """A fresh temporary directory name for the save of `step` (the caller creates it)."""
    return folder / f"{step_dir_name(step)}.tmp-{secrets.token_hex(4)}"


def is_complete(path: Path) -> bool:
    return _STEP_RE.match(path.name) is not None and (path / DCP_METADATA).is_file()


def complete_steps(folder: Path) -> dict[int, Path]:
    """{step: dir} of the complete checkpoints in `folder`, ascending."""
    if not folder.is_dir():
        return {}
    found = {}
    for p in folder.iterdir():
        m = _STEP_RE.match(p.name)
        if m and p.is_dir() and is_complete(p):
            found[int(m.group(1))] = p
    return dict(sorted(found.items()))


def incomplete_steps(folder: Path) -> dict[int, Path]:
    """{step: dir} of the `step-N` dirs without DCP's .metadata, ascending.

    A save is renamed to `step-N` only after .metadata is written, so each of
    these is a damaged checkpoint (a file deleted, a copy cut short), never a
    save in progress: a start names them rather than taking them for absent.
    """
    if not folder.is_dir():
        return {}
    found = {}
    for p in folder.iterdir():
        m = _STEP_RE.match(p.name)
        if m and p.is_dir() and not is_complete(p):
            found[int(m.group(1))] = p
    return dict(sorted(found.items()))


def run_dir_of(step_dir: Path) -> Path:
    """RUN_DIR of RUN_DIR/<checkpoint.folder>/step-N: the nearest ancestor whose config.toml names that folder
    (checkpoint.folder may be nested, "ckpt/main"); the folder's parent when none does."""
    import tomli

    folder = Path(step_dir).resolve().parent
    for run_dir in folder.parents:
        try:
            config = tomli.loads((run_dir / "config.toml").read_text())
        except (OSError, ValueError):
            continue
        named = (config.get("checkpoint") or {}).get("folder", "checkpoints")
        if isinstance(named, str) and (run_dir / named).resolve() == folder:
            return run_dir
    return folder.parent


def read_latest(folder: Path) -> str | None:
    """The step dir name `latest` holds, or None without a `latest` file."""
    try:
        return (folder / LATEST).read_text().strip() or None
    except FileNotFoundError:
        return None


def write_latest(folder: Path, name: str) -> None:
    tmp = folder / f"{LATEST}.tmp-{secrets.token_hex(4)}"
    with open(tmp, "w") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, folder / LATEST)
    _fsync_dir(folder)


def commit(tmp: Path, step: int) -> Path:
    """Rename a fully written tmp dir to `step-N` and point `latest` at it.

    A `step-N` already there (a re-save after resuming from an earlier step)
    is first moved aside and deleted after the rename, so `step-N` is at every
    moment either the old or the new complete checkpoint, never a mix.
    """
    folder = tmp.parent
    final = folder / step_dir_name(step)
    old = None
    if final.exists():
        old = folder / f"{final.name}.old-{secrets.token_hex(4)}"
        os.rename(final, old)
    os.rename(tmp, final)
    _fsync_dir(folder)
    write_latest(folder, final.name)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return final


def remove_leftovers(folder: Path) -> list[str]:
    """Delete tmp dirs of interrupted saves (and moved-aside old ones); returns their names."""
    if not folder.is_dir():
        return []
    removed = []
    for p in sorted(folder.iterdir()):
        if _TMP_RE.match(p.name) or (p.name.startswith(f"{LATEST}.tmp-") and p.is_file()):
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
            removed.append(p.name)
    return removed


def apply_retention(folder: Path, keep: int) -> list[int]:
    """Delete all but the newest `keep` complete checkpoints (0 keeps all); never the one `latest` names.

    Only complete `step-N` dirs are candidates, so a save in progress or a
    partial dir is never touched here. Returns the deleted steps.
    """
    if keep <= 0:
        return []
    steps = complete_steps(folder)
    latest = read_latest(folder)
    deleted = []
    for step in list(steps)[:-keep]:
        if steps[step].name == latest:
            continue
        shutil.rmtree(steps[step], ignore_errors=True)
        deleted.append(step)
    return deleted


def resolve(folder: Path, load_step: int) -> tuple[Path | None, str]:
    """The checkpoint to resume from and a note on how it was chosen (empty when plain).

    load_step -1: the dir `latest` names; if that is missing or incomplete,
    the newest complete one (and the note says so). load_step >= 0: exactly
    that step, else ValueError.
    """
    steps = complete_steps(folder)
    if load_step >= 0:
        if load_step not in steps:
            have = ", ".join(map(str, steps)) or "none"
            raise ValueError(
                f"config key 'checkpoint.load_step' = {load_step}: no complete checkpoint of that step in {folder} "
                f"(complete steps: {have})"
            )
        return steps[load_step], ""
    latest = read_latest(folder)
    if latest is not None:
        path = folder / latest
        if is_complete(path):
            return path, ""
    if not steps:
        return None, (f"'latest' names {latest!r}, which is not a complete checkpoint, and no other exists"
                      if latest else "")
    newest = steps[max(steps)]
    note = (f"'latest' names {latest!r}, which is missing or incomplete; using the newest complete {newest.name}"
            if latest else f"no 'latest' file; using the newest complete {newest.name}")
    return newest, note


def candidates(folder: Path, load_step: int) -> tuple[list[Path], str]:
    """The complete checkpoints to try, in order, and a note when `latest` is not the first.

    load_step -1: the dir `latest` names (when complete), then every other
    complete one, newest first; the caller takes the first intact one.
    load_step >= 0: exactly that step, else ValueError.
    """
    steps = complete_steps(folder)
    if load_step >= 0:
        return [resolve(folder, load_step)[0]], ""
    latest = read_latest(folder)
    first = folder / latest if latest is not None and is_complete(folder / latest) else None
    rest = [p for _, p in sorted(steps.items(), reverse=True) if p != first]
    if first is not None:
        return [first, *rest], ""
    if not rest:
        return [], (f"'latest' names {latest!r}, which is not a complete checkpoint, and no other exists"
                    if latest else "")
    return rest, (f"'latest' names {latest!r}, which is missing or incomplete; trying the newest complete {rest[0].name}"
                  if latest else f"no 'latest' file; trying the newest complete {rest[0].name}")


def _fsync_dir(path: Path) -> None:
    # NOTE: makes the rename durable on a power loss; some file systems refuse it, which is harmless.
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):
            os.fsync(fd)
    finally:
        os.close(fd)
