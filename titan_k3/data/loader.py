"""The stateful, rank-aware, mixture-weighted loader of packed documents.

Shape legend: B local batch (rows), T sequence length, N documents pieces in a batch.

The stream. Each source has its own infinite token stream: epoch e is its documents
(each already ending with EOS) concatenated in an order shuffled by (seed, source, e),
then epoch e+1 follows. A sequence is a window of T+1 tokens of one source stream
taken at that source's position P, which then advances by T: the last target of a
window is the first input of the next window of that source, and every token is an
input exactly once per epoch. `set_seq_len` changes T from the next window on, so
a context stage keeps every token.

The mixture. Global sequence i takes its source from a deterministic weighted
interleave: the source furthest behind its weight's share of the tokens taken so far
(plus a seeded jitter of under one window, so the order is not periodic). Every
source's share is then within about two windows of its weight. The global stream
depends on the seed, the weights and the seq_len history only, not on the ranks.

Ranks. Global batch b is global sequences [b*B*W, (b+1)*B*W); each goes, in order,
to the rank with room (B rows each) that has taken the fewest tokens of its source,
so each rank's mix tracks the weights too. Every rank computes the whole schedule
(cheap: counters only) and reads just its own windows, so the ranks' sequences are
disjoint and their union is exactly the single-rank global batch.

State. `state_dict()` describes what the consumer has received (the prefetch thread
may be ahead): global sequence index, per-source positions, T, and the dataset's
content hash. It is the same on every rank; `load_state_dict` makes the next batch
exactly the one an uninterrupted loader would have yielded, and refuses a position
taken in another dataset (the same source names over other documents would read
other tokens at the same positions, and train on without a word).
"""

from __future__ import annotations

import hashlib
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from titan_k3.data.budget import content_sha256
from titan_k3.data.shards import Dataset, open_dataset
from titan_k3.data.tokenizer import Tokenizer

IGNORE_INDEX = -100
_STATE_VERSION = 1


