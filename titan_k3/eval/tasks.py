"""Multiple-choice task files, read the one way both their users read them (torch-free).

A task is a JSONL file, one example per line: {"context": str, "choices": [str],
"gold": int}. The evaluator scores them (multiple_choice.py) and the data
pipeline's decontamination removes their n-grams from the training data
(titan_k3/data/prepare/dedup.py): both read every line through
`iter_examples`, so a line one of them refuses the other never takes another way
(a null read as the text "None", true as gold 1). Every refusal is a ValueError
of one line naming the file and the line; the checks are plain `if`s, which
`python -O` keeps.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

FORMAT = '{"context": str, "choices": [str, ...], "gold": int}'


@dataclass(frozen=True)
class Example:
    context: str
    choices: tuple[str, ...]
    gold: int


def where(path: str | Path, line: int) -> str:
    return f"task file {str(path)!r} line {line}"


def parse_example(text: str) -> Example:
    """One task line as an Example; ValueError("expected ... (what is wrong)") otherwise."""
    try:
        rec = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"expected {FORMAT} (not JSON: {e.msg} at column {e.colno})") from None
    if not isinstance(rec, dict):
        problem = f"a JSON {type(rec).__name__}, not an object"
    elif missing := [k for k in ("context", "choices", "gold") if k not in rec]:
        problem = f"no {', '.join(map(repr, missing))}"
    elif not isinstance(rec["context"], str):
        problem = "context not a string"
    elif not isinstance(rec["choices"], list) or not all(isinstance(c, str) for c in rec["choices"]):
        problem = "choices not a list of strings"
    # NOTE: bool is an int subclass: true would count as gold 1.
    elif not isinstance(rec["gold"], int) or isinstance(rec["gold"], bool):
        problem = "gold not an integer"
    elif not 0 <= rec["gold"] < len(rec["choices"]):
        problem = f"gold = {rec['gold']} with {len(rec['choices'])} choices"
    else:
        return Example(rec["context"], tuple(rec["choices"]), rec["gold"])
    raise ValueError(f"expected {FORMAT} ({problem})")


def iter_examples(path: str | Path) -> Iterator[tuple[int, Example]]:
    """(line number, Example) for every non-blank line of task file `path`; the first bad line is a ValueError
    naming the file and the line. Lines end at '\\n' only (a JSON string may hold U+2028 or a form feed)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"task file {str(path)!r}: {'a directory, not a JSONL file' if path.is_dir() else 'no such file'}")
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{where(path, n)}: not UTF-8 (byte {e.start + 1} of the line is 0x{raw[e.start]:02x})") \
                    from None
            if not text.strip():
                continue
            try:
                yield n, parse_example(text)
            except ValueError as e:
                raise ValueError(f"{where(path, n)}: {e}") from None


def task_name(path: str | Path) -> str:
    """The name a task's metrics carry: its file name without `.jsonl`."""
    return Path(path).name.removesuffix(".jsonl")
