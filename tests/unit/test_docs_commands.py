"""Every command line the documentation shows runs a module or script of the repository with flags it defines.

`python -m titan_k3.X ...` and `python benchmarks/X.py ...`: the module (or package) exists and every `--flag` shown
is a string literal of its source (argparse's `add_argument("--flag", ...)`); `--section.key` overrides are config
keys (test_docs_config_keys.py) and what follows ` -- ` is another command's. Every flag service/README.md names is
one of `python -m service` (service/settings.py), torchrun's own aside.
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", REPO / "deploy/README.md", REPO / "service/README.md",
        REPO / "titan_k3/checkpoint/README.md", *sorted((REPO / "docs").glob("*.md"))]
COMMAND = re.compile(r"python3? (?:-m ((?:titan_k3|service)[\w.]*)|(benchmarks/\w+\.py))([^`\n]*)")
FLAG = re.compile(r"(?<![\w.-])--[a-z][\w-]*(?![\w.-])")
TORCHRUN = {"--standalone", "--nproc_per_node"}


def source(module: str | None, script: str | None, root: Path = REPO) -> str | None:
    """The text of the module's file, or of every file of its package; None when neither exists."""
    if script:
        path = root / script
        return path.read_text() if path.is_file() else None
    path = root / module.replace(".", "/")
    if path.is_dir():
        return "\n".join(p.read_text() for p in sorted(path.rglob("*.py")))
    return path.with_suffix(".py").read_text() if path.with_suffix(".py").is_file() else None


def commands(docs: list[Path] = DOCS, root: Path = REPO) -> list[tuple[str, str, list[str]]]:
    """(document, module or script, flags) of every command shown, continuation lines joined."""
    found = []
    for doc in docs:
        text = doc.read_text().replace("\\\n", " ")
        for match in COMMAND.finditer(text):
            module, script, rest = match.groups()
            rest = rest.split("#")[0].split(" -- ")[0]
            flags = [f for f in FLAG.findall(rest) if f != "--help"]
            found.append((doc.relative_to(root).as_posix(), module or script, flags))
    return found


def undefined(docs: list[Path] = DOCS, root: Path = REPO) -> list[tuple[str, str, str]]:
    wrong = []
    for doc, command, flags in commands(docs, root):
        text = source(*((command, None) if command.startswith(("titan_k3", "service")) else (None, command)), root)
        if text is None:
            wrong.append((doc, command, "no such module or script"))
        else:
            wrong += [(doc, command, flag) for flag in flags if f'"{flag}"' not in text]
    return wrong


def test_every_command_the_docs_show_exists_with_its_flags():
    assert len(commands()) > 20, "the docs show few commands: the pattern is wrong"
    wrong = undefined()
    assert not wrong, f"commands in the docs whose module or flag does not exist: {wrong}"


def test_every_flag_the_service_readme_names_is_the_services():
    text = (REPO / "service/README.md").read_text()
    named = set(FLAG.findall(text)) - TORCHRUN
    assert {"--state-dir", "--grace-seconds", "--read-auth"} <= named, "the pattern is wrong"
    defined = source("service", None)
    assert not sorted(f for f in named if f'"{f}"' not in defined), "service/README.md names flags the service lacks"


def test_a_missing_flag_and_a_missing_module_are_found(tmp_path):
    (tmp_path / "titan_k3/tools").mkdir(parents=True)
    (tmp_path / "titan_k3/tools/x.py").write_text('p.add_argument("--out")\n')
    doc = tmp_path / "x.md"
    doc.write_text("```\npython -m titan_k3.tools.x --out DIR \\\n    --outt DIR   # --nowhere\n```\n"
                   "`python -m titan_k3.tools.y --help`, `python -m titan_k3.tools.x --out D -- --job.name x --z`\n")
    assert undefined([doc], tmp_path) == [("x.md", "titan_k3.tools.x", "--outt"),
                                         ("x.md", "titan_k3.tools.y", "no such module or script")]
