"""The registry of model families: `register_model(ModelSpec(...))`, `get_model_spec(name)`.

The trainer looks a model up here by `model.name` and uses nothing else of it.
Every family registered must have its shapes in titan_k3/spec.py (the table
the torch-free config checks read), and the reverse; `register_model` checks
the first, tests/unit/test_model_registry.py the second.
"""

from __future__ import annotations

from titan_k3.config.errors import toml_value
from titan_k3.models.k3.bundle import K3_MODEL_SPEC
from titan_k3.models.model_spec import ModelSpec
from titan_k3.spec import MODEL_FLAVORS

_REGISTRY: dict[str, ModelSpec] = {}


def register_model(spec: ModelSpec) -> None:
    """Add a family; its name and flavor names must be the ones titan_k3/spec.py lists for it."""
    if spec.name in _REGISTRY:
        raise ValueError(f"model {spec.name!r} is registered already")
    if sorted(spec.flavors) != sorted(MODEL_FLAVORS.get(spec.name, {})):
        raise ValueError(f"model {spec.name!r}: flavors {sorted(spec.flavors)} differ from titan_k3/spec.py's "
                         f"{sorted(MODEL_FLAVORS.get(spec.name, {}))}")
    _REGISTRY[spec.name] = spec


def get_model_spec(name: str) -> ModelSpec:
    if name not in _REGISTRY:
        raise ValueError(f"config key 'model.name' = {toml_value(name)}: no such model; registered: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name]


def registered_models() -> list[str]:
    return sorted(_REGISTRY)


register_model(K3_MODEL_SPEC)
