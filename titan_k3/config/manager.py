"""Load a JobConfig: defaults < TOML file < `--section.key value` overrides.

Every mistake stops here, before any work, with one line naming the key, the
value and what is allowed (`ConfigError`). Torch-free on purpose.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import inspect
import math
import os
import re
import sys
import typing
from pathlib import Path
from typing import Any, Collection, Literal

import tomli

from titan_k3.config import job_config
from titan_k3.config.errors import ConfigError, toml_value
from titan_k3.config.job_config import JobConfig
from titan_k3.textfiles import unreadable


@functools.cache
def field_docs() -> dict[tuple[str, str], str]:
    """(section class name, field) -> the docstring written under the field."""
    tree = ast.parse(inspect.getsource(job_config))
    docs: dict[tuple[str, str], str] = {}
    for node in tree.body:
        if not isinstance(node, ast.ClassDef):
            continue
        body = node.body
        for stmt, nxt in zip(body, body[1:]):
            if (
                isinstance(stmt, ast.AnnAssign)
                and isinstance(stmt.target, ast.Name)
                and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                docs[(node.name, stmt.target.id)] = " ".join(nxt.value.value.split())
    return docs


def _sections() -> dict[str, type]:
    hints = typing.get_type_hints(JobConfig)
    return {f.name: hints[f.name] for f in dataclasses.fields(JobConfig)}


def _field_types(section_cls: type) -> dict[str, Any]:
    return typing.get_type_hints(section_cls)


def bool_keys() -> set[str]:
    """'section.key' of every true-or-false field."""
    return {f"{section}.{name}" for section, cls in _sections().items()
            for name, tp in _field_types(cls).items() if tp is bool}


def _suggest(word: str, options: list[str]) -> str:
    close = difflib.get_close_matches(word, options, n=1, cutoff=0.6)
    return f"; did you mean '{close[0]}'?" if close else ""


def _describe(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(toml_value(a) for a in typing.get_args(tp))
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(tp, str(tp))


def _coerce(key: str, raw: Any, tp: Any, from_cli: bool) -> Any:
    """Convert `raw` (TOML value or CLI string) to `tp`, or raise ConfigError."""
    bad = ConfigError(f"config key '{key}' = {toml_value(raw)}: expected {_describe(tp)}")
    if typing.get_origin(tp) is Literal:
        choices = typing.get_args(tp)
        if raw not in choices:
            hint = _suggest(str(raw), [str(c) for c in choices])
            raise ConfigError(f"config key '{key}' = {toml_value(raw)}: expected {_describe(tp)}{hint}")
        return raw
    if tp is bool:
        if isinstance(raw, bool):
            return raw
        if from_cli and isinstance(raw, str) and raw.lower() in ("true", "false", "1", "0"):
            return raw.lower() in ("true", "1")
        raise bad
    if tp in (int, float):
        # NOTE: TOML gives ints where floats are meant (lr = 1); never the reverse, and a bool is never a number.
        accepted = (int,) if tp is int else (int, float)
        if isinstance(raw, accepted) and not isinstance(raw, bool):
            return _in_range(key, tp(raw))
        if from_cli and isinstance(raw, str):
            try:
                value = tp(raw)
            except ValueError:
                raise bad from None
            return _in_range(key, value)
        raise bad
    if tp is str:
        if isinstance(raw, str):
            return raw
        raise bad
    raise AssertionError(f"unsupported config type {tp} for {key}")


def _in_range(key: str, value: int | float) -> int | float:
    """No config number is meaningful as inf/nan or beyond a 64-bit integer (nothing downstream could hold it)."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"config key '{key}' = {toml_value(value)}: expected a finite number")
    if isinstance(value, int) and not -(2**63) <= value < 2**63:
        raise ConfigError(f"config key '{key}' = {value}: out of range (a 64-bit integer)")
    return value


def _set(cfg: JobConfig, key: str, raw: Any, from_cli: bool) -> None:
    sections = _sections()
    if "." not in key:
        raise ConfigError(f"config key '{key}': expected 'section.key' with a section among {', '.join(sections)}")
    section, name = key.split(".", 1)
    if section not in sections:
        raise ConfigError(f"unknown config section '{section}' (in '{key}'){_suggest(section, list(sections))}")
    types = _field_types(sections[section])
    if name not in types:
        full = [f"{section}.{n}" for n in types] + [f"{s}.{n}" for s in sections for n in _field_types(sections[s])]
        raise ConfigError(f"unknown config key '{key}'{_suggest(key, full)}")
    setattr(getattr(cfg, section), name, _coerce(key, raw, types[name], from_cli))


def _apply_toml(cfg: JobConfig, data: dict[str, Any], origin: str) -> list[str]:
    """Set every key of the parsed TOML `data` (from `origin`, which errors name); returns the keys set."""
    keys = []
    for section, values in data.items():
        if not isinstance(values, dict):
            raise ConfigError(f"{origin}: top-level key '{section}' must be a [section] table")
        for name, raw in values.items():
            try:
                _set(cfg, f"{section}.{name}", raw, from_cli=False)
            except ConfigError as e:
                raise ConfigError(f"{origin}: {e}") from None
            keys.append(f"{section}.{name}")
    return keys


_NAMED_KEY = re.compile(r"config keys? '([^']+)'")


def _validate(cfg: JobConfig, needs_data: bool, from_toml: set[str], origin: str) -> None:
    """validate(), its error prefixed by the TOML's `origin` when the key it names first was set there (and not
    overridden on the command line), as the errors of reading that file are."""
    from titan_k3.config.validate import validate

    try:
        validate(cfg, needs_data=needs_data)
    except ConfigError as e:
        named = _NAMED_KEY.match(str(e))
        if named and named.group(1) in from_toml:
            raise ConfigError(f"{origin}: {e}") from None
        raise


