"""The tokenizer classes (HF `tokenizer.json` files, tiktoken BPE files), training a byte-level BPE, file hashes.

`titan_k3.data.tokenizer.load_tokenizer` is the entry point that picks one of
these from a `data.tokenizer` value; this module is below the shard format and
the embedded corpus, which both use it (docs/architecture.md §3: no import cycles).

tiktoken files carry no pre-tokenisation pattern and no special tokens, so we use
`TIKTOKEN_PATTERN` (the cl100k pattern) and append `<|endoftext|>` (the EOS) right
after the last rank, then reserved special tokens until the vocabulary is a
multiple of 256. For Kimi's file (163,584 ranks) that gives the model's 163,840.

Text is always encoded as ordinary text: a literal ``<|endoftext|>`` inside a
document is tokenised as characters, never as the EOS id (data must not be able
to forge document boundaries).

This module does not import torch, so data tooling stays light.
"""

from __future__ import annotations

import abc
import base64
import hashlib
import os
from pathlib import Path
from typing import Iterable, Sequence

EOS_TOKEN = "<|endoftext|>"

# NOTE: the cl100k_base split pattern; a tiktoken file does not record its own.
TIKTOKEN_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]++[\r\n]*"""
    r"""|\s*[\r\n]|\s+(?!\S)|\s+"""
)

# EOS names tried, in order, when an HF tokenizer.json is loaded.
_HF_EOS_CANDIDATES = (EOS_TOKEN, "</s>", "<|end_of_text|>", "<eos>", "[EOS]", "<|im_end|>")


def file_sha256(path: str | os.PathLike) -> str:
    """Hex sha256 of a file's bytes, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


class Tokenizer(abc.ABC):
    """A text <-> token-id map with the identity the data index records.

    A subclass implements `encode` and `decode` and sets the four attributes.

    Attributes:
        name: human-readable name (file name, or ``embedded-py3.11-v1``).
        sha256: sha256 of the tokenizer file; shards record it and readers check it.
        vocab_size: number of ids, special tokens included.
        eos_id: id appended after every document.
    """

    name: str
    sha256: str
    vocab_size: int
    eos_id: int

    @abc.abstractmethod
    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, encoded as ordinary text (no special tokens)."""

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    @abc.abstractmethod
    def decode(self, ids: Iterable[int]) -> str:
        """The text of `ids`."""

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(name={self.name!r}, vocab_size={self.vocab_size}, "
            f"eos_id={self.eos_id}, sha256={self.sha256[:12]}...)"
        )


class HFTokenizer(Tokenizer):
    """A `tokenizers.Tokenizer` loaded from a ``tokenizer.json``."""

    def __init__(self, path: str | os.PathLike, name: str | None = None):
        from tokenizers import Tokenizer as _HF

        path = Path(path)
        self._tok = _HF.from_file(str(path))
        # NOTE: special-token strings in text are encoded as ordinary text (see module doc).
        self._tok.encode_special_tokens = True
        self.path = path
        self.name = name or path.name
        self.sha256 = file_sha256(path)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        for candidate in _HF_EOS_CANDIDATES:
            eos = self._tok.token_to_id(candidate)
            if eos is not None:
                self.eos_id = eos
                break
        else:
            raise ValueError(
                f"tokenizer {str(path)!r}: no EOS token found; expected one of {list(_HF_EOS_CANDIDATES)}"
            )

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)


class TiktokenTokenizer(Tokenizer):
    """A tiktoken BPE file (base64 token + rank lines) with `TIKTOKEN_PATTERN`.

    Special tokens: `EOS_TOKEN` at id ``n_ranks``, then ``<|reserved_special_token_i|>``
    up to the next multiple of 256.
    """

    def __init__(self, path: str | os.PathLike):
        import tiktoken

        path = Path(path)
        ranks: dict[bytes, int] = {}
        # NOTE: tiktoken takes a malformed table without a word and then panics in Rust (a PanicException that
        # no `except Exception` stops) at load or at the first text that needs a missing byte, or silently keeps
        # the last of a repeated token; each is refused here, naming the line.
        token_line: dict[bytes, int] = {}
        rank_line: dict[int, int] = {}
        with open(path, "rb") as f:
            for lineno, line in enumerate(f, 1):
                line = line.strip()
                if not line:
                    continue
                parts = line.split()
                if len(parts) != 2:
                    raise ValueError(
                        f"tokenizer {str(path)!r} line {lineno}: expected '<base64 token> <rank>', got {line[:60]!r}"
                    )
                try:
                    token, rank = base64.b64decode(parts[0], validate=True), int(parts[1])
                except (ValueError, base64.binascii.Error) as e:
                    raise ValueError(
                        f"tokenizer {str(path)!r} line {lineno}: not a base64 token and integer rank ({e})"
                    ) from None
                where = f"tokenizer {str(path)!r} line {lineno}"
                if rank < 0 or not token:
                    raise ValueError(f"{where}: {'rank ' + str(rank) + ' is negative' if rank < 0 else 'empty token'}")
                if token in token_line:
                    raise ValueError(f"{where}: token {token!r} again (first on line {token_line[token]})")
                if rank in rank_line:
                    raise ValueError(f"{where}: rank {rank} again (first on line {rank_line[rank]})")
                token_line[token], rank_line[rank] = lineno, lineno
                ranks[token] = rank
        if not ranks:
            raise ValueError(f"tokenizer {str(path)!r}: empty tiktoken file")
        missing = [b for b in range(256) if bytes([b]) not in ranks]
        if missing:
            raise ValueError(f"tokenizer {str(path)!r}: no token for {len(missing)} of the 256 single bytes (first "
                             f"{bytes([missing[0]])!r}); a byte-level BPE must encode every byte")
        n_ranks = max(ranks.values()) + 1
        n_total = -(-(n_ranks + 1) // 256) * 256
        specials = {EOS_TOKEN: n_ranks}
        for i, tid in enumerate(range(n_ranks + 1, n_total)):
            specials[f"<|reserved_special_token_{i}|>"] = tid
        self._enc = tiktoken.Encoding(
            name=path.stem, pat_str=TIKTOKEN_PATTERN, mergeable_ranks=ranks, special_tokens=specials
        )
        self.path = path
        self.name = path.name
        self.sha256 = file_sha256(path)
        self.vocab_size = n_total
        self.eos_id = n_ranks

    def encode(self, text: str) -> list[int]:
        return self._enc.encode_ordinary(text)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self._enc.encode_ordinary_batch(list(texts))

    def decode(self, ids: Iterable[int]) -> str:
        return self._enc.decode(list(ids))


def train_bpe(texts: Iterable[str], vocab_size: int, out_path: str | os.PathLike) -> Tokenizer:
    """Train a byte-level BPE with `EOS_TOKEN` as its only special token; save it to ``out_path``.

    Byte-level: any text round-trips exactly (no normaliser, no prefix space).
    """
    from tokenizers import Tokenizer as _HF, decoders, models, pre_tokenizers, trainers

    if vocab_size < 257:
        raise ValueError(f"vocab_size={vocab_size}: must be >= 257 (256 bytes + EOS)")
    tok = _HF(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(out_path.name + f".tmp{os.getpid()}")
    tok.save(str(tmp))
    os.replace(tmp, out_path)
    return HFTokenizer(out_path)
