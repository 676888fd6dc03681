"""The stateful loader: boundaries, rank split, resume with prefetch, seq_len stages, mixture.

The synthetic dataset gives every token a unique id, so each token tells its
source, its document and whether it ends the document.
"""

import numpy as np
import pytest
import torch

from titan_k3.data.loader import IGNORE_INDEX, Batch, build_dataloader, check_token_ids
from titan_k3.data.shards import token_dtype, write_index, write_shard
from titan_k3.data.tokenizer import Tokenizer

VOCAB = 1 << 20


class StubTokenizer(Tokenizer):
    def __init__(self):
        self.name, self.sha256, self.vocab_size, self.eos_id = "stub", "c" * 64, VOCAB, 0

    def encode(self, text):
        return [ord(c) for c in text]  # one id per character: the datasets here are written as ids

    def decode(self, ids):
        return "".join(map(chr, ids))


def make_dataset(path, doc_lengths: dict[str, list[int]], **index_extra):
    """Returns (tokenizer, token id -> (source, doc, last-in-doc)) for a dataset of unique tokens; index_extra goes into
    index.json (e.g. the mixture prepare records)."""
    tok, dtype = StubTokenizer(), token_dtype(VOCAB)
    owner, next_id, records = {}, 1, []
    for source, lengths in doc_lengths.items():
        docs = []
        for d, n in enumerate(lengths):
            ids = np.arange(next_id, next_id + n)
            for j, t in enumerate(ids):
                owner[int(t)] = (source, d, j == n - 1)
            docs.append(ids.astype(dtype))
            next_id += n
        half = len(docs) // 2  # two shards per source
        for k, part in enumerate((docs[:half], docs[half:])):
            records.append(write_shard(path, f"train-{source}-{k:05d}", part, source=source, dtype=dtype))
    write_index(path, tok, {"train": records}, **index_extra)
    return tok, owner


def lengths(n_docs, lo, hi, seed):
    return [int(x) for x in np.random.default_rng(seed).integers(lo, hi, n_docs)]


@pytest.fixture
def one_source(tmp_path):
    tok, owner = make_dataset(tmp_path, {"web": lengths(40, 1, 50, 0)})
    return tmp_path, tok, owner


def take(loader, n):
    return [next(loader) for _ in range(n)]


def test_labels_and_cu_seqlens_follow_documents(one_source):
    path, tok, owner = one_source
    T, B = 32, 3
    loader = build_dataloader(str(path), tok, T, B, 0, 1, seed=1, prefetch=0)
    n_ignored = 0
    for batch in take(loader, 20):
        x, y = batch.input_ids, batch.labels
        assert x.shape == y.shape == (B, T) and x.dtype == y.dtype == torch.int64
        doc = [[owner[int(t)][:2] for t in row] for row in x]
        for r in range(B):
            for t in range(T):
                _, _, last = owner[int(x[r, t])]
                if last:  # the target is the next document's first token
                    assert y[r, t] == IGNORE_INDEX
                    n_ignored += 1
                else:
                    assert y[r, t] == x[r, t] + 1
        want = [0]
        for r in range(B):
            want += [r * T + t for t in range(1, T) if doc[r][t] != doc[r][t - 1]] + [(r + 1) * T]
        assert batch.cu_seqlens.tolist() == want
        assert batch.source_tokens == {"web": B * T}
        assert batch.fingerprints.shape == (B,) and bool((batch.fingerprints >= 0).all())
    assert n_ignored > 0


def test_every_token_once_per_epoch(tmp_path):
    lens = lengths(30, 1, 40, 3)
    lens[-1] += 4 * 16 - sum(lens) % (4 * 16)  # epoch = a whole number of batches
    tok, owner = make_dataset(tmp_path, {"web": lens})
    loader = build_dataloader(str(tmp_path), tok, 16, 4, 0, 1, seed=5, prefetch=2)
    n_batches = sum(lens) // 64
    for epoch in range(2):
        seen = torch.cat([b.input_ids.flatten() for b in take(loader, n_batches)]).tolist()
        assert sorted(seen) == sorted(owner)
        if epoch == 0:
            first = seen
    assert seen != first  # the second epoch has another document order


def rows(batches):
    return [tuple(r) for b in batches for r in b.input_ids.tolist()]


