"""Every `section.key` the documentation names (in prose or as `--section.key`) is a key of the job config
(titan_k3/config/job_config.py), or of the planner's cluster (titan_k3/plan/cluster.py) for `cluster.*`; a name
with a job section's prefix that is an invariant check (`data.disjoint_sequences`) or a file (`metrics.jsonl`) is
no key and is left out. A value the docs give a key (`kernels.kda = "fla"`, `--training.steps 50`) is one of its
type (and of its choices); a placeholder (`= N`, `DIR`) is no value.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from pathlib import Path
from typing import Literal

import tomli

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


def key_types() -> dict[str, object]:
    """'section.key' -> its type, for every key of the job config and of the planner's cluster."""
    return {f"{name}.{key}": tp for name, cls in sections().items() for key, tp in typing.get_type_hints(cls).items()}


def known_keys() -> set[str]:
    return set(key_types())


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


def shown_values(docs: list[Path] = DOCS) -> set[tuple[str, str, object]]:
    """(document, key, value) of every `section.key = value` or `--section.key value` with a TOML value."""
    pattern = re.compile(r"`(?:--)?((?:%s)\.[a-z_0-9]+)(?: = | )([^`]+)`" % "|".join(sections()))
    found = set()
    for path in docs:
        for match in pattern.finditer(path.read_text()):
            try:
                value = tomli.loads(f"x = {match.group(2)}")["x"]
            except tomli.TOMLDecodeError:
                continue
            found.add((path.name, match.group(1), value))
    return found


def fits(value: object, tp: object) -> bool:
    if typing.get_origin(tp) is Literal:
        return value in typing.get_args(tp)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, tp)


def test_every_value_the_docs_give_a_key_is_of_its_type():
    shown = shown_values()
    assert len(shown) > 20, "the docs give few values: the pattern is wrong"
    types = key_types()
    wrong = sorted(((doc, key, value) for doc, key, value in shown if key in types and not fits(value, types[key])),
                   key=str)
    assert not wrong, f"the docs give these keys a value of another type or outside their choices: {wrong}"


def test_a_value_outside_the_choices_is_found_and_a_placeholder_is_no_value(tmp_path):
    doc = tmp_path / "x.md"
    doc.write_text('`kernels.kda = "fal"`, `--data.dataset DIR`, `--training.steps 50`,\n'
                   '`debug.kill_in_save_at_step = N`\n')
    assert shown_values([doc]) == {("x.md", "kernels.kda", "fal"), ("x.md", "training.steps", 50)}
    types = key_types()
    assert not fits("fal", types["kernels.kda"]) and fits("fla", types["kernels.kda"])
    assert fits(1, types["optimizer.lr"]) and not fits(True, types["training.steps"])
