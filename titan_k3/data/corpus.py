"""The embedded default corpus: real text every Python install carries, no download.

Sources:
  code   the standard library's own ``.py`` files: a deterministic subset (ordered by
         the sha256 of the relative path, so the sample spans the whole library),
         capped at `CODE_BYTES`; one document per file.
  prose  the reference topics of ``pydoc_data.topics`` plus module, class and function
         docstrings of standard-library files in the same order, until `PROSE_BYTES`;
         one document per topic or docstring, at least `MIN_PROSE_CHARS` long.

A deterministic 2% of documents (by content hash) form the ``validation`` split.
The embedded tokenizer (byte-level BPE, vocab 8192) is trained on the train split.

The dataset lives in ``$TITAN_K3_CACHE/embedded-py<major.minor>-v1`` (default cache
root ``~/.cache/titan_k3``). It is built once, in a temporary directory renamed into
place, under a file lock so concurrent ranks build it only once, and reused after.
"""

from __future__ import annotations

import ast
import fcntl
import hashlib
import os
import shutil
import sys
import sysconfig
import tempfile
from pathlib import Path

import numpy as np

from titan_k3.data.shards import INDEX_NAME, token_dtype, write_index, write_shard
from titan_k3.data.bpe import train_bpe

VERSION = 1
VOCAB_SIZE = 8192
CODE_BYTES = 3 << 20
PROSE_BYTES = 1 << 20
MIN_PROSE_CHARS = 200
VALIDATION_EVERY = 50  # 1 in 50 documents = 2%
SHARD_TOKENS = 1 << 20


def embedded_name() -> str:
    return f"embedded-py{sys.version_info.major}.{sys.version_info.minor}-v{VERSION}"


def cache_root() -> Path:
    return Path(os.environ.get("TITAN_K3_CACHE") or Path.home() / ".cache" / "titan_k3")


def _stdlib_files() -> list[tuple[str, Path]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [
        (p.relative_to(root).as_posix(), p)
        for p in root.rglob("*.py")
        if "site-packages" not in p.parts and "dist-packages" not in p.parts
    ]
    return sorted(files, key=lambda rp: hashlib.sha256(rp[0].encode()).hexdigest())


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None


def _docstrings(source: str) -> list[str]:
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    # NOTE: walks statement bodies only; ast.walk over every expression node is 5x slower.
    out, stack = [], [tree]
    while stack:
        node = stack.pop()
        doc = ast.get_docstring(node)
        if doc and len(doc) >= MIN_PROSE_CHARS:
            out.append(doc)
        stack.extend(
            reversed([n for n in node.body if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))])
        )
    return out


def embedded_documents() -> dict[str, list[tuple[str, str]]]:
    """{source: [(doc id, text), ...]} for the embedded corpus, in a fixed order."""
    import pydoc_data.topics

    topics = pydoc_data.topics.topics
    prose = [(f"pydoc_data.topics:{k}", topics[k]) for k in sorted(topics) if len(topics[k]) >= MIN_PROSE_CHARS]
    prose_bytes = sum(len(t) for _, t in prose)
    code, code_bytes = [], 0
    for rel, path in _stdlib_files():
        if code_bytes >= CODE_BYTES and prose_bytes >= PROSE_BYTES:
            break
        text = _read(path)
        if not text:
            continue
        if code_bytes < CODE_BYTES:
            code.append((rel, text))
            code_bytes += len(text)
        # NOTE: parsing is the slow part of the build (~5 ms per file), hence the prose cap.
        if prose_bytes < PROSE_BYTES:
            for i, doc in enumerate(_docstrings(text)):
                prose.append((f"{rel}#doc{i}", doc))
                prose_bytes += len(doc)
    return {"code": code, "prose": prose}


def _is_validation(text: str) -> bool:
    return int(hashlib.sha256(text.encode()).hexdigest()[:8], 16) % VALIDATION_EVERY == 0


def build_embedded_dataset(out_dir: Path) -> None:
    """Build the corpus, train the tokenizer and write shards + index into `out_dir`."""
    docs = embedded_documents()
    splits: dict[str, dict[str, list[tuple[str, str]]]] = {"train": {}, "validation": {}}
    for source, items in docs.items():
        for doc_id, text in items:
            split = "validation" if _is_validation(text) else "train"
            splits[split].setdefault(source, []).append((doc_id, text))
    train_texts = [t for items in splits["train"].values() for _, t in items]
    tok = train_bpe(train_texts, VOCAB_SIZE, out_dir / "tokenizer.json")
    tok.name = embedded_name()
    dtype = token_dtype(tok.vocab_size)
    records: dict[str, list[dict]] = {}
    for split, by_source in splits.items():
        records[split] = []
        for source in sorted(by_source):
            items = by_source[source]
            ids = tok.encode_batch([t for _, t in items])
            shard_docs, prov, n_tok, k = [], [], 0, 0
            for (doc_id, text), toks in zip(items, ids):
                shard_docs.append(np.asarray(toks + [tok.eos_id], dtype=dtype))
                prov.append({"source": source, "id": doc_id, "sha256": hashlib.sha256(text.encode()).hexdigest()})
                n_tok += len(toks) + 1
                if n_tok >= SHARD_TOKENS:
                    records[split].append(
                        write_shard(out_dir, f"{split}-{source}-{k:05d}", shard_docs, source=source, dtype=dtype, provenance=prov)
                    )
                    shard_docs, prov, n_tok, k = [], [], 0, k + 1
            if shard_docs:
                records[split].append(
                    write_shard(out_dir, f"{split}-{source}-{k:05d}", shard_docs, source=source, dtype=dtype, provenance=prov)
                )
    write_index(out_dir, tok, records, name=embedded_name())


def ensure_embedded_dataset() -> Path:
    """Return the embedded dataset directory, building it first if it is not cached."""
    root = cache_root()
    final = root / embedded_name()
    if (final / INDEX_NAME).is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{embedded_name()}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (final / INDEX_NAME).is_file():
            return final
        tmp = Path(tempfile.mkdtemp(prefix=f".{embedded_name()}-", dir=root))
        tmp.chmod(0o755)
        try:
            build_embedded_dataset(tmp)
            if final.exists():
                shutil.rmtree(final)
            os.rename(tmp, final)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp)
    return final
