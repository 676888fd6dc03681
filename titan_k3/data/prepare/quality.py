"""Normalisation and rule filters.

Normalisation: Unicode NFC; CRLF / CR -> LF; exotic spaces (NBSP, the U+2000 block,
ideographic space...) -> ' '; zero-width characters removed; trailing whitespace at
line ends removed; runs of more than two blank lines cut to two; the document
stripped. Indentation is kept (code is a source too).

Rules, in order; the first that fires decides:
  too_short    fewer than `min_chars` characters or `min_words` words
  low_quality  alpha_ratio, digit_ratio (character classes over non-space characters),
               dup_line_frac, mean_line_chars (line statistics), dup_ngram_frac
               (repeated word 3-grams); checked in this order
"""

from __future__ import annotations

import re
import unicodedata
import zlib

import numpy as np

from titan_k3.data.prepare.config import FilterConfig

_SPACES = re.compile(r"[\u00a0\u1680\u2000-\u200a\u202f\u205f\u3000]")
_ZERO_WIDTH = re.compile(r"[\u200b\u200c\u200d\u2060\ufeff]")
_TRAILING = re.compile(r"[ \t]+\n")
_BLANK_RUNS = re.compile(r"\n{4,}")
_WORD = re.compile(r"\w+")


def normalize(text: str) -> str:
    if not text.isascii():  # NOTE: a fast check; most documents skip three full passes
        text = unicodedata.normalize("NFC", text)
        text = _ZERO_WIDTH.sub("", _SPACES.sub(" ", text))
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = _TRAILING.sub("\n", text)
    text = _BLANK_RUNS.sub("\n\n\n", text)
    return text.strip()


def words(text: str) -> list[str]:
    """Lower-cased word tokens (\\w+) used by the filters, dedup and decontamination."""
    return _WORD.findall(text.lower())


def word_hashes(tokens: list[str]) -> np.ndarray:
    """uint64 [n] crc32 of each word: stable across processes (unlike `hash`) and cheap.

    NOTE: 32 bits per word is enough: n-gram hashes mix n of them into 64 bits, and a
    rare word collision only merges two words' statistics.
    """
    return np.fromiter(map(zlib.crc32, map(str.encode, tokens)), dtype=np.uint64, count=len(tokens))


_MIX = np.uint64(0x9E3779B97F4A7C15)


def ngram_hashes(wh: np.ndarray, n: int) -> np.ndarray:
    """uint64 [max(len - n + 1, 0)] a hash of every n consecutive word hashes (order-sensitive)."""
    m = len(wh) - n + 1
    if m <= 0:
        return np.zeros(0, dtype=np.uint64)
    h = np.zeros(m, dtype=np.uint64)
    for j in range(n):  # uint64 array arithmetic wraps silently
        h = (h ^ wh[j : j + m]) * _MIX
        h ^= h >> np.uint64(29)
    return h


# Byte classes for ASCII: 1 letter, 2 digit, 3 space, 0 other; 4 marks a non-ASCII lead byte.
_CLASS = np.zeros(256, dtype=np.uint8)
_CLASS[np.frombuffer(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ", np.uint8)] = 1
_CLASS[np.frombuffer(b"0123456789", np.uint8)] = 2
_CLASS[np.frombuffer(b" \t\n\r\x0b\x0c", np.uint8)] = 3
_CLASS[0xC0:] = 4
_NON_ASCII = re.compile(r"[^\x00-\x7f]")


def char_classes(text: str) -> tuple[int, int, int]:
    """(non-space, letter, digit) character counts, as str.isspace / isalpha / isdecimal would give.

    ASCII is counted with a byte table in numpy; only non-ASCII characters are
    classified one by one (regex subn over every character was the slowest step).
    """
    counts = np.bincount(_CLASS[np.frombuffer(text.encode("utf-8"), np.uint8)], minlength=5)
    letters, digits, spaces = int(counts[1]), int(counts[2]), int(counts[3])
    if counts[4]:
        for ch in _NON_ASCII.findall(text):
            letters += ch.isalpha()
            digits += ch.isdecimal()
            spaces += ch.isspace()
    return len(text) - spaces, letters, digits


def rule_filter(text: str, tokens: list[str], wh: np.ndarray, cfg: FilterConfig) -> tuple[str, dict] | None:
    """(decision, reason) for the first rule that fires, or None when the text passes."""
    if len(text) < cfg.min_chars:
        return "too_short", {"rule": "min_chars", "value": len(text), "threshold": cfg.min_chars}
    if len(tokens) < cfg.min_words:
        return "too_short", {"rule": "min_words", "value": len(tokens), "threshold": cfg.min_words}
    non_space, letters, digit_chars = char_classes(text)
    checks = []
    alpha = letters / max(non_space, 1)
    checks.append(("alpha_ratio", alpha, alpha < cfg.min_alpha_ratio, cfg.min_alpha_ratio))
    digits = digit_chars / max(non_space, 1)
    checks.append(("digit_ratio", digits, digits > cfg.max_digit_ratio, cfg.max_digit_ratio))
    lines = [ln for ln in text.split("\n") if ln.strip()]
    dup_lines = 1.0 - len(set(lines)) / len(lines)
    checks.append(("dup_line_frac", dup_lines, dup_lines > cfg.max_dup_line_frac, cfg.max_dup_line_frac))
    mean_line = sum(len(ln) for ln in lines) / len(lines)
    checks.append(("mean_line_chars", mean_line, mean_line < cfg.min_mean_line_chars, cfg.min_mean_line_chars))
    tri = ngram_hashes(wh, 3)
    dup = 1.0 - len(np.unique(tri)) / len(tri) if len(tri) else 0.0
    checks.append(("dup_ngram_frac", dup, dup > cfg.max_dup_ngram_frac, cfg.max_dup_ngram_frac))
    for rule, value, fired, threshold in checks:
        if fired:
            return "low_quality", {"rule": rule, "value": round(value, 4), "threshold": threshold}
    return None


LOW_QUALITY_RULES = ("alpha_ratio", "digit_ratio", "dup_line_frac", "mean_line_chars", "dup_ngram_frac")
TOO_SHORT_RULES = ("min_chars", "min_words")
