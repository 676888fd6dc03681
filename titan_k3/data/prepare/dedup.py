"""Near-duplicate detection (MinHash + LSH, datasketch) and benchmark n-gram decontamination.

Both work on the word hashes of `quality.words` / `quality.word_hashes`:
  - a document's MinHash is taken over its word `shingle`-grams; the LSH index
    proposes candidates and a candidate counts only if the signatures' estimated
    Jaccard similarity is at least the threshold;
  - a benchmark example contributes the word n-grams of its context followed by its
    gold answer, and of each choice on its own; a document containing any of them is
    contaminated.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
from datasketch import LeanMinHash, MinHash, MinHashLSH

from titan_k3.data.prepare.quality import ngram_hashes, word_hashes, words
from titan_k3.eval.tasks import iter_examples

_MINHASH_SEED = 1
_CHUNK = 4096  # shingles per update_batch call: bounds its [chunk, num_perm] temporary


@functools.lru_cache(maxsize=4)
def _template(num_perm: int) -> MinHash:
    # NOTE: MinHash draws its permutations on every construction; we reuse one set.
    return MinHash(num_perm=num_perm, seed=_MINHASH_SEED)


def minhash_signature(wh: np.ndarray, shingle: int, num_perm: int) -> np.ndarray:
    """uint32 [num_perm] MinHash of the word `shingle`-grams (a shorter text: one shingle of all words)."""
    shingles = ngram_hashes(wh, min(shingle, max(len(wh), 1))) if len(wh) else np.zeros(1, dtype=np.uint64)
    # NOTE: datasketch's default scheme (affine32) takes 32-bit input hashes.
    shingles = (shingles ^ (shingles >> np.uint64(32))) & np.uint64(0xFFFFFFFF)
    template = _template(num_perm)
    m = MinHash(num_perm, _MINHASH_SEED, hashfunc=int, permutations=template.permutations, scheme=template.scheme)
    for i in range(0, len(shingles), _CHUNK):
        m.update_batch(shingles[i : i + _CHUNK].tolist())
    return np.asarray(m.hashvalues, dtype=np.uint32)


class NearDuplicateIndex:
    """Documents added in order; each is checked against the earlier ones first."""

    def __init__(self, threshold: float, num_perm: int):
        self.threshold = threshold
        self.num_perm = num_perm
        self._lsh = MinHashLSH(threshold=threshold, num_perm=num_perm)
        self._sigs: dict[int, np.ndarray] = {}
        self._scheme = _template(num_perm).scheme

    def check_and_add(self, key: int, sig: np.ndarray) -> tuple[int, float] | None:
        """(earliest key with Jaccard >= threshold, its Jaccard) or None, in which case `key` is added."""
        lean = LeanMinHash(seed=_MINHASH_SEED, hashvalues=sig, scheme=self._scheme)
        best = None
        for other in sorted(self._lsh.query(lean)):
            j = float(np.mean(self._sigs[other] == sig))
            if j >= self.threshold:
                best = (other, j)
                break
        if best is None:
            self._lsh.insert(key, lean, check_duplication=False)
            self._sigs[key] = sig
        return best


class BenchmarkNgrams:
    """The n-gram hashes of benchmark files: the evaluator's task files, read as it reads them
    (titan_k3/eval/tasks.py: a bad line stops with its file and line)."""

    def __init__(self, paths: list[str], n: int):
        self.n = n
        self.names: list[str] = []
        self.stats: dict[str, dict] = {}
        hashes, owners = [], []
        for k, p in enumerate(paths):
            name = Path(p).name.split(".")[0]
            if name in self.names:
                name = f"{name}#{k}"
            self.names.append(name)
            grams, n_examples, n_short = self._load(Path(p))
            self.stats[name] = {"examples": n_examples, "too_short_for_n": n_short, "ngrams": len(grams)}
            hashes.append(grams)
            owners.append(np.full(len(grams), k, dtype=np.int32))
        all_h = np.concatenate(hashes) if hashes else np.zeros(0, np.uint64)
        all_o = np.concatenate(owners) if owners else np.zeros(0, np.int32)
        order = np.argsort(all_h, kind="stable")
        self._hashes, self._owners = all_h[order], all_o[order]

    def _load(self, path: Path) -> tuple[np.ndarray, int, int]:
        grams, n_examples, n_short = [], 0, 0
        for _, ex in iter_examples(path):
            n_examples += 1
            pieces = [f"{ex.context} {ex.choices[ex.gold]}", *ex.choices]
            found = [ngram_hashes(word_hashes(words(t)), self.n) for t in pieces]
            if not any(len(g) for g in found):
                n_short += 1
            grams.extend(found)
        out = np.unique(np.concatenate(grams)) if grams else np.zeros(0, np.uint64)
        return out, n_examples, n_short

    def first_hit(self, tokens: list[str], wh: np.ndarray) -> dict | None:
        """{"benchmark", "ngram", "matches"} for a document with an overlapping n-gram, else None."""
        if not len(self._hashes):
            return None
        doc = ngram_hashes(wh, self.n)
        if not len(doc):
            return None
        pos = np.searchsorted(self._hashes, doc)
        pos[pos == len(self._hashes)] = 0
        hit = self._hashes[pos] == doc
        if not hit.any():
            return None
        first = int(np.argmax(hit))
        return {
            "benchmark": self.names[int(self._owners[pos[first]])],
            "ngram": " ".join(tokens[first : first + self.n]),
            "matches": int(hit.sum()),
        }