def test_two_ranks_disjoint_and_union_is_single_rank_stream(tmp_path):
    tok, _ = make_dataset(tmp_path, {"a": lengths(30, 1, 60, 1), "b": lengths(20, 5, 90, 2)})
    single = take(build_dataloader(str(tmp_path), tok, 24, 4, 0, 1, seed=7, mixture={"a": 0.6, "b": 0.4}), 10)
    ranks = [take(build_dataloader(str(tmp_path), tok, 24, 2, r, 2, seed=7, mixture={"a": 0.6, "b": 0.4}), 10) for r in range(2)]
    r0, r1 = rows(ranks[0]), rows(ranks[1])
    assert not set(r0) & set(r1)
    for b in range(10):  # global batch b = the single rank's batch b, split between the ranks
        assert sorted(rows([single[b]])) == sorted(rows([ranks[0][b], ranks[1][b]]))
        fp = torch.cat([ranks[0][b].fingerprints, ranks[1][b].fingerprints])
        assert sorted(fp.tolist()) == sorted(single[b].fingerprints.tolist())
    fp = torch.cat([b.fingerprints for rk in ranks for b in rk])
    assert len(set(fp.tolist())) == len(fp)
    other_seed = take(build_dataloader(str(tmp_path), tok, 24, 4, 0, 1, seed=8, mixture={"a": 0.6, "b": 0.4}), 10)
    assert rows(other_seed) != rows(single)


@pytest.mark.parametrize("prefetch", [0, 3])
def test_resume_mid_stream_on_two_ranks(tmp_path, prefetch):
    tok, _ = make_dataset(tmp_path, {"a": lengths(30, 1, 60, 1), "b": lengths(20, 5, 90, 2)})
    mix = {"a": 0.7, "b": 0.3}
    for rank in range(2):
        make = lambda: build_dataloader(str(tmp_path), tok, 16, 3, rank, 2, seed=11, mixture=mix, prefetch=prefetch)
        full = take(make(), 12)
        counted = make()
        take(counted, 5)
        first = make()
        take(first, 5)
        state = first.state_dict()
        take(first, 2)  # advancing the old loader must not change the saved state
        resumed = make()
        resumed.load_state_dict(state)
        assert resumed.source_tokens_total == counted.source_tokens_total  # tokens_per_source goes on, not from 0
        for want, got in zip(full[5:], take(resumed, 7)):
            assert torch.equal(want.input_ids, got.input_ids) and torch.equal(want.labels, got.labels)
            assert torch.equal(want.cu_seqlens, got.cu_seqlens) and want.source_tokens == got.source_tokens
        # rewinding a live loader works too
        first.load_state_dict(state)
        assert first.source_tokens_total == counted.source_tokens_total
        assert torch.equal(next(first).input_ids, full[5].input_ids)


