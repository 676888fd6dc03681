"""Every `section.key` the documentation names (in prose, as `--section.key` or in a `[section]` table) is a key of
the job config (titan_k3/config/job_config.py), or of the planner's cluster (titan_k3/plan/cluster.py) for
`cluster.*`; a name with a job section's prefix that is an invariant check (`data.disjoint_sequences`) or a file
(`metrics.jsonl`) is no key and is left out.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from pathlib import Path

from titan_k3.config.job_config import JobConfig
from titan_k3.invariants.checks import CHECKS
from titan_k3.plan.cluster import Cluster

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", REPO / "deploy/README.md", REPO / "service/README.md",
        REPO / "titan_k3/checkpoint/README.md", *sorted((REPO / "docs").glob("*.md"))]
FILE_SUFFIXES = {"jsonl", "json", "toml", "md", "py", "safetensors", "yml", "yaml", "png", "txt", "log", "pt"}


def sections() -> dict[str, type]:
    hints = typing.get_type_hints(JobConfig)
    return {f.name: hints[f.name] for f in dataclasses.fields(JobConfig)} | {"cluster": Cluster}


def known_keys() -> set[str]:
    return {f"{name}.{f.name}" for name, cls in sections().items() for f in dataclasses.fields(cls)}


def named_keys(docs: list[Path] = DOCS, root: Path = REPO) -> set[tuple[str, int, str]]:
    """(document, line, key) of every config key named."""
    # NOTE: a key followed by '.name' is a module path (`kernels.muon.ns_polynomial`), not a key.
    pattern = re.compile(r"(?<![\w./])(?:%s)\.[a-z_][a-z0-9_]*\b(?!\.\w)" % "|".join(sections()))
    found = set()
    for path in docs:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for match in pattern.finditer(line):
                key = match.group(0)
                if key.rsplit(".", 1)[1] not in FILE_SUFFIXES and key not in CHECKS:
                    found.add((path.relative_to(root).as_posix(), number, key))
    return found


def test_every_config_key_the_docs_name_exists():
    named = named_keys()
    assert len(named) > 50, "the docs name few config keys: the pattern is wrong"
    unknown = sorted((where, line, key) for where, line, key in named if key not in known_keys())
    assert not unknown, f"named in the docs but no key of the job config (or the planner's cluster): {unknown}"


def test_the_pattern_finds_a_typo_and_skips_files_and_module_paths(tmp_path):
    doc = tmp_path / "x.md"
    doc.write_text("`training.stpes`, `--checkpoint.enable true`, `metrics.jsonl`, `kernels.muon.ns_polynomial`,\n"
                   "`data.disjoint_sequences`, `cluster.nodes`\n")
    keys = {key for _, _, key in named_keys([doc], tmp_path)}
    assert keys == {"training.stpes", "checkpoint.enable", "cluster.nodes"}
    assert keys - known_keys() == {"training.stpes"}
