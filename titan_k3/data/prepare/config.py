"""Prepare configuration: nested dataclasses, a TOML file and ``--section.key value`` overrides.

Example ``data.toml``::

    output = "data/web-code"
    tokenizer = "embedded"          # or a tokenizer.json / tiktoken file
    workers = 2

    [[sources]]
    name = "web"
    path = "raw/web"                # a directory of text / .jsonl / .jsonl.zst / .parquet files, or one file
    weight = 0.7

    [[sources]]
    name = "code"
    path = "raw/code.jsonl.zst"
    weight = 0.3
    filters = { min_alpha_ratio = 0.3 }   # per-source threshold overrides

    [filters]
    min_chars = 200

    [near_dedup]
    threshold = 0.8

    [decontamination]
    benchmarks = ["evals/hellaswag.jsonl"]
    n = 13

Relative paths are relative to the working directory.
On the CLI every scalar key can be given as ``--key value`` or ``--section.key value``
(CLI > TOML > defaults) and sources as ``--source NAME=PATH[:WEIGHT]``.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import operator
from dataclasses import dataclass, field
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib


@dataclass
class SourceConfig:
    name: str
    """Source name, used in shards, the index and the mixture."""
    path: str
    """A directory (searched recursively) or a single input file."""
    weight: float = 1.0
    """Mixture weight recorded in the index: training takes it when data.mixture is empty (unless all are alike)."""
    text_key: str = "text"
    """JSONL / Parquet field holding the document text."""
    id_key: str = "id"
    """JSONL / Parquet field holding the document id (else file:line or file@offset)."""
    filters: dict = field(default_factory=dict)
    """Overrides of [filters] thresholds for this source."""


@dataclass
class FilterConfig:
    min_chars: int = 200
    """too_short: fewer normalised characters than this."""
    min_words: int = 30
    """too_short: fewer words than this."""
    min_alpha_ratio: float = 0.55
    """low_quality: letters / non-space characters below this."""
    max_digit_ratio: float = 0.25
    """low_quality: digits / non-space characters above this."""
    max_dup_ngram_frac: float = 0.35
    """low_quality: fraction of word 3-grams repeating an earlier one above this."""
    max_dup_line_frac: float = 0.4
    """low_quality: fraction of non-empty lines repeating an earlier line above this."""
    min_mean_line_chars: float = 8.0
    """low_quality: mean non-empty line length below this."""


@dataclass
class NearDedupConfig:
    enable: bool = True
    """MinHash + LSH near-duplicate removal."""
    threshold: float = 0.8
    """Jaccard similarity of word shingles at or above which a document is a near duplicate."""
    num_perm: int = 128
    """MinHash permutations."""
    shingle: int = 5
    """Words per shingle."""


@dataclass
class DecontaminationConfig:
    benchmarks: list = field(default_factory=list)
    """JSONL files of {"context": str, "choices": [str], "gold": int}; the file stem names the benchmark."""
    n: int = 13
    """Word n-gram length for overlap."""


@dataclass
class PrepareConfig:
    output: str = "data/prepared"
    """Output dataset directory (index.json, shards, decisions.jsonl, report.md): new or empty, apart from the sources."""
    tokenizer: str = "embedded"
    """'embedded', an HF tokenizer.json or a tiktoken BPE file."""
    workers: int = 2
    """Worker processes for the parallel stages."""
    unit_mb: float = 16.0
    """Input work-unit size in MB (text files are grouped, plain JSONL files split)."""
    shard_mb: float = 64.0
    """Normalised text per output shard in MB."""
    validation_fraction: float = 0.005
    """Fraction of accepted documents (by content hash) held out as the validation split."""
    sources: list = field(default_factory=list)
    """[[sources]] tables: name, path, weight, text_key, id_key, filters."""
    filters: FilterConfig = field(default_factory=FilterConfig)
    near_dedup: NearDedupConfig = field(default_factory=NearDedupConfig)
    decontamination: DecontaminationConfig = field(default_factory=DecontaminationConfig)

    def fingerprint(self) -> str:
        """sha256 of the settings that change the output's content (not `workers`, not `output`)."""
        d = dataclasses.asdict(self)
        d.pop("workers")
        d.pop("output")
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()


def _fields(cls) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls)}


def _coerce(key: str, value, default):
    if isinstance(default, bool):
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
            return value.lower() in ("true", "1")
        if isinstance(value, bool):
            return value
        raise ValueError(f"{key}={value!r}: expected true or false")
    for typ in (int, float):
        if isinstance(default, typ):
            try:
                out = typ(value)
            except (TypeError, ValueError):
                raise ValueError(f"{key}={value!r}: expected {typ.__name__}") from None
            if isinstance(value, float) and typ is int and out != value:
                raise ValueError(f"{key}={value!r}: expected int")
            return out
    if isinstance(default, list):
        return value if isinstance(value, list) else [v for v in str(value).split(",") if v]
    if not isinstance(value, str):
        raise ValueError(f"{key}={value!r}: expected a string")
    return value


