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
_LETTER = re.compile(r"[^\W\d_]")
_DIGIT = re.compile(r"\d")
_SPACE = re.compile(r"\s")


def normalize(text: str) -> str:
    text = unicodedata.normalize("NFC", text)
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = _ZERO_WIDTH.sub("", _SPACES.sub(" ", text))
    text = _TRAILING.sub("\n", text)
    text = _BLANK_RUNS.sub("\n\n\n", text)
    return text.strip()


def words(text: str) -> list[str]:
    """Lower-cased word tokens (\\w+) used by the filters, dedup and decontamination."""
    return _WORD.findall(text.lower())


def word_hashes(tokens: list[str]) -> np.ndarray:
    """uint64 [n] a 64-bit hash per word, stable across processes (unlike `hash`).

    crc32 and adler32 side by side: C calls cheap enough to run on every word.
    """
    data = [t.encode() for t in tokens]
    lo = np.fromiter((zlib.crc32(b) for b in data), dtype=np.uint64, count=len(data))
    hi = np.fromiter((zlib.adler32(b) for b in data), dtype=np.uint64, count=len(data))
    return (hi << np.uint64(32)) | lo


_MIX = np.uint64(0x9E3779B97F4A7C15)


def ngram_hashes(wh: np.ndarray, n: int) -> np.ndarray:
    """uint64 [max(len - n + 1, 0)] a hash of every n consecutive word hashes (order-sensitive)."""
    m = len(wh) - n + 1
    if m <= 0:
        return np.zeros(0, dtype=np.uint64)
    h = np.zeros(m, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for j in range(n):
            h = (h ^ wh[j : j + m]) * _MIX
            h ^= h >> np.uint64(29)
    return h


def rule_filter(text: str, tokens: list[str], wh: np.ndarray, cfg: FilterConfig) -> tuple[str, dict] | None:
    """(decision, reason) for the first rule that fires, or None when the text passes."""
    if len(text) < cfg.min_chars:
        return "too_short", {"rule": "min_chars", "value": len(text), "threshold": cfg.min_chars}
    if len(tokens) < cfg.min_words:
        return "too_short", {"rule": "min_words", "value": len(tokens), "threshold": cfg.min_words}
    non_space = len(text) - _SPACE.subn("", text)[1]
    checks = []
    alpha = _LETTER.subn("", text)[1] / max(non_space, 1)
    checks.append(("alpha_ratio", alpha, alpha < cfg.min_alpha_ratio, cfg.min_alpha_ratio))
    digits = _DIGIT.subn("", text)[1] / max(non_space, 1)
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