@dataclass
class Batch:
    """One local batch.

    input_ids:     int64 [B, T] tokens.
    labels:        int64 [B, T] next tokens; IGNORE_INDEX (-100) where the target belongs
                   to another document than the input (document boundaries).
    cu_seqlens:    int64 [N+1] document boundaries over the flattened B*T tokens; every
                   row start is a boundary; first 0, last B*T.
    source_tokens: {source: input tokens of this batch taken from it}.
    fingerprints:  int64 [B] 63-bit hash of each row's place in the stream (source, position) and its T+1 window
                   tokens: rows share one only if they are one sequence of the stream, not merely the same text
                   (a source smaller than an update's share of it repeats its text within the update).
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    cu_seqlens: torch.Tensor
    source_tokens: dict[str, int]
    fingerprints: torch.Tensor


def check_token_ids(batch: Batch, vocab_size: int) -> Batch:
    """Returns `batch` once every input id and label is a token of the model's vocabulary (or ignored).

    Runs on the host before the batch moves to the GPU, so the loss kernel needs
    no device-side range check (a sync per micro-batch). Raises ValueError.
    """
    for name, ids, ignored in (("input_ids", batch.input_ids, None), ("labels", batch.labels, IGNORE_INDEX)):
        bad = (ids < 0) | (ids >= vocab_size)
        if ignored is not None:
            bad &= ids != ignored
        if bool(bad.any()):
            row, col = (int(i) for i in bad.nonzero()[0])
            raise ValueError(f"batch {name}[{row}, {col}] = {int(ids[row, col])}: outside the model's vocabulary "
                             f"[0, {vocab_size}) (a shard tokenised with another tokenizer?)")
    return batch


class _SourceStream:
    """A source's documents over all its shards; reads windows of its infinite shuffled stream."""

    def __init__(self, name: str, shards, seed: int):
        self.name = name
        # NOTE: keyed by the name, not the position, so adding a source keeps the others' orders.
        self._seed_key = (seed, int(hashlib.sha256(name.encode()).hexdigest()[:8], 16))
        self._tokens = [s.tokens for s in shards]
        doc_shard, doc_start, doc_len = [], [], []
        for k, s in enumerate(shards):
            doc_shard.append(np.full(s.n_docs, k, dtype=np.int32))
            doc_start.append(s.offsets[:-1])
            doc_len.append(np.diff(s.offsets))
        self._doc_shard = np.concatenate(doc_shard)
        self._doc_start = np.concatenate(doc_start).astype(np.int64)
        self._doc_len = np.concatenate(doc_len).astype(np.int64)
        self.n_docs = len(self._doc_len)
        self.n_tokens = int(self._doc_len.sum())
        self._epochs: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def _epoch(self, e: int) -> tuple[np.ndarray, np.ndarray]:
        """(document order, cumulative token starts [n_docs + 1]) of epoch e."""
        if e not in self._epochs:
            rng = np.random.default_rng([self._seed_key[0], self._seed_key[1], e])
            perm = rng.permutation(self.n_docs)
            cum = np.zeros(self.n_docs + 1, dtype=np.int64)
            np.cumsum(self._doc_len[perm], out=cum[1:])
            if len(self._epochs) >= 2:
                self._epochs.pop(min(self._epochs))
            self._epochs[e] = (perm, cum)
        return self._epochs[e]

    def read(self, pos: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        """Tokens [pos, pos+n) of the infinite stream and, per token, a document ordinal."""
        tokens = np.empty(n, dtype=np.int64)
        doc_ids = np.empty(n, dtype=np.int64)
        filled = 0
        while filled < n:
            e, p = divmod(pos + filled, self.n_tokens)
            perm, cum = self._epoch(e)
            k = int(np.searchsorted(cum, p, side="right")) - 1
            d = perm[k]
            off = p - int(cum[k])
            take = min(n - filled, int(self._doc_len[d]) - off)
            start = int(self._doc_start[d]) + off
            tokens[filled : filled + take] = self._tokens[self._doc_shard[d]][start : start + take]
            doc_ids[filled : filled + take] = e * self.n_docs + k
            filled += take
        return tokens, doc_ids


def _fingerprint(source: str, pos: int, window: np.ndarray) -> int:
    digest = hashlib.blake2b(f"{source}@{pos}:".encode() + window.tobytes(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def _uniform(seed: int, first: int, rows: int, cols: int) -> np.ndarray:
    """[rows, cols] uniform [0, 1) floats; row r keyed by (seed, first + r) alone (splitmix64), so
    a value never depends on how the stream was cut into batches."""
    base = (np.arange(first, first + rows, dtype=np.uint64) * np.uint64(0x632BE59BD9B4E019)) ^ np.uint64(
        (seed * 0x9E3779B1 * 0x632BE59BD9B4E019 + 0x5DEECE66D) & (2**64 - 1)
    )
    z = base[:, None] + np.arange(cols, dtype=np.uint64)[None, :] * np.uint64(0xD1B54A32D192ED03)
    z = z * np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(11)).astype(np.float64) / float(1 << 53)


def _split_evenly(totals: np.ndarray, world: int) -> np.ndarray:
    """[world, len(totals)] counts whose column sums are `totals`, each split as evenly as whole counts allow."""
    share, extra = np.divmod(totals, world)
    return share[None, :] + (np.arange(world)[:, None] < extra[None, :])


class _Core:
    """The synchronous producer: state + `next_batch`. Not thread-safe; one owner at a time."""

    def __init__(self, streams, weights, seq_len, local_batch_size, dp_rank, dp_world, seed, dataset_sha256=""):
        self.streams = streams
        self.dataset_sha256 = dataset_sha256
        self.weights = np.asarray(weights, dtype=np.float64)
        self.B, self.rank, self.world, self.seed = local_batch_size, dp_rank, dp_world, seed
        self.seq_len = seq_len
        self.seq_index = 0
        self.positions = np.zeros(len(streams), dtype=np.int64)
        # Tokens taken per source since the mixture started, globally and per rank.
        self.taken = np.zeros(len(streams), dtype=np.int64)
        self.rank_taken = np.zeros((dp_world, len(streams)), dtype=np.int64)

    def _pick_source(self, jitter: np.ndarray) -> int:
        """The source furthest behind its share, with a seeded jitter below one window."""
        target = self.weights * (self.taken.sum() + self.seq_len)
        score = target - self.taken + jitter * self.seq_len * self.weights
        score[self.weights == 0] = -np.inf
        return int(np.argmax(score))

    def _schedule(self) -> list[tuple[int, int, int]]:
        """(rank, source, position) for the next global batch, advancing the state.

        Each sequence goes, in order, to the rank with room that has the fewest tokens
        of its source, so every rank's mix tracks the weights, not only the global one.
        """
        B, T, W = self.B, self.seq_len, self.world
        room = np.full(W, B)
        plan = []
        jitter = _uniform(self.seed, self.seq_index, B * W, len(self.streams))
        for j in range(B * W):
            s = self._pick_source(jitter[j])
            load = np.where(room > 0, self.rank_taken[:, s], np.iinfo(np.int64).max)
            r = int(np.argmin(load))
            plan.append((r, s, int(self.positions[s])))
            room[r] -= 1
            self.positions[s] += T
            self.taken[s] += T
            self.rank_taken[r, s] += T
        self.seq_index += B * W
        return plan

    def next_batch(self) -> Batch:
        B, T = self.B, self.seq_len
        inputs = np.empty((B, T), dtype=np.int64)
        labels = np.empty((B, T), dtype=np.int64)
        fingerprints = np.empty(B, dtype=np.int64)
        boundaries = [np.zeros(1, dtype=np.int64)]
        source_tokens = {s.name: 0 for s in self.streams}
        mine = [(s, pos) for r, s, pos in self._schedule() if r == self.rank]
        assert len(mine) == B
        for row, (s, pos) in enumerate(mine):
            stream = self.streams[s]
            window, docs = stream.read(pos, T + 1)
            inputs[row] = window[:T]
            same_doc = docs[1:] == docs[:T]
            labels[row] = np.where(same_doc, window[1:], IGNORE_INDEX)
            starts = np.flatnonzero(docs[1:T] != docs[: T - 1]) + 1
            boundaries.append(row * T + starts)
            boundaries.append(np.array([(row + 1) * T], dtype=np.int64))
            fingerprints[row] = _fingerprint(stream.name, pos, window)
            source_tokens[stream.name] += T
        return Batch(
            input_ids=torch.from_numpy(inputs),
            labels=torch.from_numpy(labels),
            cu_seqlens=torch.from_numpy(np.concatenate(boundaries)),
            source_tokens=source_tokens,
            fingerprints=torch.from_numpy(fingerprints),
        )

    def get_state(self) -> dict:
        return {
            "version": _STATE_VERSION,
            "seed": self.seed,
            "dataset_sha256": self.dataset_sha256,
            "seq_len": self.seq_len,
            "seq_index": self.seq_index,
            "sources": [s.name for s in self.streams],
            "positions": self.positions.tolist(),
            "weights": self.weights.tolist(),
            "taken": self.taken.tolist(),
            "rank_taken": self.rank_taken.tolist(),
        }

    def set_state(self, state: dict) -> None:
        names = [s.name for s in self.streams]
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"loader state version {state.get('version')!r}: expected {_STATE_VERSION}")
        if state["sources"] != names:
            raise ValueError(f"loader state sources {state['sources']}: this dataset has {names}")
        if state["seed"] != self.seed:
            raise ValueError(f"loader state seed {state['seed']}: this loader has seed {self.seed}")
        # NOTE: states saved before the hash was recorded carry none; they are taken as they were.
        saved_sha = state.get("dataset_sha256") or ""
        if saved_sha and self.dataset_sha256 and saved_sha != self.dataset_sha256:
            raise ValueError(
                f"loader state is a position in dataset sha256 {saved_sha[:12]}..., this run reads dataset sha256 "
                f"{self.dataset_sha256[:12]}... (another dataset: the same positions would be other documents); "
                "train the other dataset as a new run, from these weights with checkpoint.initial_load_path"
            )
        if state["seq_index"] % (self.B * self.world):
            raise ValueError(
                f"loader state seq_index {state['seq_index']}: not a multiple of local_batch_size x dp_world "
                f"= {self.B * self.world}"
            )
        self.seq_len = int(state["seq_len"])
        self.seq_index = int(state["seq_index"])
        self.positions = np.asarray(state["positions"], dtype=np.int64)
        # NOTE: a new mixture restarts the deficit counts, so the schedule does not burst
        # one source to repay the old mixture. A new world size splits the global counts evenly
        # over its ranks: which rank took what before is gone, but their sum (the run's tokens
        # per source, as metrics and the source-mix check read it) goes on.
        same_mix = np.allclose(state["weights"], self.weights)
        self.taken = np.asarray(state["taken"], dtype=np.int64) if same_mix else np.zeros_like(self.taken)
        rank_taken = np.asarray(state["rank_taken"], dtype=np.int64)
        if not same_mix:
            self.rank_taken = np.zeros_like(self.rank_taken)
        elif rank_taken.shape == self.rank_taken.shape:
            self.rank_taken = rank_taken
        else:
            self.rank_taken = _split_evenly(self.taken, self.world)


class DataLoader:
    """Iterator of `Batch` with a background prefetch thread and an exact, resumable state.

    Attributes:
        wait_seconds: total time the consumer blocked in `__next__` (data-wait metric).
        source_tokens_total: {source: tokens received by this rank's consumer so far, resumed runs included}.
        weights: {source: normalised mixture weight}.
        dataset: what `describe()` says of the dataset (set by `build_dataloader`).
        resume_note: what the last `load_state_dict` did not take as saved (a changed mixture), "" when nothing;
            the checkpointer's `resumed` event says it.
    """

    def __init__(self, core: _Core, prefetch: int, dataset: dict | None = None):
        self._core = core
        self.dataset = dataset or {}
        self._prefetch = prefetch
        self._state = core.get_state()
        self.weights = {s.name: float(w) for s, w in zip(core.streams, core.weights)}
        self.source_tokens_total = {s.name: 0 for s in core.streams}
        self.wait_seconds = 0.0
        self.resume_note = ""
        self._thread: threading.Thread | None = None
        self._queue: queue.Queue | None = None
        self._stop = threading.Event()

    @property
    def seq_len(self) -> int:
        return int(self._state["seq_len"])

    def __iter__(self) -> "DataLoader":
        return self

    def __next__(self) -> Batch:
        t0 = time.perf_counter()
        if self._prefetch == 0:
            batch = self._core.next_batch()
            state = self._core.get_state()
        else:
            if self._thread is None:
                self._start()
            item = self._queue.get()
            if isinstance(item, BaseException):
                self._thread = None
                raise item
            batch, state = item
        self.wait_seconds += time.perf_counter() - t0
        self._state = state
        for name, n in batch.source_tokens.items():
            self.source_tokens_total[name] += n
        return batch

    def _start(self) -> None:
        self._core.set_state(self._state)  # the consumer's position is the truth
        self._stop.clear()
        self._queue = queue.Queue(maxsize=self._prefetch)
        self._thread = threading.Thread(target=self._produce, name="titan_k3-data-prefetch", daemon=True)
        self._thread.start()

    def _produce(self) -> None:
        failed = False
        while not (self._stop.is_set() or failed):
            try:
                item = (self._core.next_batch(), self._core.get_state())
            except BaseException as e:  # handed to the consumer, raised by __next__
                item, failed = e, True
            while not self._stop.is_set():
                try:
                    self._queue.put(item, timeout=0.05)
                    break
                except queue.Full:
                    continue

    def close(self) -> None:
        """Stop the prefetch thread and drop what it fetched; the state is kept."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
            self._queue = None
        self._core.set_state(self._state)

    def state_dict(self) -> dict:
        """The position after the last batch the consumer received (JSON-able, same on all ranks)."""
        return dict(self._state)

    def load_state_dict(self, state: dict) -> None:
        self.close()
        self._core.set_state(state)
        self._state = self._core.get_state()
        saved = dict(zip(state["sources"], state["weights"]))
        self.resume_note = "" if np.allclose(state["weights"], self._core.weights) else (
            "data mixture changed since the checkpoint, from this update on: " + ", ".join(
                f"{name} {saved[name]:.3g} -> {w:.3g}" for name, w in self.weights.items()) + " (per-source counts restart)")
        # NOTE: the counts go on from the saved position (this rank's share since the mixture started; zero after a
        # change of mixture; an even share of the global counts after a change of data-parallel world), so a resumed
        # run's tokens_per_source and source-mix check, summed over the ranks, read as the uninterrupted run's.
        core = self._core
        self.source_tokens_total = {s.name: int(n) for s, n in zip(core.streams, core.rank_taken[core.rank])}

    def set_seq_len(self, seq_len: int) -> None:
        """Use windows of `seq_len` from the next batch on, continuing at the exact token position."""
        if seq_len < 1:
            raise ValueError(f"seq_len={seq_len}: must be >= 1")
        self.close()
        state = dict(self._state, seq_len=int(seq_len))
        self._core.set_state(state)
        self._state = self._core.get_state()

    def describe(self) -> dict:
        """The dataset as the manifest records it: {dataset, path, name, sha256, split, mixture_from ('data.mixture',
        'prepared': the dataset's prepare weights, or 'natural': token proportions), tokens (of the split),
        tokens_per_source, weights}."""
        return {**self.dataset, "tokens": sum(s.n_tokens for s in self._core.streams),
                "tokens_per_source": {s.name: s.n_tokens for s in self._core.streams}, "weights": dict(self.weights)}

    def mixture_deviation(self) -> dict[str, float]:
        """{source: observed token fraction on this rank - configured weight} since start."""
        total = sum(self.source_tokens_total.values())
        if total == 0:
            return {k: 0.0 for k in self.weights}
        return {k: self.source_tokens_total[k] / total - w for k, w in self.weights.items()}

    def __del__(self):
        if self._thread is not None:
            self._stop.set()


def _normalise_mixture(dataset: Dataset, split: str, mixture: dict[str, float] | None, streams) -> list[float]:
    """Weights aligned with `streams`, summing to 1; natural token proportions for None."""
    names = [s.name for s in streams]
    if mixture is None:
        total = sum(s.n_tokens for s in streams)
        return [s.n_tokens / total for s in streams]
    unknown = sorted(set(mixture) - set(dataset.source_names))
    if unknown:
        raise ValueError(
            f"mixture: unknown source(s) {unknown}; dataset {str(dataset.path)!r} has {dataset.source_names}"
        )
    missing = sorted(set(names) - set(mixture))
    if missing:
        raise ValueError(f"mixture: no weight for source(s) {missing}; give every source a weight (0 excludes it)")
    bad = {k: v for k, v in mixture.items() if not (isinstance(v, (int, float)) and v >= 0 and np.isfinite(v))}
    total = float(sum(mixture[n] for n in names)) if not bad else 0.0
    if bad or total <= 0:
        raise ValueError(
            f"mixture={mixture}: weights must be finite numbers >= 0 with a positive sum over split {split!r}'s sources {names}"
        )
    # NOTE: a weighted source without documents in the split would hand its share to the others without a word.
    empty = sorted(n for n, w in mixture.items() if n not in names and w > 0)
    if empty:
        raise ValueError(f"mixture: source(s) {empty} weighted above 0 have no documents in split {split!r}; "
                         f"its sources with documents: {names} (0 leaves a source out)")
    return [mixture[n] / total for n in names]


def build_dataloader(
    dataset: str,
    tokenizer: Tokenizer,
    seq_len: int,
    local_batch_size: int,
    dp_rank: int,
    dp_world: int,
    seed: int,
    split: str = "train",
    mixture: dict[str, float] | None = None,
    prefetch: int = 2,
    prepared_weights: bool = True,
) -> DataLoader:
    """A `DataLoader` over ``"embedded"`` or a prepared dataset directory (with index.json).

    mixture: {source: weight}; None takes the weights the dataset was prepared with (`Dataset.prepared_weights`; not with
    prepared_weights=False), else the sources' natural token proportions. `describe()["mixture_from"]` says which.

    Raises ValueError, before any work, for a tokenizer other than the dataset's, a
    corrupt shard, an unknown split or source, or out-of-range arguments.
    """
    for name, value, lo in (("seq_len", seq_len, 1), ("local_batch_size", local_batch_size, 1), ("dp_world", dp_world, 1), ("prefetch", prefetch, 0)):
        if not isinstance(value, int) or value < lo:
            raise ValueError(f"{name}={value!r}: must be an integer >= {lo}")
    if not 0 <= dp_rank < dp_world:
        raise ValueError(f"dp_rank={dp_rank}: must be in [0, dp_world={dp_world})")
    if dataset == "embedded":
        from titan_k3.data.corpus import ensure_embedded_dataset

        path = ensure_embedded_dataset()
    else:
        path = Path(dataset)
    ds = open_dataset(path, tokenizer)
    by_source = ds.sources_with_documents(split)
    streams = [_SourceStream(name, by_source[name], seed) for name in sorted(by_source)]
    origin = "data.mixture"
    if mixture is None:
        mixture = ds.prepared_weights(split) if prepared_weights else None
        origin = "natural" if mixture is None else "prepared"
    weights = _normalise_mixture(ds, split, mixture, streams)
    sha = content_sha256(ds.index)
    core = _Core(streams, weights, seq_len, local_batch_size, dp_rank, dp_world, seed, dataset_sha256=sha)
    info = {"dataset": dataset, "path": str(path), "name": ds.index.get("name", path.name),
            "sha256": sha, "split": split, "mixture_from": origin}
    return DataLoader(core, prefetch, info)
