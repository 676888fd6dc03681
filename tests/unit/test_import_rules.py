"""The walls between packages (docs/architecture.md, "Import rules"), read from the source with `ast`.

Every `import` counts, also one inside a function: a deferred import still ties
the two modules together, it only hides the tie until that function runs.
Imports under `if TYPE_CHECKING:` are left out (they never run).
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("titan_k3", "kernels", "service")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@cache
def _sources() -> dict[str, Path]:
    """Every module of our packages: dotted name -> file."""
    return {_module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def _is_package(name: str) -> bool:
    return _sources()[name].name == "__init__.py"


def _under_type_checking(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return True
    return False


@cache
def _raw_imports(name: str) -> tuple[tuple[str, str | None], ...]:
    """(module, imported name or None for `import module`) for each import in `name`, relative ones resolved."""
    path = _sources()[name]
    tree = ast.parse(path.read_text(), str(path))
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    package = name if _is_package(name) else name.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if _under_type_checking(node, parents):
            continue
        if isinstance(node, ast.Import):
            found += [(alias.name, None) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found += [(base, alias.name) for alias in node.names]
    return tuple(found)


def _resolve(module: str, attr: str | None, seen: frozenset = frozenset()) -> str:
    """The module that really provides `attr` of `module` (a submodule, or the source of a package re-export)."""
    if attr is None or module not in _sources():
        return module
    if f"{module}.{attr}" in _sources():
        return f"{module}.{attr}"
    if _is_package(module) and module not in seen:
        for source, name in _raw_imports(module):
            if name == attr:
                return _resolve(source, name, seen | {module})
    return module


@cache
def imports_of(name: str) -> frozenset[str]:
    """Modules `name` imports: ours resolved to the providing module, third-party ones by their top-level name."""
    out = set()
    for module, attr in _raw_imports(name):
        if module.split(".")[0] in PACKAGES:
            out.add(_resolve(module, attr))
        else:
            out.add(module.split(".")[0])
    out.discard(name)
    return frozenset(out)


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _ours(name: str) -> list[str]:
    return [m for m in _sources() if _within(m, name)]


@cache
def imports_torch(name: str, stack: frozenset = frozenset()) -> bool:
    """Whether importing `name` (with everything it imports, at any depth) imports torch."""
    deps = imports_of(name)
    if "torch" in deps:
        return True
    return any(imports_torch(d, stack | {name}) for d in deps if d in _sources() and d not in stack | {name})


def _breaks(modules: list[str], forbidden) -> list[str]:
    return sorted(f"{m} imports {d}" for m in modules for d in imports_of(m) if forbidden(d))


def test_the_walker_sees_deferred_and_re_exported_imports():
    # NOTE: the rules below are only as good as the walker: it must see an import inside a function
    # and follow a name re-exported by a package __init__ to the module that defines it.
    assert "torch" in imports_of("titan_k3.train")
    assert "titan_k3.config.job_config" in imports_of("titan_k3.config")
    assert any(_within(d, "titan_k3.data") for d in imports_of("titan_k3.train"))


def test_kernels_import_nothing_of_titan_k3_or_service():
    assert _breaks(_ours("kernels"), lambda d: _within(d, "titan_k3") or _within(d, "service")) == []


def test_titan_k3_never_imports_service():
    assert _breaks(_ours("titan_k3"), lambda d: _within(d, "service")) == []


def test_service_never_imports_torch():
    assert _breaks(_ours("service"), lambda d: d == "torch" or (d in _sources() and imports_torch(d))) == []


def test_config_is_torch_free_and_knows_no_model():
    assert _breaks(_ours("titan_k3.config"), lambda d: d == "torch" or _within(d, "titan_k3.models")) == []
    assert [m for m in _ours("titan_k3.config") if imports_torch(m)] == []


def test_models_know_nothing_of_parallel_optim_data_or_service():
    # NOTE: a family's bundle.py is the glue that hands the model to the trainer (its step hooks reach the
    # optimizer side: QK-Clip); every other module of titan_k3.models is model code and stays below the walls.
    model_code = [m for m in _ours("titan_k3.models") if not m.endswith(".bundle")]
    walls = ("titan_k3.parallel", "titan_k3.optim", "titan_k3.data", "service")
    assert _breaks(model_code, lambda d: any(_within(d, w) for w in walls)) == []
    bundles = [m for m in _ours("titan_k3.models") if m.endswith(".bundle")]
    assert bundles and _breaks(bundles, lambda d: any(_within(d, w) for w in walls[2:])) == []


def test_the_trainer_and_eval_reach_a_model_only_through_the_registry():
    # NOTE: the trainer and evaluation (offline, and in training) pick a family by `model.name` and use only
    # its ModelSpec (build, batch inputs), so adding a family touches its own folder and one register_model
    # call, never the trainer or the evaluator.
    users = ["titan_k3.train"] + _ours("titan_k3.eval")
    registry = ("titan_k3.models.registry", "titan_k3.models.model_spec")
    assert "titan_k3.eval.offline" in users and "titan_k3.eval.validation" in users
    assert _breaks(users, lambda d: _within(d, "titan_k3.models") and d not in registry) == []
    assert all("titan_k3.models.registry" in imports_of(m) for m in ("titan_k3.train", "titan_k3.eval.offline"))


def _cycles() -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    graph = {m: sorted(d for d in imports_of(m) if d in _sources()) for m in _sources()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for m in graph:
        if m not in index:
            visit(m)
    return found


def test_no_import_cycles():
    assert _cycles() == []


@pytest.mark.parametrize("rule", ["cycle", "wall"])
def test_a_break_is_caught(rule, monkeypatch):
    # NOTE: the same checks on a doctored graph must fail, or the rules above could pass vacuously.
    real = imports_of.__wrapped__
    extra = {"cycle": ("titan_k3.config.job_config", "titan_k3.config.manager"),
             "wall": ("kernels.device", "titan_k3.config.job_config")}[rule]
    doctored = cache(lambda name: real(name) | {extra[1]} if name == extra[0] else real(name))
    monkeypatch.setitem(globals(), "imports_of", doctored)
    if rule == "cycle":
        assert ["titan_k3.config.job_config", "titan_k3.config.manager"] in [
            [m for m in c if m in extra] for c in _cycles()
        ]
    else:
        assert _breaks(_ours("kernels"), lambda d: _within(d, "titan_k3")) != []
