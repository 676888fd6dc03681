"""What kind of value a JSON or TOML file (or a dataclass of them) holds, as Python reads it.

NOTE: Python's bool is an int: `isinstance(True, int)` holds, so a `true` written where a count or a number belongs
passes a plain isinstance check. Torch-free: the control service reads run files with these too.
"""

from __future__ import annotations

import math
from typing import Any


def is_integer(value: Any) -> bool:
    """An int, not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any, *, finite: bool = False) -> bool:
    """An int or a float, not a bool; with `finite`, neither nan nor an infinity."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and (not finite or math.isfinite(value))
