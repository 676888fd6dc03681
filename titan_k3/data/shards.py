"""The binary shard format and the dataset index.

A prepared dataset is a directory::

    index.json                      format version, tokenizer identity, dtype, splits, sources
    <split>-<source>-NNNNN.bin      token ids of whole documents, each ending with EOS
                                    (uint16 if vocab <= 65535 else uint32, little-endian)
    <split>-<source>-NNNNN.idx.npy  int64 [n_docs + 1] document offsets into the .bin
    <split>-<source>-NNNNN.docs.jsonl   optional provenance, one line per document

Every shard holds documents of one source and one split, so the loader can
build a per-source stream without per-document source tags.

index.json::

    {"format": "titan_k3-shards", "version": 1,
     "tokenizer": {"name", "sha256", "vocab_size", "eos_id"},
     "dtype": "uint16",
     "splits": {"train": {"shards": [{"file", "offsets", "docs"?, "source", "n_tokens",
                                      "n_docs", "sha256", "offsets_sha256"}, ...]}, ...},
     "sources": [{"name", "n_docs", "n_tokens"}, ...]}        (totals over all splits)

Every file is written under a temporary name and renamed, so a reader never sees a
half-written shard. `open_dataset` checks the index's keys and types, sizes and offsets always, and sha256
when asked (by default for datasets under 256 MiB), and raises ValueError naming
the shard and what is wrong.

Does not import torch.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from titan_k3.data.bpe import Tokenizer, file_sha256
from titan_k3.values import is_integer, is_number

FORMAT = "titan_k3-shards"
VERSION = 1
INDEX_NAME = "index.json"
_AUTO_SHA_BYTES = 256 << 20


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (vocab <= 65535), else uint32; little-endian."""
    return np.dtype("<u2") if vocab_size <= 65535 else np.dtype("<u4")


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_shard(
    out_dir: str | os.PathLike,
    stem: str,
    docs: Sequence[np.ndarray],
    *,
    source: str,
    dtype: np.dtype,
    provenance: Sequence[dict] | None = None,
) -> dict:
    """Write one shard (`stem`.bin + `stem`.idx.npy [+ `stem`.docs.jsonl]) atomically.

    Args:
        docs: token-id arrays, each already ending with EOS.
        provenance: one JSON-able dict per document (source, id, content hash...).
    Returns:
        The shard's index record.
    """
    out_dir = Path(out_dir)
    if provenance is not None and len(provenance) != len(docs):
        raise ValueError(f"shard {stem}: {len(provenance)} provenance records for {len(docs)} documents")
    lengths = np.fromiter((len(d) for d in docs), dtype=np.int64, count=len(docs))
    offsets = np.zeros(len(docs) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    tokens = np.concatenate([np.asarray(d) for d in docs]) if docs else np.zeros(0, dtype)
    if tokens.size and int(tokens.max()) > np.iinfo(dtype).max:
        raise ValueError(f"shard {stem}: token id {int(tokens.max())} does not fit {np.dtype(dtype).name}")
    bin_name, idx_name = f"{stem}.bin", f"{stem}.idx.npy"
    _atomic_write_bytes(out_dir / bin_name, tokens.astype(dtype, copy=False).tobytes())
    idx_tmp = out_dir / f"{idx_name}.tmp{os.getpid()}"
    with open(idx_tmp, "wb") as f:
        np.save(f, offsets)
    os.replace(idx_tmp, out_dir / idx_name)
    record = {
        "file": bin_name,
        "offsets": idx_name,
        "source": source,
        "n_tokens": int(offsets[-1]),
        "n_docs": len(docs),
        "sha256": file_sha256(out_dir / bin_name),
        "offsets_sha256": file_sha256(out_dir / idx_name),
    }
    if provenance is not None:
        docs_name = f"{stem}.docs.jsonl"
        lines = "".join(json.dumps(p, sort_keys=True) + "\n" for p in provenance)
        _atomic_write_bytes(out_dir / docs_name, lines.encode())
        record["docs"] = docs_name
    return record


def write_index(
    out_dir: str | os.PathLike, tokenizer: Tokenizer, splits: dict[str, list[dict]], **extra
) -> Path:
    """Write index.json atomically from per-split shard records; sources are totalled here."""
    out_dir = Path(out_dir)
    totals: dict[str, dict] = {}
    for records in splits.values():
        for r in records:
            t = totals.setdefault(r["source"], {"name": r["source"], "n_docs": 0, "n_tokens": 0})
            t["n_docs"] += r["n_docs"]
            t["n_tokens"] += r["n_tokens"]
    index = {
        "format": FORMAT,
        "version": VERSION,
        "tokenizer": {
            "name": tokenizer.name,
            "sha256": tokenizer.sha256,
            "vocab_size": tokenizer.vocab_size,
            "eos_id": tokenizer.eos_id,
        },
        "dtype": token_dtype(tokenizer.vocab_size).name,
        "splits": {name: {"shards": records} for name, records in splits.items()},
        "sources": [totals[k] for k in sorted(totals)],
        **extra,
    }
    path = out_dir / INDEX_NAME
    _atomic_write_bytes(path, (json.dumps(index, indent=1, sort_keys=True) + "\n").encode())
    return path


@dataclass
class Shard:
    """One opened shard: `tokens` is a read-only memmap, `offsets` int64 [n_docs + 1]."""

    name: str
    source: str
    tokens: np.ndarray
    offsets: np.ndarray

    @property
    def n_docs(self) -> int:
        return len(self.offsets) - 1


@dataclass
class Dataset:
    """An opened, verified dataset directory."""

    path: Path
    index: dict
    shards: dict[str, list[Shard]]

    @property
    def source_names(self) -> list[str]:
        return [s["name"] for s in self.index["sources"]]

    def check_tokenizer(self, name: str, sha256: str) -> None:
        """ValueError naming both when the dataset was built with another tokenizer than (`name`, `sha256`): what
        `open_dataset` checks of a tokenizer it is given, for a caller that has only its identity (no tokenizer built)."""
        _check_tokenizer(self.path, self.index, name, sha256)

    def split_shards(self, split: str) -> list[Shard]:
        if split not in self.shards:
            raise ValueError(f"split={split!r}: not in dataset {str(self.path)!r}; have {sorted(self.shards)}")
        return self.shards[split]

    def sources_with_documents(self, split: str) -> dict[str, list[Shard]]:
        """{source: its shards holding documents} of `split`; ValueError when the split holds none."""
        by_source: dict[str, list[Shard]] = {}
        for shard in self.split_shards(split):
            if shard.n_docs:
                by_source.setdefault(shard.source, []).append(shard)
        if not by_source:
            raise ValueError(f"split={split!r} of dataset {str(self.path)!r}: no documents")
        return by_source

    def prepared_weights(self, split: str) -> dict[str, float] | None:
        """The source weights `python -m titan_k3.data.prepare` recorded (its config's [[sources]] weight) for the
        sources `split` has documents of, or None where it recorded none or all alike (prepare's default weight is
        1.0 for every source); ValueError when a source weighted above 0 has no documents in `split`.

        NOTE: an empty data.mixture trains on these, so that weights written in the prepare config are not dropped
        without a word; weights all alike say nothing, and those datasets keep their natural token proportions.
        Prepare records a weight for every configured source, also one whose documents were all filtered out (or
        whose files were empty): spreading its weight over the others would train on a mixture nobody asked for,
        so the run stops instead and says how to choose one.
        """
        recorded = self.index.get("mixture")
        if not recorded or len(set(recorded.values())) <= 1:
            return None
        by_source = self.sources_with_documents(split)
        empty = {name: w for name, w in recorded.items() if name not in by_source and w > 0}
        if empty:
            listed = ", ".join(f"{name!r} (weight {w:g})" for name, w in sorted(empty.items()))
            raise ValueError(
                f"dataset {str(self.path)!r} was prepared with weights for source(s) {listed} that have no documents "
                f"in split {split!r}; set data.mixture to weights of the sources it has: {sorted(by_source)}"
            )
        return {name: w for name, w in recorded.items() if name in by_source}


def _check_tokenizer(root: Path, index: dict, name: str, sha256: str) -> None:
    if index["tokenizer"]["sha256"] != sha256:
        raise ValueError(
            f"dataset {str(root)!r}: built with tokenizer {index['tokenizer']['name']!r} "
            f"(sha256 {index['tokenizer']['sha256'][:12]}...), but the tokenizer given is "
            f"{name!r} (sha256 {sha256[:12]}...)"
        )


def _open_shard(root: Path, rec: dict, dtype: np.dtype, verify_sha: bool) -> Shard:
    name = rec["file"]
    bin_path, idx_path = root / name, root / rec["offsets"]
    for p in (bin_path, idx_path):
        if not p.is_file():
            raise ValueError(f"shard {name} in {str(root)!r}: file {p.name} is missing")
    expected = rec["n_tokens"] * dtype.itemsize
    actual = bin_path.stat().st_size
    if actual != expected:
        raise ValueError(
            f"shard {name} in {str(root)!r}: {actual} bytes, index says {rec['n_tokens']} tokens "
            f"x {dtype.itemsize} B = {expected} bytes (truncated or corrupt)"
        )
    if verify_sha:
        for key, p in (("sha256", bin_path), ("offsets_sha256", idx_path)):
            got = file_sha256(p)
            if got != rec[key]:
                raise ValueError(
                    f"shard {name} in {str(root)!r}: {p.name} sha256 {got[:12]}... != index {rec[key][:12]}... (corrupt)"
                )
    try:
        offsets = np.load(idx_path)
    except Exception as e:
        raise ValueError(f"shard {name} in {str(root)!r}: unreadable offsets {idx_path.name} ({e})") from None
    if (
        offsets.ndim != 1
        or len(offsets) != rec["n_docs"] + 1
        or offsets[0] != 0
        or offsets[-1] != rec["n_tokens"]
        or np.any(np.diff(offsets) <= 0)
    ):
        raise ValueError(
            f"shard {name} in {str(root)!r}: offsets do not describe {rec['n_docs']} non-empty "
            f"documents over {rec['n_tokens']} tokens (corrupt)"
        )
    tokens = np.memmap(bin_path, dtype=dtype, mode="r") if expected else np.zeros(0, dtype)
    return Shard(name=name, source=rec["source"], tokens=tokens, offsets=offsets)


def _index_problem(index: dict) -> str | None:
    """The first place where `index` is not what `write_index` writes ("key 'splits.train.shards[0].n_tokens': ..."),
    or None; so that a hand-edited or foreign index stops on one line naming the key, not on a KeyError."""

    def bad(where: str, value, kind: type, what: str) -> str | None:
        ok = is_integer(value) if kind is int else isinstance(value, kind)
        return None if ok else f"key {where!r}: {value!r} is not {what}"

    def fields(where: str, body, spec: dict) -> str | None:
        if not isinstance(body, dict):
            return f"key {where!r}: {body!r} is not a table"
        for key, (kind, what) in spec.items():
            if key not in body:
                return f"key {where + '.' + key!r} is missing"
            problem = bad(f"{where}.{key}", body[key], kind, what)
            if problem:
                return problem
        return None

    missing = [key for key in ("tokenizer", "dtype", "splits", "sources") if key not in index]
    if missing:
        return f"key {missing[0]!r} is missing"
    text, count = (str, "a string"), (int, "an integer")
    problem = fields("tokenizer", index["tokenizer"], {"name": text, "sha256": text, "vocab_size": count, "eos_id": count})
    if problem:
        return problem
    vocab, dtype = index["tokenizer"]["vocab_size"], index["dtype"]
    if vocab < 1 or dtype != token_dtype(vocab).name:
        return f"key 'dtype': {dtype!r}, expected {token_dtype(max(vocab, 1)).name!r} for tokenizer.vocab_size {vocab}"
    splits = index["splits"]
    if not isinstance(splits, dict):
        return f"key 'splits': {splits!r} is not a table of splits"
    record = {"file": text, "offsets": text, "source": text, "n_tokens": count, "n_docs": count, "sha256": text,
              "offsets_sha256": text}
    for split, body in splits.items():
        shards = body.get("shards") if isinstance(body, dict) else None
        if not isinstance(shards, list):
            return f"key 'splits.{split}.shards': {shards!r} is not a list of shard records"
        for i, rec in enumerate(shards):
            where = f"splits.{split}.shards[{i}]"
            problem = fields(where, rec, record)
            if problem:
                return problem
            for key in ("file", "offsets"):
                if Path(rec[key]).name != rec[key] or rec[key] in ("", ".", ".."):
                    return f"key '{where}.{key}': {rec[key]!r} is not a file name in the dataset directory"
            if rec["n_tokens"] < 0 or rec["n_docs"] < 0:
                return f"key '{where}': n_tokens {rec['n_tokens']} and n_docs {rec['n_docs']} must be >= 0"
    sources = index["sources"]
    if not isinstance(sources, list):
        return f"key 'sources': {sources!r} is not a list of sources"
    for i, body in enumerate(sources):
        problem = fields(f"sources[{i}]", body, {"name": text})
        if problem:
            return problem
    mixture = index.get("mixture")
    if mixture is not None and not (isinstance(mixture, dict) and all(
            is_number(w, finite=True) and w >= 0
            for w in mixture.values())):
        return f"key 'mixture': {mixture!r} is not a table of source weights >= 0"
    return None


def open_dataset(
    path: str | os.PathLike, tokenizer: Tokenizer | None = None, verify: str = "auto"
) -> Dataset:
    """Open a dataset directory, checking it against the index (and `tokenizer`, if given).

    Args:
        verify: "size" (sizes and offsets), "sha256" (also content hashes) or "auto"
            (sha256 when the shards total under 256 MiB).
    """
    if verify not in ("auto", "size", "sha256"):
        raise ValueError(f"verify={verify!r}: expected 'auto', 'size' or 'sha256'")
    root = Path(path)
    index_path = root / INDEX_NAME
    if not index_path.is_file():
        raise ValueError(f"dataset {str(root)!r}: no {INDEX_NAME}; expected a prepared dataset directory")
    try:
        index = json.loads(index_path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"dataset {str(root)!r}: {INDEX_NAME} is not valid JSON ({e})") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT or index.get("version") != VERSION:
        got = index if isinstance(index, dict) else {}
        raise ValueError(
            f"dataset {str(root)!r}: format {got.get('format')!r} v{got.get('version')}, "
            f"expected {FORMAT!r} v{VERSION}"
        )
    problem = _index_problem(index)
    if problem:
        raise ValueError(f"dataset {str(root)!r}: {INDEX_NAME} {problem}")
    if tokenizer is not None:
        _check_tokenizer(root, index, tokenizer.name, tokenizer.sha256)
    dtype = np.dtype(index["dtype"]).newbyteorder("<")
    records = [r for split in index["splits"].values() for r in split["shards"]]
    total = sum(r["n_tokens"] for r in records) * dtype.itemsize
    verify_sha = verify == "sha256" or (verify == "auto" and total < _AUTO_SHA_BYTES)
    shards = {
        split: [_open_shard(root, r, dtype, verify_sha) for r in body["shards"]]
        for split, body in index["splits"].items()
    }
    return Dataset(path=root, index=index, shards=shards)


def iter_documents(dataset: Dataset, split: str) -> Iterable[tuple[str, np.ndarray]]:
    """Yield (source, tokens incl. EOS) for every document of `split`, in shard order."""
    for shard in dataset.split_shards(split):
        for i in range(shard.n_docs):
            yield shard.source, shard.tokens[shard.offsets[i] : shard.offsets[i + 1]]
