"""Input sources: directories of text files, JSONL (optionally zstd) and Parquet, cut into work units.

A work unit is a deterministic slice of one source that a worker reads on its own:
a group of text files (one document per file), a byte range of a plain ``.jsonl``
file (one document per line; a line belongs to the range holding its first byte),
a whole ``.jsonl.zst`` file, or a whole ``.parquet`` file.

Document ids: the JSONL/Parquet ``id_key`` field when present, else ``<file>:<line>``
(zstd), ``<file>@<byte offset>`` (plain JSONL), ``<file>#<row>`` (Parquet), or the
file's path relative to the source (text files). Text is decoded as UTF-8 with
invalid bytes replaced.

A record whose text field is null (a JSONL `null`, a Parquet null) is a document
without text: the pipeline records it in decisions.jsonl as `no_text`, with its
place, and reads on. A JSONL line that is not JSON, not an object, lacks the
field or holds something else than a string or null stops the prepare with one
line naming the file and line (and the column of bad JSON); so does a Parquet
text column that is missing or not strings (before any work).
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Iterator

from titan_k3.data.prepare.config import SourceConfig

# (document id, raw text or None for a null text field, where: "<file>@<byte>", "<file>:<line>", "<file>#<row>", or
# the text file's path).
Document = tuple[str, "str | None", str]


def _kind(path: Path) -> str:
    name = path.name.lower()
    if name.endswith(".jsonl"):
        return "jsonl"
    if name.endswith((".jsonl.zst", ".jsonl.zstd")):
        return "jsonl.zst"
    if name.endswith(".parquet"):
        return "parquet"
    return "text"


def _files(src: SourceConfig) -> tuple[Path, list[Path]]:
    root = Path(src.path)
    if root.is_file():
        return root.parent, [root]
    files = sorted(
        p for p in root.rglob("*") if p.is_file() and not any(part.startswith(".") for part in p.relative_to(root).parts)
    )
    return root, files


def _check_parquet(path: Path, text_key: str) -> None:
    """A Parquet file's text column exists and holds strings: read from the footer, before any work."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(f"{path}: reading Parquet needs the 'pyarrow' package (pip install pyarrow)") from None
    try:
        schema = pq.read_schema(path)
    except (OSError, pa.ArrowException) as e:
        raise ValueError(f"{path}: not a readable Parquet file ({e})") from None
    if text_key not in schema.names:
        raise ValueError(f"{path}: no column {text_key!r}; columns are {schema.names}")
    typ = schema.field(text_key).type
    if pa.types.is_dictionary(typ):
        typ = typ.value_type
    if not (pa.types.is_string(typ) or pa.types.is_large_string(typ) or getattr(pa.types, "is_string_view", bool)(typ)):
        raise ValueError(f"{path}: column {text_key!r} holds {typ}, expected strings (text_key names the text column)")


def plan_units(src: SourceConfig, unit_bytes: int) -> list[dict]:
    """The source's work units, in a fixed order. A Parquet file whose text column is missing or not text
    is a ValueError here, before any work."""
    root, files = _files(src)
    units: list[dict] = []
    group: list[str] = []
    group_bytes = 0

    def flush():
        nonlocal group, group_bytes
        if group:
            units.append({"kind": "text", "root": str(root), "files": group})
        group, group_bytes = [], 0

    for f in files:
        kind, rel, size = _kind(f), f.relative_to(root).as_posix(), f.stat().st_size
        if kind == "text":
            group.append(rel)
            group_bytes += size
            if group_bytes >= unit_bytes:
                flush()
            continue
        flush()
        if kind == "jsonl":
            for start in range(0, max(size, 1), unit_bytes):
                units.append({"kind": kind, "root": str(root), "files": [rel], "start": start, "end": min(start + unit_bytes, size)})
        else:
            if kind == "parquet":
                _check_parquet(f, src.text_key)
            units.append({"kind": kind, "root": str(root), "files": [rel]})
    flush()
    for k, u in enumerate(units):
        u.update(source=src.name, text_key=src.text_key, id_key=src.id_key, index=k)
    return units


