"""Every Prometheus metric the documentation names is one an exporter in the repository emits.

The trainer's rank-0 names come from its one table (titan_k3.metrics.prometheus.NAMES), the service's from
service/exporter.py; a name ending in '_' is a prefix the text explains (titan_k3_run_<key>).
"""

from __future__ import annotations

import re
from pathlib import Path

from titan_k3.metrics.prometheus import NAMES

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", REPO / "deploy/README.md", REPO / "service/README.md", *sorted((REPO / "docs").glob("*.md"))]
NOT_METRICS = {"titan_k3_tokenizer"}  # an export's config.json key (docs/checkpoints.md)


def emitted() -> set[str]:
    from service.exporter import EXPERT_LOAD, LABELLED, SERVICE_NAMES

    trainer = set(NAMES) | {n + s for n, (kind, _, _) in NAMES.items() if kind == "histogram"
                            for s in ("_bucket", "_sum", "_count")}
    # NOTE: SERVICE_NAMES holds a counter's name without the '_total' its samples carry.
    service = set(SERVICE_NAMES) | {n + "_total" for n in SERVICE_NAMES} | {lab.name for lab in LABELLED} | {EXPERT_LOAD}
    return trainer | service


def test_every_metric_the_docs_name_is_emitted():
    named = {(path.relative_to(REPO).as_posix(), name) for path in DOCS
             for name in re.findall(r"\btitan_k3_[a-z0-9_]*[a-z0-9]\b", path.read_text())}
    assert named, "the docs name no metric: the pattern is wrong"
    unknown = sorted((where, name) for where, name in named if name not in emitted() | NOT_METRICS)
    assert not unknown, f"named in the docs but emitted by no exporter: {unknown}"
