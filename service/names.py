"""Validation of every name and path a request can carry.

A run id becomes a directory under `<state>/runs/`, a recipe name a file
under the recipe folder; neither may step outside its root.
"""

from __future__ import annotations

import re
from pathlib import Path

from titan_k3.config.errors import toml_value

# NOTE: dots only between other characters' runs, so no '..' (a pattern without look-around: the OpenAPI
# schema carries it too, and schema validators do not all support look-around).
RUN_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_-]*(\.[A-Za-z0-9_-]+)*\.?$"
RUN_ID_MAX = 64
RUN_ID_RE = re.compile(RUN_ID_PATTERN)
RECIPE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}(/[A-Za-z0-9][A-Za-z0-9_-]{0,63}){0,3}$")
OVERRIDE_KEY_RE = re.compile(r"^[a-z][a-z0-9_]*\.[a-z][a-z0-9_]*$")

# Keys the service sets itself: a request may not point a run at another file or folder.
RESERVED_KEYS = frozenset({"job.config_file", "job.dump_folder", "job.name", "compile.cache_dir",
                           "checkpoint.save_on_stop", "metrics.prometheus_host", "job.validate_only"})


def check_run_id(run_id: str) -> str:
    if len(run_id) > RUN_ID_MAX or not RUN_ID_RE.fullmatch(run_id):
        raise ValueError(
            f"run name {run_id!r}: expected 1-64 characters of letters, digits, '_', '-', '.', "
            "starting with a letter or digit, without '..'"
        )
    return run_id


def recipe_path(recipes_dir: Path, recipe: str) -> Path:
    """`tomls/<recipe>.toml`, refusing names that could leave the recipe folder."""
    if not RECIPE_RE.match(recipe):
        raise ValueError(
            f"recipe {recipe!r}: expected a name like 'smoke' or 'distributed/debug' "
            "(letters, digits, '_', '-', at most 4 '/'-separated parts)"
        )
    root = recipes_dir.resolve()
    path = (root / f"{recipe}.toml").resolve()
    if not path.is_relative_to(root):
        raise ValueError(f"recipe {recipe!r}: resolves outside the recipe folder")
    return path


def check_override(key: str, value: str) -> None:
    if not OVERRIDE_KEY_RE.match(key):
        raise ValueError(f"override key {key!r}: expected 'section.key' (lower-case letters, digits, '_')")
    if key in RESERVED_KEYS:
        raise ValueError(f"override key {key!r}: set by the service; allowed keys are any but {', '.join(sorted(RESERVED_KEYS))}")
    if any(ord(c) < 32 or ord(c) == 127 for c in value):
        raise ValueError(f"override {key!r} = {value!r}: control characters are not allowed")
    if len(value) > 4096:
        raise ValueError(f"override {key!r}: value longer than 4096 characters")


def check_relative_subpath(key: str, value: str, taken: tuple[str, ...] = ()) -> None:
    """A folder the trainer creates inside the run directory: relative, no '..', not under a name in `taken`."""
    p = Path(value)
    if p.is_absolute() or ".." in p.parts or "\\" in value:
        raise ValueError(f"config key '{key}' = {toml_value(value)}: must be a relative path inside the run directory (no '..')")
    top = next((part for part in p.parts if part != "."), "")
    if top in taken:
        raise ValueError(f"config key '{key}' = {toml_value(value)}: {toml_value(top)} is the control service's own in "
                         "the run directory; name another folder (default 'checkpoints')")


def check_readable_path(key: str, value: str, roots: list[Path]) -> None:
    """A file or folder the trainer reads: 'embedded'/empty, or inside one of `roots`."""
    if value in ("", "embedded"):
        return
    path = Path(value)
    resolved = path.resolve()
    if path.is_absolute() and any(resolved.is_relative_to(r.resolve()) for r in roots):
        return
    allowed = ", ".join(str(r) for r in roots) or "none configured (--data-root)"
    raise ValueError(f"config key '{key}' = {toml_value(value)}: must be 'embedded' or an absolute path under a data root ({allowed})")
