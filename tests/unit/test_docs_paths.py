"""Every repository path the documentation cites exists, every `path.py:name` it cites defines that name, and
every relative Markdown link ([k3.md §1](k3.md#1-the-decoder)) leads to a file and, with an anchor, to a heading.

A path is cited from the repository root (`titan_k3/...`, `benchmarks/...`, `.ci/...`) or, in a README below
the root, from its own folder (deploy/README.md's `prometheus/alerts.yml`). A path with a placeholder in it
(`<version>`, `{R}`, `*`, `step-N`, `RUN_DIR/`) stands for files a run or a user makes and is left out.
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", REPO / "deploy/README.md", REPO / "service/README.md",
        REPO / "titan_k3/checkpoint/README.md", *sorted((REPO / "docs").glob("*.md"))]
TOP = ("titan_k3", "kernels", "benchmarks", "tests", "tomls", "service", "deploy", "docs", ".ci")
PATH = re.compile(r"(?<![\w./~-])((?:%s)/[\w./<>{}*+-]*)(?::([A-Za-z_][\w.]*))?" % "|".join(re.escape(t) for t in TOP))
PLACEHOLDER = re.compile(r"[<>{}*]|(?:^|/)[\w-]*[A-Z]{1,}[\w-]*(?:/|$)|-N\b")


def cited(docs: list[Path] = DOCS, root: Path = REPO) -> set[tuple[str, str, str]]:
    """(document, path, name or '') of every repository path cited."""
    found = set()
    for doc in docs:
        for match in PATH.finditer(doc.read_text()):
            path = match.group(1).rstrip(".,;")
            if not PLACEHOLDER.search(path):
                found.add((doc.relative_to(root).as_posix(), path, match.group(2) or ""))
    return found


def resolve(doc: str, path: str, root: Path = REPO) -> Path | None:
    for base in (root, (root / doc).parent):
        if (base / path).exists():
            return base / path
    return None


def defines(source: str, name: str) -> bool:
    """`name` is a top-level def/class/assignment of the file; `Class.method` a def inside that class."""
    outer, _, inner = name.partition(".")
    head = re.search(rf"^(?:def|class|async def) {outer}\b|^{outer}\s*[:=]", source, re.M)
    if head is None:
        return False
    return not inner or re.search(rf"^\s+(?:async )?def {inner}\b", source[head.start():], re.M) is not None


def test_every_cited_path_exists_and_defines_the_named_function():
    found = cited()
    assert len(found) > 100, "the docs cite few paths: the pattern is wrong"
    missing = sorted((doc, path) for doc, path, _ in found if resolve(doc, path) is None)
    assert not missing, f"cited in the docs but not in the repository: {missing}"
    undefined = sorted((doc, f"{path}:{name}") for doc, path, name in found
                       if name and not defines(resolve(doc, path).read_text(), name))
    assert not undefined, f"cited in the docs but not defined there: {undefined}"


def test_the_pattern_finds_paths_and_names_and_skips_placeholders(tmp_path):
    doc = tmp_path / "x.md"
    doc.write_text("`titan_k3/nowhere.py`, (benchmarks/results/moe.md), `titan_k3/train.py:main`,\n"
                   "`kernels/specializations/triton-<version>.json`, `profile-rank{R}.txt`, `tests/RUN_DIR/x`,\n"
                   "`RUN/checkpoints/step-N`, ~/titan_k3/x, `titan_k3/config/manager.py:load_job_config`.\n")
    found = {(path, name) for _, path, name in cited([doc], tmp_path)}
    assert found == {("titan_k3/nowhere.py", ""), ("benchmarks/results/moe.md", ""), ("titan_k3/train.py", "main"),
                     ("titan_k3/config/manager.py", "load_job_config")}
    assert resolve("x.md", "titan_k3/nowhere.py") is None
    assert defines("class A:\n    x = 1\n\n    def step(self):\n        pass\n", "A.step")
    assert not defines("def step():\n    pass\n", "A.step")


def slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def broken_links(docs: list[Path] = DOCS, root: Path = REPO) -> list[tuple[str, str]]:
    broken = []
    for doc in docs:
        for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
            if re.match(r"[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            linked = doc.parent / file if file else doc
            if not linked.is_file() or anchor and anchor not in {
                    slug(h) for h in re.findall(r"^#+\s+(.*)$", linked.read_text(), re.M)}:
                broken.append((doc.relative_to(root).as_posix(), target))
    return broken


def test_every_relative_link_leads_to_a_file_and_a_heading(tmp_path):
    assert not broken_links(), f"links in the docs that lead nowhere: {broken_links()}"
    (tmp_path / "a.md").write_text("# A\n## 2.1 Kimi Delta Attention (KDA)\n")
    doc = tmp_path / "b.md"
    doc.write_text("[x](a.md#21-kimi-delta-attention-kda) [y](a.md#22-mla) [z](c.md) [w](https://example.org)\n")
    assert broken_links([doc], tmp_path) == [("b.md", "a.md#22-mla"), ("b.md", "c.md")]