def _set(obj, key: str, value) -> None:
    section, _, name = key.rpartition(".")
    target = obj
    if section:
        if section not in _fields(type(obj)) or not dataclasses.is_dataclass(getattr(obj, section)):
            raise ValueError(f"{key}: unknown section {section!r}{_suggest(section, _sections(obj))}")
        target = getattr(obj, section)
    names = _fields(type(target))
    if name not in names or dataclasses.is_dataclass(getattr(target, name)) or name == "sources":
        allowed = [n for n in names if not dataclasses.is_dataclass(getattr(target, n)) and n != "sources"]
        raise ValueError(f"{key}: unknown key{_suggest(name, allowed)}; allowed: {allowed}")
    setattr(target, name, _coerce(key, value, getattr(target, name)))


def _sections(obj) -> list[str]:
    return [n for n in _fields(type(obj)) if dataclasses.is_dataclass(getattr(obj, n))]


def _suggest(name: str, options) -> str:
    close = difflib.get_close_matches(name, list(options), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _source(raw: dict, where: str) -> SourceConfig:
    allowed = _fields(SourceConfig)
    for k in raw:
        if k not in allowed:
            raise ValueError(f"{where}.{k}: unknown key{_suggest(k, allowed)}; allowed: {list(allowed)}")
    for k in ("name", "path"):
        if k not in raw:
            raise ValueError(f"{where}: missing required key {k!r}")
    src = SourceConfig(**raw)
    for k, v in src.filters.items():
        if k not in _fields(FilterConfig):
            raise ValueError(f"{where}.filters.{k}: unknown filter{_suggest(k, _fields(FilterConfig))}")
        src.filters[k] = _coerce(f"{where}.filters.{k}", v, getattr(FilterConfig(), k))
    return src


def load_config(config_file: str | None, overrides: dict[str, str], cli_sources: list[str]) -> PrepareConfig:
    """Defaults < TOML file < CLI. Raises ValueError naming the key for anything unknown or invalid."""
    cfg = PrepareConfig()
    if config_file:
        path = Path(config_file)
        if not path.is_file():
            raise ValueError(f"--config {config_file!r}: no such file")
        with open(path, "rb") as f:
            raw = tomllib.load(f)
        for i, s in enumerate(raw.pop("sources", [])):
            cfg.sources.append(_source(s, f"sources[{i}]"))
        for k, v in raw.items():
            if isinstance(v, dict):
                for kk, vv in v.items():
                    _set(cfg, f"{k}.{kk}", vv)
            else:
                _set(cfg, k, v)
    for spec in cli_sources:
        name, eq, rest = spec.partition("=")
        if not eq or not name or not rest:
            raise ValueError(f"--source {spec!r}: expected NAME=PATH[:WEIGHT]")
        path, colon, weight = rest.rpartition(":") if ":" in rest else (rest, "", "")
        try:
            w = float(weight) if colon else 1.0
        except ValueError:
            path, w = rest, 1.0
        cfg.sources.append(SourceConfig(name=name, path=path, weight=w))
    for k, v in overrides.items():
        _set(cfg, k, v)
    validate(cfg)
    return cfg


def validate(cfg: PrepareConfig) -> None:
    if not cfg.sources:
        raise ValueError("sources: none given; add [[sources]] tables or --source NAME=PATH[:WEIGHT]")
    names = [s.name for s in cfg.sources]
    if len(set(names)) != len(names):
        raise ValueError(f"sources: duplicate names in {names}")
    for s in cfg.sources:
        if not s.name.replace("_", "").replace("-", "").isalnum():
            raise ValueError(f"sources.name={s.name!r}: use letters, digits, '-' and '_' only")
        if not Path(s.path).exists():
            raise ValueError(f"sources[{s.name}].path={s.path!r}: no such file or directory")
        if not (s.weight >= 0):
            raise ValueError(f"sources[{s.name}].weight={s.weight}: must be >= 0")
    checks = [
        ("workers", cfg.workers >= 1, ">= 1"),
        ("unit_mb", cfg.unit_mb > 0, "> 0"),
        ("shard_mb", cfg.shard_mb > 0, "> 0"),
        ("validation_fraction", 0 <= cfg.validation_fraction < 1, "in [0, 1)"),
        ("near_dedup.threshold", 0 < cfg.near_dedup.threshold <= 1, "in (0, 1]"),
        ("near_dedup.num_perm", cfg.near_dedup.num_perm >= 16, ">= 16"),
        ("near_dedup.shingle", cfg.near_dedup.shingle >= 1, ">= 1"),
        ("decontamination.n", cfg.decontamination.n >= 1, ">= 1"),
    ]
    for key, ok, allowed in checks:
        if not ok:
            value = operator.attrgetter(key)(cfg)
            raise ValueError(f"{key}={value!r}: must be {allowed}")
    for b in cfg.decontamination.benchmarks:
        if not Path(b).is_file():
            raise ValueError(f"decontamination.benchmarks: {b!r} is not a file")
