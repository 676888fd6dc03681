"""Request and response bodies (they also make the OpenAPI schema)."""

from __future__ import annotations

import math
import re
from typing import Annotated, Any, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StringConstraints, ValidationError, WrapValidator
from pydantic_core import PydanticCustomError

from service.names import OVERRIDE_KEY_RE, RECIPE_RE, RUN_ID_MAX, RUN_ID_PATTERN

_JSON_KINDS = {list: "an array", dict: "an object", type(None): "null"}


def _one_value_error(value: Any, handler):
    """One error for a value outside the union (pydantic reports one per member, the first 'a valid boolean')."""
    try:
        value = handler(value)
    except ValidationError:
        kind = _JSON_KINDS.get(type(value), type(value).__name__)
        raise ValueError(f"an override is a string, number or boolean, not {kind}") from None
    if isinstance(value, float) and not math.isfinite(value):
        # NOTE: Python's JSON parser takes NaN and Infinity, which JSON has not, and 1e400 as inf: a key the trainer
        # reads as text (job.description) took them as "nan" and "inf"
        raise PydanticCustomError("finite_number", "Input should be a finite number")
    if isinstance(value, str) and any("\ud800" <= c <= "\udfff" for c in value):
        # NOTE: pydantic refuses an escaped lone surrogate in a str field, not in a dict's values: as the fields do
        raise PydanticCustomError("string_unicode", "Input should be a valid string, unable to parse raw data as a "
                                                    "unicode string")
    return value


# NOTE: no JsonInt here: an override reaches the trainer as command-line text, where 1.0 stays "1.0" and an integer
# key refuses it as a TOML file's `steps = 1.0` is refused (taken as 1, it would pass here and not in the file)
OverrideValue = Annotated[Union[bool, int, float, str], WrapValidator(_one_value_error)]
OverrideKey = Annotated[str, StringConstraints(pattern=OVERRIDE_KEY_RE.pattern, max_length=200)]


def _json_int(value: Any) -> Any:
    """A JSON number of integral value (1.0, 2e0) as that integer: JSON Schema's integer, which the OpenAPI schema
    says, counts it as one, and strict pydantic refused it. A boolean, a string, 1.5 and NaN/Infinity (1e400 is read
    as inf) stay strict pydantic's to refuse, the field's bounds its to check. Past 2**53, where a double holds no
    longer every integer, the float is left as it came (refused as no integer, echoed as written, not in 300 digits)."""
    if isinstance(value, float) and value.is_integer() and abs(value) <= 2**53:
        return int(value)
    return value


# Every integer of a request body (the body is strict: `true` and "2" are no integers).
JsonInt = Annotated[int, BeforeValidator(_json_int)]


_QUERY_INT = re.compile(r"-?(0|[1-9][0-9]*)")


def _query_int(value: Any) -> Any:
    """A query integer as JSON writes one: lax pydantic also took ' 5', '5.0', '+5' and '1_0' (as 10)."""
    if isinstance(value, str) and not _QUERY_INT.fullmatch(value):
        raise PydanticCustomError("int_parsing", "Input should be a valid integer, unable to parse string as an "
                                                 "integer")
    return value


def _query_bool(value: Any) -> Any:
    """A query boolean as JSON writes one: lax pydantic also took 1, 0, yes, no, on, off, t, f, y, n (any case)."""
    if isinstance(value, str) and value not in ("true", "false"):
        raise PydanticCustomError("bool_parsing", "Input should be true or false")
    return value


# NOTE: query parameters arrive as text, so pydantic cannot be strict about them as about the body: these take only
# the text of a value the schema's type allows (the fuzzing test holds the service to its schema). Each goes after
# the parameter's Query(...) in its Annotated: before it, FastAPI writes ge/le into the schema under those names.
QUERY_INT = BeforeValidator(_query_int)
QUERY_BOOL = BeforeValidator(_query_bool)


class RunCreate(BaseModel):
    # strict: the schema's integer refuses `true` and "2" (lax pydantic took them as 1 and 2), and the
    # fuzzing test holds the service to its schema; its integers are JsonInt, which takes 1.0 as the schema does
    model_config = ConfigDict(extra="forbid", strict=True)

    name: str | None = Field(None, max_length=RUN_ID_MAX, pattern=RUN_ID_PATTERN,
                             description="Run id and directory name; generated when absent.", examples=["pilot-a"])
    recipe: str | None = Field(None, max_length=300, pattern=RECIPE_RE.pattern,
                               description="Recipe name under tomls/ (without .toml).", examples=["smoke"])
    toml: str | None = Field(None, max_length=262144, description="Inline TOML text instead of a recipe.")
    overrides: dict[OverrideKey, OverrideValue] = Field(
        default_factory=dict, max_length=256,
        description="CLI overrides as {'section.key': value}; job.config_file, job.dump_folder, job.name, "
                    "job.validate_only, compile.cache_dir, checkpoint.save_on_stop and metrics.prometheus_host are "
                    "the service's.",
        examples=[{"model.flavor": "debug", "training.steps": 6}])
    nproc_per_node: JsonInt = Field(1, ge=1, le=64, description="torchrun processes per node: at most `gpus`, or the "
                                                              "host's CPU cores for a run without GPUs.")
    gpus: JsonInt = Field(0, ge=0, le=64, description="GPUs wanted (at most the service's); the run waits in the queue "
                                                  "until they are free. 0: CPU (debug and tiny flavors only).")
    restart_limit: JsonInt = Field(2, ge=0, le=100, description="Relaunches after a crash before the run is failed.")


class AttemptOut(BaseModel):
    n: int
    pid: int
    started_at: float
    ended_at: float | None
    exit_code: int | None
    gpus: list[int]


class RunOut(BaseModel):
    id: str
    state: str
    message: str
    recipe: str
    overrides: dict[str, str]
    nproc_per_node: int
    gpus: int
    assigned_gpus: list[int]
    restart_limit: int
    restarts: int
    restarts_total: int
    created_at: float
    updated_at: float
    run_dir: str = Field(description="The run directory, relative to the service's state directory.")
    attempts: list[AttemptOut]
    exit_codes: list[int | None]
    step: int = Field(description="Updates done as the run directory records them: the latest checkpoint's, or the "
                                  "last logged one when the current attempt has logged since it started.")
    checkpoint_step: int | None = Field(description="Update held by checkpoints/latest; null without one.")
    latest_checkpoint: str | None
    latest_metrics: dict[str, float | None]
    invariant_violations: dict[str, Any] = Field(description="total and by_check over every attempt of the run; "
                                                             "recent: the current attempt's latest")
    events: dict[str, int] = Field(description="Events by kind over every attempt of the run.")
    registry_error: str | None = Field(None, description="Why the service could not record the run's last change "
                                                         "(the registry refused the write; it is retried): its state "
                                                         "may be behind its processes meanwhile. Null when none.")


class Health(BaseModel):
    status: str = Field(description="'ok', or 'degraded' while `problems` lists any")
    runs: int
    gpus_total: int
    gpus_used: int
    problems: list[str] = Field(default_factory=list, description="Changes the registry refused to record (being "
                                                                  "retried), a supervisor pass that failed, and one "
                                                                  "that has run too long")
    seconds_since_pass: float | None = Field(
        None, description="Seconds since the supervisor last ended a pass (one runs every 0.25 s; null before it "
                          "starts): past twice the registry's longest wait for SQLite's lock (60 s), `problems` "
                          "names a pass stuck")


class ErrorOut(BaseModel):
    detail: str


class Deleted(BaseModel):
    id: str
    files_removed: bool
