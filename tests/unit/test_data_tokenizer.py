"""Tokenizer loading and round trips: embedded, HF tokenizer.json, tiktoken BPE file."""

import base64

import pytest

from titan_k3.data.tokenizer import EOS_TOKEN, load_tokenizer, train_bpe

TEXTS = [
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Unicode: héllo wörld, 世界, emoji \N{SNAKE}, tabs\tand\r\nnewlines.",
]


def test_train_bpe_and_load_hf_json_round_trip(tmp_path):
    tok = train_bpe(TEXTS * 20, vocab_size=300, out_path=tmp_path / "tokenizer.json")
    loaded = load_tokenizer(tmp_path / "tokenizer.json")
    assert loaded.sha256 == tok.sha256 and len(loaded.sha256) == 64
    assert loaded.vocab_size == 300
    assert loaded.decode([loaded.eos_id]) == EOS_TOKEN
    for text in TEXTS + ["unseen ∮ characters ☃ still round-trip"]:
        ids = loaded.encode(text)
        assert max(ids) < loaded.vocab_size
        assert loaded.decode(ids) == text
    assert loaded.encode_batch(TEXTS) == [loaded.encode(t) for t in TEXTS]
    # merges were learned: a frequent phrase takes fewer tokens than bytes
    assert len(loaded.encode(TEXTS[1])) < len(TEXTS[1].encode()) // 2
    # a literal EOS string in data never becomes the EOS id
    assert loaded.eos_id not in loaded.encode(f"a{EOS_TOKEN}b")


def _write_tiktoken(path):
    ranks = [bytes([b]) for b in range(256)] + [b"th", b"the", b" the", b"in", b"ing"]
    path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for r, t in enumerate(ranks)))
    return len(ranks)


def test_tiktoken_file_round_trip(tmp_path):
    n_ranks = _write_tiktoken(tmp_path / "tiny.tiktoken")
    tok = load_tokenizer(tmp_path / "tiny.tiktoken")
    assert tok.eos_id == n_ranks
    assert tok.vocab_size == 512  # EOS + reserved specials up to a multiple of 256
    assert tok.encode(" the") == [258]
    assert tok.encode("thing") == [256, 260]
    for text in TEXTS:
        assert tok.decode(tok.encode(text)) == text
    assert tok.encode_batch(TEXTS) == [tok.encode(t) for t in TEXTS]
    assert tok.decode([tok.eos_id]) == EOS_TOKEN


def test_tiktoken_malformed_line(tmp_path):
    bad = tmp_path / "bad.model"
    bad.write_text("QQ== 0\nnot-base64!! x\n")
    with pytest.raises(ValueError, match=r"bad\.model.*line 2"):
        load_tokenizer(bad)


@pytest.mark.parametrize("name", ["missing.json", "missing.tiktoken"])
def test_missing_file_names_path(tmp_path, name):
    with pytest.raises(ValueError, match=name):
        load_tokenizer(tmp_path / name)


def test_unknown_suffix(tmp_path):
    p = tmp_path / "vocab.txt"
    p.write_text("x")
    with pytest.raises(ValueError, match=r"vocab\.txt.*unknown file type"):
        load_tokenizer(p)


def test_hf_json_invalid(tmp_path):
    p = tmp_path / "tokenizer.json"
    p.write_text("{}")
    with pytest.raises(ValueError, match="not a valid HF tokenizer.json"):
        load_tokenizer(p)


def test_train_bpe_rejects_tiny_vocab(tmp_path):
    with pytest.raises(ValueError, match="vocab_size=100"):
        train_bpe(TEXTS, vocab_size=100, out_path=tmp_path / "t.json")


def _tiktoken_lines(path, pairs):
    path.write_text("".join(f"{base64.b64encode(tok).decode()} {rank}\n" for tok, rank in pairs))
    return path


@pytest.mark.parametrize("extra, match", [
    ([(b"ab", 256), (b"cd", 256)], r"line 258: rank 256 again \(first on line 257\)"),  # tiktoken panicked in Rust
    ([(b"ab", 256), (b"ab", 257)], r"line 258: token b'ab' again \(first on line 257\)"),  # the last one won silently
    ([(b"ab", -5)], r"line 257: rank -5 is negative"),  # an OverflowError traceback
])
def test_a_tiktoken_table_tiktoken_would_take_wrongly_names_the_line(tmp_path, extra, match):
    path = _tiktoken_lines(tmp_path / "bad.tiktoken", [(bytes([i]), i) for i in range(256)] + extra)
    with pytest.raises(ValueError, match=rf"bad\.tiktoken' {match}"):
        load_tokenizer(path)


def test_a_tiktoken_table_without_every_byte_is_refused_at_load(tmp_path):
    """tiktoken panics in Rust (PanicException, past `except Exception`) at the first text holding a byte the table
    lacks: during prepare's stage C, long after the start."""
    path = _tiktoken_lines(tmp_path / "bytes.tiktoken", [(bytes([i]), i) for i in range(256) if i != ord("c")])
    with pytest.raises(ValueError, match=r"bytes\.tiktoken': no token for 1 of the 256 single bytes \(first b'c'\)"):
        load_tokenizer(path)
