"""Why a text file could not be read, in one line: the same words wherever a file the user named is read.

Torch-free, so that the offline tools (the scaling-law fit) and the service's launcher-side checks can use it.
"""

from __future__ import annotations


def unreadable(name: str, e: OSError | UnicodeDecodeError) -> str:
    """One line saying why the file `name` (a path, or the key that named it) could not be read as text.

    >>> unreadable("a.toml", UnicodeDecodeError("utf-8", b"\\xe9", 0, 1, "invalid continuation byte"))
    'a.toml: not UTF-8 text (byte 0: invalid continuation byte)'
    """
    if isinstance(e, UnicodeDecodeError):
        return f"{name}: not UTF-8 text (byte {e.start}: {e.reason})"
    return f"{name}: cannot read it ({e.strerror or e})"
