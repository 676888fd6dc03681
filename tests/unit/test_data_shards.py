"""Shard format: write/read round trip, corrupt and truncated shards, tokenizer mismatch."""

import json

import numpy as np
import pytest

from titan_k3.data.shards import iter_documents, open_dataset, token_dtype, write_index, write_shard
from titan_k3.data.tokenizer import Tokenizer


class StubTokenizer(Tokenizer):
    def __init__(self, vocab_size=1000, sha="a" * 64):
        self.name, self.sha256, self.vocab_size, self.eos_id = "stub", sha, vocab_size, 0

    def encode(self, text):
        return [ord(c) for c in text]  # one id per character: the datasets here are written as ids

    def decode(self, ids):
        return "".join(map(chr, ids))


def _write(tmp_path, vocab_size=1000):
    tok = StubTokenizer(vocab_size)
    dtype = token_dtype(vocab_size)
    rng = np.random.default_rng(0)
    docs = {src: [np.append(rng.integers(1, vocab_size, n), 0).astype(dtype) for n in lens]
            for src, lens in {"a": [5, 1, 30], "b": [7, 2]}.items()}
    recs = [write_shard(tmp_path, f"train-{s}-00000", d, source=s, dtype=dtype,
                        provenance=[{"id": f"{s}{i}"} for i in range(len(d))]) for s, d in docs.items()]
    write_index(tmp_path, tok, {"train": recs})
    return tok, docs


@pytest.mark.parametrize("vocab_size,dtype", [(1000, "uint16"), (65535, "uint16"), (70000, "uint32")])
def test_round_trip(tmp_path, vocab_size, dtype):
    tok, docs = _write(tmp_path, vocab_size)
    ds = open_dataset(tmp_path, tok, verify="sha256")
    assert ds.index["dtype"] == dtype and ds.source_names == ["a", "b"]
    got = list(iter_documents(ds, "train"))
    want = [(s, d) for s in ("a", "b") for d in docs[s]]
    assert [s for s, _ in got] == [s for s, _ in want]
    for (_, g), (_, w) in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), w)
    a = next(r for r in ds.index["sources"] if r["name"] == "a")
    assert a == {"name": "a", "n_docs": 3, "n_tokens": 5 + 1 + 30 + 3}
    prov = (tmp_path / "train-b-00000.docs.jsonl").read_text().splitlines()
    assert [json.loads(x)["id"] for x in prov] == ["b0", "b1"]
    assert not list(tmp_path.glob("*.tmp*"))


def test_truncated_shard_names_it(tmp_path):
    tok, _ = _write(tmp_path)
    p = tmp_path / "train-b-00000.bin"
    p.write_bytes(p.read_bytes()[:-2])
    with pytest.raises(ValueError, match=r"shard train-b-00000\.bin.*truncated"):
        open_dataset(tmp_path, tok, verify="size")


def test_corrupt_bytes_caught_by_sha(tmp_path):
    tok, _ = _write(tmp_path)
    p = tmp_path / "train-a-00000.bin"
    data = bytearray(p.read_bytes())
    data[3] ^= 0xFF
    p.write_bytes(bytes(data))
    open_dataset(tmp_path, tok, verify="size")  # same size: only the hash can tell
    with pytest.raises(ValueError, match=r"shard train-a-00000\.bin.*sha256.*corrupt"):
        open_dataset(tmp_path, tok, verify="auto")


def test_missing_and_bad_offsets(tmp_path):
    tok, _ = _write(tmp_path)
    np.save(tmp_path / "train-a-00000.idx.npy", np.array([0, 5, 3, 39]))
    with pytest.raises(ValueError, match=r"shard train-a-00000\.bin.*offsets"):
        open_dataset(tmp_path, tok, verify="size")
    _write(tmp_path)
    (tmp_path / "train-b-00000.bin").unlink()
    with pytest.raises(ValueError, match=r"train-b-00000\.bin is missing"):
        open_dataset(tmp_path, tok, verify="size")


def test_tokenizer_mismatch(tmp_path):
    _write(tmp_path)
    with pytest.raises(ValueError, match="built with tokenizer 'stub'"):
        open_dataset(tmp_path, StubTokenizer(sha="b" * 64))


def test_not_a_dataset(tmp_path):
    with pytest.raises(ValueError, match="no index.json"):
        open_dataset(tmp_path)


def test_token_too_large_for_dtype(tmp_path):
    with pytest.raises(ValueError, match="does not fit uint16"):
        write_shard(tmp_path, "x", [np.array([70000, 0])], source="a", dtype=np.dtype("<u2"))


def _edit_index(tmp_path, edit):
    index = json.loads((tmp_path / "index.json").read_text())
    edit(index)
    (tmp_path / "index.json").write_text(json.dumps(index))


def _drop(key):
    return lambda index: index.pop(key)


def _shard(key, value=None):
    def edit(index):
        rec = index["splits"]["train"]["shards"][1]
        rec.pop(key) if value is None else rec.__setitem__(key, value)
    return edit


@pytest.mark.parametrize("edit,named", [
    (_drop("tokenizer"), "key 'tokenizer' is missing"),
    (_drop("splits"), "key 'splits' is missing"),
    (lambda index: index["tokenizer"].pop("sha256"), "key 'tokenizer.sha256' is missing"),
    (lambda index: index.__setitem__("dtype", "float32"), "key 'dtype': 'float32', expected 'uint16'"),
    (lambda index: index.__setitem__("splits", []), "key 'splits': .* is not a table of splits"),
    (_shard("n_tokens"), r"key 'splits\.train\.shards\[1\]\.n_tokens' is missing"),
    (_shard("n_docs", "2"), r"key 'splits\.train\.shards\[1\]\.n_docs': '2' is not an integer"),
    (_shard("file", "../train-b-00000.bin"), r"key 'splits\.train\.shards\[1\]\.file': '\.\./train-b-00000\.bin' is not a file name"),
    (lambda index: index.__setitem__("mixture", {"a": "high"}), "key 'mixture'"),
])
def test_an_index_missing_or_mistyping_a_key_names_it(tmp_path, edit, named):
    tok, _ = _write(tmp_path)
    _edit_index(tmp_path, edit)
    with pytest.raises(ValueError, match=rf"^dataset '{tmp_path}': index\.json {named}"):
        open_dataset(tmp_path, tok, verify="size")
