"""Every events.jsonl kind the documentation names (`checkpoint_fallback` event, event `startup`) is one the trainer
emits: a literal first argument of an `emit` call (`EventLog.emit`, or a wrapper named `_emit`) under titan_k3/.

The log stream's SSE `end` event (service/README.md) is the service's, not an events.jsonl kind.
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", REPO / "deploy/README.md", REPO / "service/README.md",
        REPO / "titan_k3/checkpoint/README.md", *sorted((REPO / "docs").glob("*.md"))]
NAMED = re.compile(r"\bevents?\s+\(?`([a-z_]+)`|`([a-z_]+)`\)?\s+(?:warning\s+)?events?\b")
NOT_KINDS = {"end"}


def emitted() -> set[str]:
    return {kind for path in (REPO / "titan_k3").rglob("*.py")
            for kind in re.findall(r"emit\(\s*\"([a-z_]+)\"", path.read_text())}


def test_every_event_the_docs_name_is_emitted():
    named = {(doc.relative_to(REPO).as_posix(), m.group(1) or m.group(2))
             for doc in DOCS for m in NAMED.finditer(doc.read_text())}
    assert len(named) > 10, "the docs name few events: the pattern is wrong"
    kinds = emitted()
    assert {"startup", "checkpoint_fallback", "kernel_report"} <= kinds, "the emit pattern is wrong"
    unknown = sorted((doc, kind) for doc, kind in named if kind not in kinds | NOT_KINDS)
    assert not unknown, f"named in the docs but emitted nowhere: {unknown}"
