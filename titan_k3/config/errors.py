"""The one exception of a configuration mistake, and how its message writes a value, in a module of its own so every
config module can use them."""

from __future__ import annotations

import datetime
import json
import math
import re
from typing import Any


class ConfigError(ValueError):
    """A user's configuration mistake; the message is one line."""


_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


def toml_value(value: Any) -> str:
    """`value` as TOML writes it, so that a message shows what the user wrote: true (not Python's True), 'text'
    (a literal string; a basic "..." one where the text holds a quote or a control character), 1e-05, inf, [1, 2],
    { a = 1 }, 1979-05-27."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return repr(value) if math.isfinite(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, str):
        if "'" in value or any(ord(c) < 32 or ord(c) == 127 for c in value):
            return json.dumps(value, ensure_ascii=False)  # JSON's escapes are TOML's basic-string escapes
        return f"'{value}'"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        items = [f"{k if _BARE_KEY.fullmatch(str(k)) else toml_value(str(k))} = {toml_value(v)}" for k, v in value.items()]
        return "{ " + ", ".join(items) + " }" if items else "{}"
    if isinstance(value, (datetime.date, datetime.time)):  # datetime.datetime is a date
        return value.isoformat()
    return str(value)
