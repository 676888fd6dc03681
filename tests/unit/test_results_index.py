"""benchmarks/results/README.md indexes every result file, and raw profiles live under profiles/."""

from __future__ import annotations

import re
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def _linked() -> set[str]:
    return set(re.findall(r"\]\(([^)#]+)\)", (RESULTS / "README.md").read_text()))


def test_every_result_file_is_indexed_and_every_link_resolves():
    files = {p.name for p in RESULTS.iterdir() if p.is_file() and p.name != "README.md"}
    assert sorted(files - _linked()) == []
    assert sorted(name for name in _linked() if not (RESULTS / name).is_file()) == []


def test_profile_dumps_sit_under_profiles():
    loose = [p.name for p in RESULTS.iterdir() if re.match(r"(profile|compile-times)-.*\.txt$", p.name)]
    assert loose == []
    assert any((RESULTS / "profiles").glob("profile-*.txt"))