def _record(line: bytes | str, where, text_key: str, id_key: str, default_id: str) -> tuple[str, str | None]:
    """(id, text) of one JSONL line, text None when the line's text field is null; `where()` names the line in
    errors ("FILE line N": called only on an error, as naming a plain JSONL line costs counting the lines before it),
    `default_id` stands in for a missing id."""
    if isinstance(line, bytes):
        # NOTE: json.loads of bytes decodes strictly: one invalid byte stopped the whole prepare with a
        # UnicodeDecodeError naming neither file nor line, where text files and .jsonl.zst replace it.
        line = line.decode("utf-8", errors="replace")
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where()} column {e.colno}: invalid JSON ({e.msg})") from None
    if not isinstance(obj, dict) or text_key not in obj or not (obj[text_key] is None or isinstance(obj[text_key], str)):
        raise ValueError(f"{where()}: expected a JSON object with a string (or null) field {text_key!r}")
    doc_id = obj.get(id_key)
    return (str(doc_id) if doc_id is not None else default_id), obj[text_key]


def _line_of(path: Path, offset: int) -> int:
    """The 1-based number of the line starting at byte `offset` of `path` (counts the newlines before it)."""
    newlines, left = 0, offset
    with open(path, "rb") as f:
        while left > 0:
            chunk = f.read(min(left, 1 << 20))
            if not chunk:
                break
            newlines += chunk.count(b"\n")
            left -= len(chunk)
    return newlines + 1


def _jsonl_range(path: Path, rel: str, start: int, end: int, text_key: str, id_key: str) -> Iterator[Document]:
    with open(path, "rb") as f:
        pos = start
        if start > 0:
            f.seek(start - 1)
            if f.read(1) != b"\n":  # the line in progress belongs to the previous unit
                pos = start + len(f.readline())
        else:
            f.seek(0)
        while pos < end:
            line = f.readline()
            if not line:
                break
            if line.strip():
                doc_id, text = _record(line, lambda: f"{path} line {_line_of(path, pos)}", text_key, id_key,
                                       f"{rel}@{pos}")
                yield doc_id, text, f"{rel}@{pos}"
            pos += len(line)


def _jsonl_zst(path: Path, rel: str, text_key: str, id_key: str) -> Iterator[Document]:
    try:
        import zstandard
    except ImportError:
        raise ValueError(f"{path}: reading .jsonl.zst needs the 'zstandard' package (pip install zstandard)") from None
    with open(path, "rb") as raw:
        reader = io.TextIOWrapper(zstandard.ZstdDecompressor().stream_reader(raw), encoding="utf-8", errors="replace")
        for lineno, line in enumerate(reader, 1):
            if line.strip():
                doc_id, text = _record(line, lambda: f"{path} line {lineno}", text_key, id_key, f"{rel}:{lineno}")
                yield doc_id, text, f"{rel}:{lineno}"


def _parquet(path: Path, rel: str, text_key: str, id_key: str) -> Iterator[Document]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(f"{path}: reading Parquet needs the 'pyarrow' package (pip install pyarrow)") from None
    pf = pq.ParquetFile(path)
    if text_key not in pf.schema_arrow.names:
        raise ValueError(f"{path}: no column {text_key!r}; columns are {pf.schema_arrow.names}")
    columns = [text_key] + ([id_key] if id_key in pf.schema_arrow.names else [])
    row = 0
    for batch in pf.iter_batches(columns=columns):
        texts = batch.column(text_key).to_pylist()
        ids = batch.column(id_key).to_pylist() if len(columns) == 2 else [None] * len(texts)
        for doc_id, text in zip(ids, texts):
            yield (str(doc_id) if doc_id is not None else f"{rel}#{row}"), text, f"{rel}#{row}"
            row += 1


def read_unit(unit: dict) -> Iterator[Document]:
    """Yield (document id, raw text, where) for every document of a work unit, in order; text is None for a
    null text field (JSONL or Parquet), which the pipeline records as a `no_text` decision."""
    root = Path(unit["root"])
    for rel in unit["files"]:
        path = root / rel
        if unit["kind"] == "text":
            yield rel, path.read_bytes().decode("utf-8", errors="replace"), rel
        elif unit["kind"] == "jsonl":
            yield from _jsonl_range(path, rel, unit["start"], unit["end"], unit["text_key"], unit["id_key"])
        elif unit["kind"] == "jsonl.zst":
            yield from _jsonl_zst(path, rel, unit["text_key"], unit["id_key"])
        else:
            yield from _parquet(path, rel, unit["text_key"], unit["id_key"])
