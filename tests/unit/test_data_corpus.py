"""The embedded corpus: built once from the standard library, reused, loadable end to end."""

import json

import pytest

from titan_k3.data.corpus import embedded_name, ensure_embedded_dataset
from titan_k3.data.loader import build_dataloader
from titan_k3.data.shards import iter_documents, open_dataset
from titan_k3.data.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def embedded():
    # NOTE: the default cache (or $TITAN_K3_CACHE): built once per machine, shared with training.
    return ensure_embedded_dataset()


def test_embedded_dataset_layout(embedded):
    index = json.loads((embedded / "index.json").read_text())
    assert embedded.name == embedded_name() == index["name"]
    assert [s["name"] for s in index["sources"]] == ["code", "prose"]
    code, prose = index["sources"]
    assert code["n_tokens"] > 300_000 and prose["n_tokens"] > 100_000
    assert set(index["splits"]) == {"train", "validation"}
    n_val = sum(r["n_docs"] for r in index["splits"]["validation"]["shards"])
    n_all = code["n_docs"] + prose["n_docs"]
    assert 0.005 < n_val / n_all < 0.05
    hashes = {
        split: {json.loads(line)["sha256"] for r in body["shards"] for line in (embedded / r["docs"]).read_text().splitlines()}
        for split, body in index["splits"].items()
    }
    assert not hashes["train"] & hashes["validation"]
    assert ensure_embedded_dataset() == embedded  # reused, not rebuilt


def test_embedded_tokenizer_round_trip(embedded):
    tok = load_tokenizer("embedded")
    assert tok.vocab_size == 8192 and tok.name == embedded_name()
    ds = open_dataset(embedded, tok)
    text = 'def f(x: int) -> str:\n    """Docstring with ünïcode ✓."""\n    return str(x)\n'
    assert tok.decode(tok.encode(text)) == text
    assert len(tok.encode(text)) < len(text) / 2
    source, doc = next(iter_documents(ds, "validation"))
    assert int(doc[-1]) == tok.eos_id and tok.eos_id not in doc[:-1].tolist()


def test_embedded_loader_batches(embedded):
    tok = load_tokenizer("embedded")
    loader = build_dataloader("embedded", tok, 128, 2, 0, 1, seed=0, mixture={"code": 0.5, "prose": 0.5})
    for _ in range(4):
        batch = next(loader)
    assert batch.input_ids.shape == (2, 128) and int(batch.input_ids.max()) < tok.vocab_size
    val = build_dataloader("embedded", tok, 128, 2, 0, 1, seed=0, split="validation", prefetch=0)
    assert next(val).input_ids.shape == (2, 128)
