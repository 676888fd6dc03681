"""The run files the offline tools read (metrics.jsonl, events.jsonl), checked as the trainer writes them.

Every problem is a ValueError of one line naming the file (and the line): a file that cannot be read, a line
that is not a record the trainer writes. A last line still being written is no record yet (`read_jsonl`).
"""

from __future__ import annotations

from pathlib import Path

from titan_k3.metrics.run_dir import read_jsonl
from titan_k3.textfiles import unreadable
from titan_k3.values import is_number


def run_dir_problem(run_dir: Path) -> str | None:
    """Why `run_dir` is no run directory to read (it does not exist, is a file, has no metrics.jsonl); None if it is."""
    if not run_dir.exists():
        return f"{str(run_dir)!r}: no such directory"
    if not run_dir.is_dir():
        return f"{str(run_dir)!r}: not a directory"
    if not (run_dir / "metrics.jsonl").exists():
        return f"{str(run_dir)!r}: no metrics.jsonl (is it a titan_k3 run directory?)"
    return None


def read_lines(path: Path) -> list:
    """read_jsonl, with a file that cannot be read named in one line."""
    try:
        return read_jsonl(path)
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(unreadable(str(path), e)) from None


def read_records(path: Path, keys: tuple[str, ...], optional: tuple[str, ...] = ()) -> list[dict]:
    """metrics.jsonl's records, each an object with a number for every one of `keys` (keys the trainer writes in
    every record) and for each of `optional` it holds (val_loss: evaluation steps only); else ValueError naming the
    line and the keys."""
    records = read_lines(path)
    for n, r in enumerate(records, 1):
        if not isinstance(r, dict):
            raise ValueError(f"{path}:{n}: not a JSON object")
        missing = [k for k in keys if not is_number(r.get(k))]
        if missing:
            raise ValueError(f"{path}:{n}: record without a number for {', '.join(map(repr, missing))} (the trainer "
                             "writes each in every record)")
        for k in optional:
            if k in r and not is_number(r[k]):
                raise ValueError(f"{path}:{n}: {k!r} = {r[k]!r}, not a number (the trainer writes no such record)")
    return records


def read_events(path: Path) -> list[dict]:
    """events.jsonl's events ([] when absent), each an object with a text 'kind' and, if any, a number 'step'."""
    events = read_lines(path)
    for n, e in enumerate(events, 1):
        if not (isinstance(e, dict) and isinstance(e.get("kind"), str)):
            raise ValueError(f"{path}: event {n} is not an object with a 'kind' (the trainer writes no such line)")
        if "step" in e and not is_number(e["step"]):
            raise ValueError(f"{path}: event {n}: 'step' = {e['step']!r}, not a number (the trainer writes no such "
                             "line)")
    return events