def test_set_seq_len_keeps_every_token(one_source):
    path, tok, _ = one_source
    base = build_dataloader(str(path), tok, 8, 1, 0, 1, seed=2, prefetch=0)
    staged = build_dataloader(str(path), tok, 16, 1, 0, 1, seed=2, prefetch=2)
    got = []
    for seq_len, n in ((16, 5), (32, 4), (8, 3), (64, 2)):
        if seq_len != staged.seq_len:
            staged.set_seq_len(seq_len)
        for b in take(staged, n):
            assert b.input_ids.shape == (1, seq_len)
            got += b.input_ids.flatten().tolist()
    want = torch.cat([b.input_ids.flatten() for b in take(base, len(got) // 8)]).tolist()
    assert got == want
    assert staged.state_dict()["seq_len"] == 64


def test_mixture_of_three_sources_tracks_weights(tmp_path):
    tok, _ = make_dataset(
        tmp_path, {"code": lengths(40, 100, 400, 1), "math": lengths(60, 5, 30, 2), "web": lengths(30, 20, 200, 3)}
    )
    weights = {"code": 0.5, "math": 0.2, "web": 0.3}
    loader = build_dataloader(str(tmp_path), tok, 32, 4, 1, 2, seed=3, mixture=weights)
    totals = dict.fromkeys(weights, 0)
    for i, b in enumerate(take(loader, 150)):
        assert sum(b.source_tokens.values()) == 4 * 32
        for k, v in b.source_tokens.items():
            totals[k] += v
        if i >= 20:  # tracks the weights all along, not only on average
            n = sum(totals.values())
            assert all(abs(totals[k] / n - w) < 0.04 for k, w in weights.items()), (i, totals)
    n = sum(totals.values())
    for k, w in weights.items():
        assert abs(totals[k] / n - w) < 0.01, totals
    assert max(abs(d) for d in loader.mixture_deviation().values()) < 0.01
    natural = build_dataloader(str(tmp_path), tok, 32, 4, 0, 1, seed=3)
    sizes = {k: sum(v) for k, v in zip(("code", "math", "web"), (lengths(40, 100, 400, 1), lengths(60, 5, 30, 2), lengths(30, 20, 200, 3)))}
    assert natural.weights == pytest.approx({k: v / sum(sizes.values()) for k, v in sizes.items()})
    zero = build_dataloader(str(tmp_path), tok, 32, 4, 0, 1, seed=3, mixture={"code": 1, "math": 0, "web": 1})
    assert sum(b.source_tokens["math"] for b in take(zero, 20)) == 0


def test_an_empty_mixture_takes_the_weights_the_dataset_was_prepared_with(tmp_path):
    """Weights written in the prepare config are trained on unless data.mixture says otherwise; weights all alike
    (prepare's default) leave the natural token proportions."""
    docs = {"code": lengths(40, 100, 400, 1), "web": lengths(30, 20, 200, 3)}
    sizes = {k: sum(v) for k, v in docs.items()}
    natural = {k: v / sum(sizes.values()) for k, v in sizes.items()}
    for name, recorded, want, origin in (
        ("uneven", {"code": 0.3, "web": 0.7}, {"code": 0.3, "web": 0.7}, "prepared"),
        ("alike", {"code": 1.0, "web": 1.0}, natural, "natural"),
        ("none", None, natural, "natural"),
    ):
        path = tmp_path / name
        path.mkdir()
        tok, _ = make_dataset(path, docs, **({"mixture": recorded} if recorded else {}))
        loader = build_dataloader(str(path), tok, 32, 4, 0, 1, seed=3)
        assert loader.weights == pytest.approx(want), name
        assert loader.describe()["mixture_from"] == origin, name
        own = build_dataloader(str(path), tok, 32, 4, 0, 1, seed=3, prepared_weights=False)  # validation's
        assert own.weights == pytest.approx(natural) and own.describe()["mixture_from"] == "natural", name
        given = build_dataloader(str(path), tok, 32, 4, 0, 1, seed=3, mixture={"code": 1, "web": 1})
        assert given.weights == pytest.approx({"code": 0.5, "web": 0.5}) and given.describe()["mixture_from"] == "data.mixture"
    totals = dict.fromkeys(docs, 0)
    for b in take(build_dataloader(str(tmp_path / "uneven"), tok, 32, 4, 0, 1, seed=3), 100):
        for k, v in b.source_tokens.items():
            totals[k] += v
    assert abs(totals["code"] / sum(totals.values()) - 0.3) < 0.02  # the batches follow the prepared weights


def test_bad_arguments(one_source, tmp_path):
    path, tok, _ = one_source
    with pytest.raises(ValueError, match=r"mixture: unknown source\(s\) \['wiki'\]"):
        build_dataloader(str(path), tok, 8, 1, 0, 1, 0, mixture={"web": 1.0, "wiki": 1.0})
    with pytest.raises(ValueError, match="dp_rank=2"):
        build_dataloader(str(path), tok, 8, 1, 2, 2, 0)
    with pytest.raises(ValueError, match="seq_len=0"):
        build_dataloader(str(path), tok, 0, 1, 0, 1, 0)
    with pytest.raises(ValueError, match="split='validation'"):
        build_dataloader(str(path), tok, 8, 1, 0, 1, 0, split="validation")
    other = StubTokenizer()
    other.sha256 = "d" * 64
    with pytest.raises(ValueError, match="built with tokenizer"):
        build_dataloader(str(path), other, 8, 1, 0, 1, 0)
    loader = build_dataloader(str(path), tok, 8, 1, 0, 1, 0)
    with pytest.raises(ValueError, match="seed"):
        loader.load_state_dict(dict(loader.state_dict(), seed=1))


def test_wait_seconds_counts_consumer_blocking(one_source):
    path, tok, _ = one_source
    loader = build_dataloader(str(path), tok, 8, 2, 0, 1, 0, prefetch=2)
    take(loader, 5)
    assert loader.wait_seconds > 0
    loader.close()


def test_token_ids_outside_the_vocabulary_stop_on_the_host():
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    labels = torch.tensor([[2, 3, IGNORE_INDEX], [5, 6, 7]])
    batch = Batch(ids, labels, torch.tensor([0, 3, 6]), {}, torch.zeros(2, dtype=torch.int64))
    assert check_token_ids(batch, 8) is batch  # ignored labels are fine
    with pytest.raises(ValueError, match=r"labels\[1, 2\] = 7: outside the model's vocabulary \[0, 7\)"):
        check_token_ids(batch, 7)
    batch.input_ids[0, 1] = IGNORE_INDEX  # an input id is never "ignored"
    with pytest.raises(ValueError, match=r"input_ids\[0, 1\] = -100"):
        check_token_ids(batch, 8)


def test_a_position_from_another_dataset_is_refused(tmp_path):
    """Two datasets with the same source names: a position saved in one would read other documents in the other,
    so loading it stops with a line naming both hashes and changes nothing."""
    for name, seed in (("a", 1), ("b", 2)):
        (tmp_path / name).mkdir()
        tok, _ = make_dataset(tmp_path / name, {"code": lengths(20, 10, 90, seed), "web": lengths(20, 10, 90, seed + 5)})
    first = build_dataloader(str(tmp_path / "a"), tok, 16, 2, 0, 1, seed=0, prefetch=0)
    take(first, 3)
    saved = first.state_dict()
    again = build_dataloader(str(tmp_path / "a"), tok, 16, 2, 0, 1, seed=0, prefetch=0)
    again.load_state_dict(saved)  # the same dataset resumes
    other = build_dataloader(str(tmp_path / "b"), tok, 16, 2, 0, 1, seed=0, prefetch=0)
    fresh = other.state_dict()
    with pytest.raises(ValueError, match=r"^loader state is a position in dataset sha256 \w{12}\.\.\., this run reads "
                                         r"dataset sha256 \w{12}\.\.\. \(another dataset"):
        other.load_state_dict(saved)
    assert other.state_dict() == fresh
    legacy = {k: v for k, v in saved.items() if k != "dataset_sha256"}  # saved before the hash was recorded
    other.load_state_dict(legacy)
    assert other.state_dict()["seq_index"] == saved["seq_index"]


def test_prepared_weights_naming_a_source_without_documents(tmp_path):
    """prepare records a weight for every configured source, also one that yielded no document (an empty file, all
    filtered out): the run stops naming it and the way out, instead of blaming a data.mixture nobody set."""
    docs = {"code": lengths(20, 10, 90, 1), "web": lengths(20, 10, 90, 2)}
    (tmp_path / "empty").mkdir()
    tok, _ = make_dataset(tmp_path / "empty", docs, mixture={"code": 0.3, "web": 0.6, "nothing": 0.1})
    with pytest.raises(ValueError, match=r"prepared with weights for source\(s\) 'nothing' \(weight 0.1\) that have "
                                         r"no documents in split 'train'; set data.mixture to weights of the sources it "
                                         r"has: \['code', 'web'\]"):
        build_dataloader(str(tmp_path / "empty"), tok, 16, 2, 0, 1, seed=0)
    given = build_dataloader(str(tmp_path / "empty"), tok, 16, 2, 0, 1, seed=0, mixture={"code": 1, "web": 3})
    assert given.weights == pytest.approx({"code": 0.25, "web": 0.75})
    (tmp_path / "zero").mkdir()  # a weight of 0 asks for nothing of it
    tok, _ = make_dataset(tmp_path / "zero", docs, mixture={"code": 0.3, "web": 0.6, "nothing": 0.0})
    loader = build_dataloader(str(tmp_path / "zero"), tok, 16, 2, 0, 1, seed=0)
    assert loader.weights == pytest.approx({"code": 1 / 3, "web": 2 / 3})
    assert loader.describe()["mixture_from"] == "prepared"


@pytest.mark.parametrize("new_world", [1, 4])
def test_resume_on_another_number_of_ranks_continues_the_global_stream_and_its_counts(tmp_path, new_world):
    """A position saved by 2 ranks resumes on 1 or 4 (the same global batch): every later global batch is the
    uninterrupted run's, split disjointly, and the tokens per source summed over the ranks (what metrics.jsonl
    reports and data.source_mix checks) go on from the saved ones instead of restarting from this session's."""
    tok, _ = make_dataset(tmp_path, {"a": lengths(30, 1, 60, 1), "b": lengths(20, 5, 90, 2), "c": lengths(25, 3, 40, 3)})
    mix, G, T = {"a": 0.5, "b": 0.3, "c": 0.2}, 4, 16

    def loaders(world):
        return [build_dataloader(str(tmp_path), tok, T, G // world, r, world, seed=4, mixture=mix, prefetch=0)
                for r in range(world)]

    def fingerprints(ranks, n):
        got = []
        for _ in range(n):
            batches = [next(loader) for loader in ranks]
            per_rank = [set(b.fingerprints.tolist()) for b in batches]
            assert sum(map(len, per_rank)) == len(set().union(*per_rank))  # disjoint
            got.append(sorted(set().union(*per_rank)))
        return got

    def summed(ranks):
        return {k: sum(loader.source_tokens_total[k] for loader in ranks) for k in mix}

    uninterrupted = loaders(2)
    want = fingerprints(uninterrupted, 9)
    saved_by = loaders(2)
    assert fingerprints(saved_by, 5) == want[:5]
    state = saved_by[0].state_dict()
    resumed = loaders(new_world)
    for loader in resumed:
        loader.load_state_dict(state)
    assert summed(resumed) == summed(saved_by)
    assert fingerprints(resumed, 4) == want[5:]
    assert summed(resumed) == summed(uninterrupted)
    assert sum(summed(resumed).values()) == 9 * G * T


def test_a_small_source_read_twice_in_an_update_is_not_one_sequence_on_two_ranks(tmp_path):
    """A source smaller than an update's share of it repeats its windows' text within the update (here two documents
    of 2T tokens at half the mixture): the same text at two positions of the stream is two sequences, so no
    fingerprint may sit on both ranks (data.disjoint_sequences reported ranks reading overlapping data); ranks that do
    read the same positions (both built as rank 0) still share every fingerprint."""
    T = 16
    tok, _ = make_dataset(tmp_path, {"big": lengths(40, 10, 200, 1), "small": [T, T]})
    mix = {"big": 0.5, "small": 0.5}
    ranks = [build_dataloader(str(tmp_path), tok, T, 4, r, 2, seed=0, mixture=mix, prefetch=0) for r in range(2)]
    texts = []
    for _ in range(20):
        b0, b1 = (next(loader) for loader in ranks)
        assert not set(b0.fingerprints.tolist()) & set(b1.fingerprints.tolist())
        texts.append(len({tuple(r) for r in b0.input_ids.tolist()} & {tuple(r) for r in b1.input_ids.tolist()}))
    assert max(texts) > 0  # the same text did sit on both ranks
    same = [build_dataloader(str(tmp_path), tok, T, 4, 0, 2, seed=0, mixture=mix, prefetch=0) for _ in range(2)]
    assert torch.equal(next(same[0]).fingerprints, next(same[1]).fingerprints)


def test_a_resume_says_what_of_the_mixture_it_does_not_take_as_saved(tmp_path):
    tok, _ = make_dataset(tmp_path, {"code": lengths(20, 10, 90, 1), "web": lengths(20, 10, 90, 2)})
    first = build_dataloader(str(tmp_path), tok, 16, 2, 0, 1, seed=0, prefetch=0, mixture={"code": 1, "web": 3})
    take(first, 2)
    same = build_dataloader(str(tmp_path), tok, 16, 2, 0, 1, seed=0, prefetch=0, mixture={"code": 2, "web": 6})
    same.load_state_dict(first.state_dict())
    assert same.resume_note == ""
    other = build_dataloader(str(tmp_path), tok, 16, 2, 0, 1, seed=0, prefetch=0, mixture={"code": 1, "web": 1})
    other.load_state_dict(first.state_dict())
    assert other.resume_note == ("data mixture changed since the checkpoint, from this update on: code 0.25 -> 0.5, "
                                 "web 0.75 -> 0.5 (per-source counts restart)")


def test_a_weighted_source_without_documents_in_the_split_is_refused(tmp_path):
    """A source of the dataset with documents only in another split took its weight's share from nobody: the others
    trained on it, so 'code:1,prose:3' trained on code alone."""
    tok, dtype = StubTokenizer(), token_dtype(VOCAB)
    docs = [np.arange(1, 40).astype(dtype), np.arange(40, 90).astype(dtype)]
    train = [write_shard(tmp_path, "train-code-00000", docs, source="code", dtype=dtype)]
    val = [write_shard(tmp_path, f"validation-{s}-00000", docs, source=s, dtype=dtype) for s in ("code", "prose")]
    write_index(tmp_path, tok, {"train": train, "validation": val})
    with pytest.raises(ValueError, match=r"^mixture: source\(s\) \['prose'\] weighted above 0 have no documents in "
                                         r"split 'train'; its sources with documents: \['code'\]"):
        build_dataloader(str(tmp_path), tok, 16, 2, 0, 1, seed=0, mixture={"code": 1, "prose": 3})
    loader = build_dataloader(str(tmp_path), tok, 16, 2, 0, 1, seed=0, mixture={"code": 1, "prose": 0})
    assert loader.weights == {"code": 1.0}
