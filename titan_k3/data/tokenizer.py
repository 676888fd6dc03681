"""Tokenizers: `load_tokenizer(spec)`, the one place a `data.tokenizer` value becomes a tokenizer.

`spec` is
  - ``"embedded"``: the byte-level BPE (vocab 8192) trained on the embedded corpus
    (see `titan_k3.data.corpus`), built once and cached;
  - a path to an HF ``tokenizer.json`` (loaded with the `tokenizers` library);
  - a path to a tiktoken-format BPE file (``*.tiktoken`` / ``*.model``: one
    ``<base64 token> <rank>`` per line, the format of Kimi's ``tiktoken.model``).

The classes, BPE training and file hashes live in `titan_k3.data.bpe` (below the
shard format and the corpus); their names are re-exported here for callers.
This module does not import torch, so data tooling stays light.
"""

from __future__ import annotations

import os
from pathlib import Path

from titan_k3.data.bpe import (  # noqa: F401  (re-exported)
    EOS_TOKEN,
    TIKTOKEN_PATTERN,
    HFTokenizer,
    TiktokenTokenizer,
    Tokenizer,
    file_sha256,
    train_bpe,
)
from titan_k3.data.corpus import embedded_name, ensure_embedded_dataset


def load_tokenizer(spec: str | os.PathLike) -> Tokenizer:
    """Load ``"embedded"``, an HF ``tokenizer.json`` path, or a tiktoken BPE file path."""
    if str(spec) == "embedded":
        return HFTokenizer(ensure_embedded_dataset() / "tokenizer.json", name=embedded_name())
    path = Path(spec)
    if not path.is_file():
        raise ValueError(
            f"tokenizer {str(spec)!r}: no such file; expected 'embedded', an HF tokenizer.json "
            "or a tiktoken BPE file (*.tiktoken / *.model)"
        )
    if path.suffix == ".json":
        try:
            return HFTokenizer(path)
        except Exception as e:
            if isinstance(e, ValueError) and str(path) in str(e):
                raise
            raise ValueError(f"tokenizer {str(path)!r}: not a valid HF tokenizer.json ({e})") from None
    if path.suffix in (".tiktoken", ".model"):
        return TiktokenTokenizer(path)
    raise ValueError(
        f"tokenizer {str(path)!r}: unknown file type {path.suffix!r}; expected .json (HF) "
        "or .tiktoken / .model (tiktoken BPE)"
    )


def tokenizer_identity(spec: str | os.PathLike) -> tuple[str, str]:
    """(name, sha256) of the tokenizer `spec` names, as `load_tokenizer(spec)` would give them, without building it."""
    if str(spec) == "embedded":
        return embedded_name(), file_sha256(ensure_embedded_dataset() / "tokenizer.json")
    return Path(spec).name, file_sha256(spec)