def parse_toml_text(text: str, origin: str = "<inline TOML>") -> dict[str, Any]:
    try:
        return tomli.loads(text)
    except tomli.TOMLDecodeError as e:
        raise ConfigError(f"{origin}: not valid TOML ({e})") from None


def split_overrides(argv: list[str], form: str = "--section.key value",
                    flags: Collection[str] = ()) -> list[tuple[str, str]]:
    """['--a.b', 'v', '--c.d=w'] -> [('a.b', 'v'), ('c.d', 'w')]; `form` is how an override looks, for the error.

    flags: keys that may also stand alone, meaning 'true' (`--job.strict` as `--job.strict true`): those followed by
    nothing or by the next `--` option.
    """
    pairs: list[tuple[str, str]] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument '{arg}': overrides look like {form}")
        key = arg[2:]
        if "=" in key:
            key, value = key.split("=", 1)
            i += 1
        elif key in flags and (i + 1 >= len(argv) or argv[i + 1].startswith("--")):
            value = "true"
            i += 1
        else:
            if i + 1 >= len(argv):
                raise ConfigError(f"option '--{key}' needs a value")
            if argv[i + 1].startswith("--"):
                raise ConfigError(f"option '--{key}' needs a value, and '{argv[i + 1]}' follows it (a value that "
                                  f"starts with '--' is written --{key}=VALUE)")
            value = argv[i + 1]
            i += 2
        pairs.append((key, value))
    return pairs


def is_run_config(path: Path) -> bool:
    """Whether `path` is a run directory's resolved config.toml (its manifest.json beside it)."""
    return path.name == "config.toml" and (path.parent / "manifest.json").is_file()


def _names_no_file(cfg: JobConfig, origin: str, resolved: bool) -> None:
    """A TOML cannot name a config file (there are no includes: the command line's --job.config_file names the one
    file read), except a resolved config, whose job.config_file records the recipe it was resolved from."""
    if cfg.job.config_file and not resolved:
        raise ConfigError(f"{origin}: config key 'job.config_file' = {toml_value(cfg.job.config_file)}: a config file "
                          "cannot name another (no includes; --job.config_file on the command line names the one file "
                          "read); delete the key there")


def load_job_config(argv: list[str] | None = None, toml_text: str | None = None, *,
                    needs_data: bool = True, resolved: bool = True, toml_origin: str = "<inline TOML>") -> JobConfig:
    """Build and validate a JobConfig from CLI arguments (and optionally TOML text).

    `toml_text`, when given, stands in for `--job.config_file` (the service
    validates inline TOML this way). `needs_data=False` accepts an empty
    `data.dataset` (a caller that reads no data, such as the planner).
    `toml_origin`: where `toml_text` came from, as its errors name it. `resolved`: `toml_text` is a run's resolved config (a run directory's config.toml, read back by the tools), which
    may record the recipe it came from in job.config_file; False: TOML written as input, which, like a file given by
    --job.config_file (other than a run directory's config.toml, `is_run_config`), cannot name one.
    Raises ConfigError on any mistake.
    """
    pairs = split_overrides(list(sys.argv[1:] if argv is None else argv), flags=bool_keys())
    cfg = JobConfig()
    config_file = next((v for k, v in pairs if k == "job.config_file"), None)
    from_toml: list[str] = []
    origin = toml_origin
    if toml_text is not None:
        from_toml = _apply_toml(cfg, parse_toml_text(toml_text), origin)
        _names_no_file(cfg, origin, resolved)
    elif config_file:
        path = Path(config_file)
        if path.is_dir():
            raise ConfigError(f"config key 'job.config_file' = {toml_value(config_file)}: is a directory, not a TOML file")
        if not path.is_file():
            raise ConfigError(f"config key 'job.config_file' = {toml_value(config_file)}: no such file")
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(unreadable(f"config key 'job.config_file' = {toml_value(config_file)}", e)) from None
        origin = str(path)
        from_toml = _apply_toml(cfg, parse_toml_text(text, origin), origin)
        _names_no_file(cfg, origin, is_run_config(path))
    for key, value in pairs:
        _set(cfg, key, value, from_cli=True)
    _validate(cfg, needs_data, set(from_toml) - {key for key, _ in pairs}, origin)
    return cfg


def config_to_dict(cfg: JobConfig) -> dict[str, dict[str, Any]]:
    return dataclasses.asdict(cfg)


def config_to_toml(cfg: JobConfig) -> str:
    """The resolved config as TOML text (what the run directory stores)."""
    import tomli_w

    return tomli_w.dumps(config_to_dict(cfg))


def help_text() -> str:
    docs = field_docs()
    lines = ["usage: python -m titan_k3.train [--job.config_file FILE] [--section.key VALUE ...]",
             "(a true-or-false key alone means true: --job.strict is --job.strict true)", ""]
    for section, cls in _sections().items():
        lines.append(f"[{section}]")
        defaults = cls()
        for name, tp in _field_types(cls).items():
            default = getattr(defaults, name)
            lines.append(f"  --{section}.{name} ({_describe(tp)}, default {toml_value(default)})")
            lines.append(f"      {docs.get((cls.__name__, name), '')}")
        lines.append("")
    return "\n".join(lines)


def print_help() -> int:
    """Write `help_text()` to stdout and return exit status 0, also when the reader closes the pipe early (`| head`).

    Under torchrun rank 0 alone writes it: every rank answers --help, with the same text."""
    if int(os.environ.get("RANK", 0)) != 0:
        return 0
    try:
        sys.stdout.write(help_text() + "\n")
        sys.stdout.flush()
    except BrokenPipeError:
        # NOTE: the interpreter flushes stdout once more at exit; pointed at /dev/null, that flush cannot fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0
