"""The prepare pipeline on fixtures built here: decisions, near-dup thresholds, decontamination,
input formats, resumption after a crash, and the loader reading the result."""

import json
import os
import random
import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from titan_k3.data.loader import build_dataloader
from titan_k3.data.prepare.__main__ import main as prepare_main
from titan_k3.data.prepare.config import PrepareConfig, SourceConfig, load_config
from titan_k3.data.prepare.pipeline import prepare
from titan_k3.data.shards import open_dataset
from titan_k3.data.tokenizer import load_tokenizer, train_bpe

WORDS = ["".join(random.Random(i).choices("abcdefghijklmnoprstuvwy", k=3 + i % 6)) for i in range(5000)]


def prose(n_words: int, seed: int) -> str:
    """Natural-looking text: sentences of random words, several lines."""
    rng = random.Random(seed)
    out, line = [], []
    for i in range(n_words):
        line.append(rng.choice(WORDS))
        if len(line) >= 12 and rng.random() < 0.15:
            out.append(" ".join(line).capitalize() + ".")
            line = []
    out.append(" ".join(line) + ".")
    return "\n".join(out)


def write_jsonl(path, docs):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in docs))


@pytest.fixture(scope="module")
def tokenizer_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    train_bpe([prose(400, s) for s in range(20)], 400, path)
    return str(path)


def run(tmp_path, tokenizer_path, sources, **kw):
    cfg = PrepareConfig(output=str(tmp_path / kw.pop("out", "out")), tokenizer=tokenizer_path, workers=kw.pop("workers", 1), sources=sources)
    for key, value in kw.items():
        section, _, name = key.rpartition("__")
        setattr(getattr(cfg, section) if section else cfg, name, value)
    out = prepare(cfg, log=lambda *_: None)
    decisions = {d["id"]: d for d in map(json.loads, (out / "decisions.jsonl").read_text().splitlines())}
    return out, decisions


def mutate(text: str, rate: float, seed: int) -> str:
    """Replace a `rate` fraction of the words (exactly, at random positions) by new words."""
    words = text.split(" ")
    rng = random.Random(seed)
    for i in rng.sample(range(len(words)), round(rate * len(words))):
        words[i] = "zq" + "".join(rng.choices("xyzqj", k=6))
    return " ".join(words)


def shingle_jaccard(a: str, b: str, k: int = 5) -> float:
    def sh(t):
        w = re.findall(r"\w+", t.lower())
        return {tuple(w[i : i + k]) for i in range(len(w) - k + 1)}

    sa, sb = sh(a), sh(b)
    return len(sa & sb) / len(sa | sb)


def test_each_decision_from_a_document_built_for_it(tmp_path, tokenizer_path):
    base = prose(300, 1)
    bench_context = prose(40, 99).replace("\n", " ")
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "quiz.jsonl").write_text(json.dumps({"context": bench_context, "choices": ["yes it is", "no"], "gold": 0}) + "\n")
    planted = " ".join(bench_context.split(" ")[5:18])  # 13 words
    web = [
        ("good", base),
        ("short", "Too short to train on."),
        ("symbols", " ".join(["### 12 $$ 34 %% 56"] * 40)),
        ("digits", " ".join(f"{w} {1000 + i}" for i, w in enumerate(prose(200, 2).split()))),
        ("rep_lines", "\n".join(["the same line of text again here"] * 30)),
        ("rep_ngrams", ("alpha beta gamma delta " * 60).strip()),
        ("short_lines", "\n".join(prose(200, 3).split())),
        ("near", mutate(base, 0.01, 5)),
        ("contam", prose(100, 4) + " " + planted + " " + prose(100, 6)),
    ]
    code = [("dup", base.replace("\n", "  \r\n") + "\n\n\n\n\n")]  # equal after normalisation
    write_jsonl(tmp_path / "web" / "a.jsonl", web)
    write_jsonl(tmp_path / "code" / "b.jsonl", code)
    out, d = run(
        tmp_path, tokenizer_path,
        [SourceConfig("web", str(tmp_path / "web")), SourceConfig("code", str(tmp_path / "code"))],
        decontamination__benchmarks=[str(tmp_path / "bench" / "quiz.jsonl")],
    )
    assert d["good"]["decision"] == "accepted"
    assert d["short"]["decision"] == "too_short" and d["short"]["reason"]["rule"] == "min_chars"
    rules = {"symbols": "alpha_ratio", "digits": "digit_ratio", "rep_lines": "dup_line_frac",
             "rep_ngrams": "dup_ngram_frac", "short_lines": "mean_line_chars"}
    for doc, rule in rules.items():
        assert d[doc]["decision"] == "low_quality" and d[doc]["reason"]["rule"] == rule, d[doc]
    assert d["near"]["decision"] == "near_duplicate" and d["near"]["reason"]["duplicate_of"] == "web/good"
    assert d["near"]["reason"]["jaccard"] >= 0.8
    assert d["dup"]["decision"] == "exact_duplicate" and d["dup"]["reason"] == {"duplicate_of": "web/good"}
    assert d["contam"]["decision"] == "contaminated"
    assert d["contam"]["reason"]["benchmark"] == "quiz" and d["contam"]["reason"]["ngram"] == " ".join(re.findall(r"\w+", planted.lower()))
    report = (out / "report.md").read_text()
    assert "| quiz | 1 |" in report and "removed nothing" in report and "`low_quality/alpha_ratio`" not in report
    index = json.loads((out / "index.json").read_text())
    assert index["mixture"] == {"web": 1.0, "code": 1.0}
    ds = open_dataset(out, load_tokenizer(tokenizer_path))
    prov = [json.loads(x) for r in index["splits"]["train"]["shards"] for x in (out / r["docs"]).read_text().splitlines()]
    assert [p["id"] for p in prov] == ["good"] and prov[0]["source"] == "web" and len(prov[0]["sha256"]) == 64
    assert sum(s.n_docs for s in ds.split_shards("train")) == 1


def test_near_duplicates_around_the_threshold(tmp_path, tokenizer_path):
    threshold = 0.7
    docs, expect = [], {}
    for k, rate in enumerate([0.005, 0.01, 0.02, 0.08, 0.12, 0.2]):
        base = prose(600, 100 + k)
        variant = mutate(base, rate, k)
        j = shingle_jaccard(base, variant)
        assert abs(j - threshold) > 0.1  # each pair is clearly on one side
        expect[f"v{k}"] = j >= threshold
        docs += [(f"b{k}", base), (f"v{k}", variant)]
    assert any(expect.values()) and not all(expect.values())
    write_jsonl(tmp_path / "web" / "a.jsonl", docs)
    _, d = run(tmp_path, tokenizer_path, [SourceConfig("web", str(tmp_path / "web"))], near_dedup__threshold=threshold)
    for key, is_dup in expect.items():
        assert (d[key]["decision"] == "near_duplicate") == is_dup, (key, d[key])
        if is_dup:
            assert d[key]["reason"]["duplicate_of"] == f"web/b{key[1:]}"
    assert all(d[f"b{k}"]["decision"] == "accepted" for k in range(6))


@pytest.mark.parametrize("n", [13, 8])
def test_planted_ngrams_removed_and_reported(tmp_path, tokenizer_path, n):
    ctx = [prose(30, 200 + i).replace("\n", " ") for i in range(2)]
    gold = "the answer continues right here"
    bench = tmp_path / "bench"
    bench.mkdir()
    (bench / "arc.jsonl").write_text(json.dumps({"context": ctx[0], "choices": ["wrong", gold], "gold": 1}) + "\n")
    (bench / "piqa.jsonl").write_text(json.dumps({"context": ctx[1], "choices": ["x"], "gold": 0}) + "\n")
    w0 = ctx[0].rstrip(".").split(" ")
    docs = [
        ("plant13", prose(80, 1) + " " + " ".join(w0[3:16]) + " " + prose(80, 2)),
        ("plant10", prose(80, 3) + " " + " ".join(w0[3:13]) + " " + prose(80, 4)),
        ("boundary", prose(80, 5) + " " + " ".join(w0[-8:]) + " " + gold + " " + prose(80, 6)),
        ("clean", prose(160, 7)),
    ]
    write_jsonl(tmp_path / "web" / "a.jsonl", docs)
    out, d = run(
        tmp_path, tokenizer_path, [SourceConfig("web", str(tmp_path / "web"))],
        decontamination__benchmarks=[str(bench / "arc.jsonl"), str(bench / "piqa.jsonl")], decontamination__n=n,
    )
    assert d["plant13"]["decision"] == "contaminated" and d["plant13"]["reason"]["benchmark"] == "arc"
    assert d["boundary"]["decision"] == "contaminated"  # context followed by the gold answer
    assert d["plant10"]["decision"] == ("contaminated" if n <= 10 else "accepted")
    assert d["clean"]["decision"] == "accepted"
    stats = json.loads((out / "stats.json").read_text())
    assert stats["contamination"]["arc"]["docs"] == (3 if n <= 10 else 2)
    report = (out / "report.md").read_text()
    assert f"## Decontamination ({n}-grams)" in report and "`contaminated/piqa`" in report


def test_input_formats_each_document_once(tmp_path, tokenizer_path):
    docs = [(f"j{i}", prose(60 + i, 300 + i)) for i in range(25)]
    write_jsonl(tmp_path / "jsonl" / "a.jsonl", docs)  # cut into byte ranges mid-line below
    zstd = pytest.importorskip("zstandard")
    raw = "".join(json.dumps({"text": prose(70, 400 + i)}) + "\n" for i in range(5)).encode()
    (tmp_path / "zst").mkdir()
    (tmp_path / "zst" / "b.jsonl.zst").write_bytes(zstd.ZstdCompressor().compress(raw))
    (tmp_path / "txt" / "sub").mkdir(parents=True)
    for i in range(4):
        (tmp_path / "txt" / ("sub" if i % 2 else "") / f"f{i}.txt").write_text(prose(70, 500 + i))
    (tmp_path / "txt" / ".hidden").write_text("ignored")
    sources = [SourceConfig("j", str(tmp_path / "jsonl")), SourceConfig("z", str(tmp_path / "zst")), SourceConfig("t", str(tmp_path / "txt"))]
    _, d = run(tmp_path, tokenizer_path, sources, unit_mb=0.003)
    assert sorted(k for k in d if k.startswith("j")) == sorted(i for i, _ in docs)
    assert sorted(k for k in d if k.startswith("b.jsonl")) == [f"b.jsonl.zst:{i}" for i in range(1, 6)]
    assert sorted(k for k in d if k.endswith(".txt")) == ["f0.txt", "f2.txt", "sub/f1.txt", "sub/f3.txt"]
    assert all(v["decision"] == "accepted" for v in d.values())


def test_parquet_source(tmp_path, tokenizer_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    (tmp_path / "pq").mkdir()
    pq.write_table(pa.table({"text": [prose(80, 600 + i) for i in range(3)]}), tmp_path / "pq" / "a.parquet")
    _, d = run(tmp_path, tokenizer_path, [SourceConfig("p", str(tmp_path / "pq"))])
    assert sorted(d) == ["a.parquet#0", "a.parquet#1", "a.parquet#2"]


def _corpus(tmp_path):
    for s, name in enumerate(("web", "code")):
        docs = [(f"{name}{i}", prose(80 + 7 * i, 1000 * s + i)) for i in range(30)]
        docs += [(f"{name}-dup", docs[0][1])]
        write_jsonl(tmp_path / "in" / name / "a.jsonl", docs)
    return [SourceConfig("web", str(tmp_path / "in" / "web"), weight=0.6), SourceConfig("code", str(tmp_path / "in" / "code"), weight=0.4)]


def _files(out):
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.is_file() and p.name not in ("report.md", "stats.json")}


@pytest.mark.parametrize("workers", [1, 2])
def test_killed_and_rerun_prepare_matches_uninterrupted(tmp_path, tokenizer_path, monkeypatch, workers):
    sources = _corpus(tmp_path)
    kw = dict(unit_mb=0.004, shard_mb=0.006, validation_fraction=0.1, workers=workers)
    whole, _ = run(tmp_path, tokenizer_path, sources, out="whole", **kw)
    assert len([p for p in whole.glob("*.bin")]) >= 4 and len(json.loads((whole / "index.json").read_text())["splits"]["validation"]["shards"])
    resumed = tmp_path / "resumed"
    for crash in ("a:2", "c:2"):
        monkeypatch.setenv("TITAN_K3_PREPARE_CRASH_AFTER", crash)
        with pytest.raises(RuntimeError, match="debug crash"):
            run(tmp_path, tokenizer_path, sources, out="resumed", **kw)
        assert not (resumed / "index.json").exists()
    assert list(resumed.glob("*.bin"))  # the crash in stage C left finished shards behind
    monkeypatch.delenv("TITAN_K3_PREPARE_CRASH_AFTER")
    if workers == 1:  # inputs edited under an unfinished prepare: refuse to mix old and new
        extra = tmp_path / "in" / "web" / "late.jsonl"
        write_jsonl(extra, [("late", prose(90, 77))])
        with pytest.raises(ValueError, match="input files changed"):
            run(tmp_path, tokenizer_path, sources, out="resumed", **kw)
        extra.unlink()
    run(tmp_path, tokenizer_path, sources, out="resumed", **kw)
    assert _files(resumed) == _files(whole)
    assert not (resumed / ".prepare-work").exists() and not list(resumed.glob("*.tmp*"))
    # the loader reads the prepared dataset, per source
    tok = load_tokenizer(tokenizer_path)
    loader = build_dataloader(str(resumed), tok, 32, 2, 0, 1, seed=0, mixture={"web": 0.6, "code": 0.4})
    seen = dict.fromkeys(("web", "code"), 0)
    for _ in range(20):
        for k, v in next(loader).source_tokens.items():
            seen[k] += v
    assert abs(seen["web"] / sum(seen.values()) - 0.6) < 0.05
    text = tok.decode(next(loader).input_ids[0].tolist())
    assert any(w in text for w in WORDS[:2000])


def test_sigkilled_cli_resumes(tmp_path, tokenizer_path):
    sources = _corpus(tmp_path)
    args = ["--unit_mb", "0.004", "--shard_mb", "0.006", "--tokenizer", tokenizer_path, "--workers", "1"]
    args += [f"--source={s.name}={s.path}:{s.weight}" for s in sources]
    whole, _ = run(tmp_path, tokenizer_path, sources, out="whole", unit_mb=0.004, shard_mb=0.006)
    out = tmp_path / "killed"
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    proc = subprocess.run(
        [sys.executable, "-m", "titan_k3.data.prepare", "--output", str(out), *args],
        env=dict(env, TITAN_K3_PREPARE_CRASH_AFTER="c:2:kill"), capture_output=True, text=True,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert (out / ".prepare-work").is_dir() and not (out / "index.json").exists()
    (out / "train-web-00003.bin.tmp999").write_bytes(b"partial")  # as if killed mid-write
    proc = subprocess.run([sys.executable, "-m", "titan_k3.data.prepare", "--output", str(out), *args], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert _files(out) == _files(whole)


def test_rerun_of_complete_output_and_config_change(tmp_path, tokenizer_path):
    sources = _corpus(tmp_path)
    out, _ = run(tmp_path, tokenizer_path, sources)
    before = _files(out)
    run(tmp_path, tokenizer_path, sources)  # complete: nothing redone
    assert _files(out) == before
    with pytest.raises(ValueError, match="another config"):
        run(tmp_path, tokenizer_path, sources, near_dedup__threshold=0.5)


def test_cli_and_config_errors(tmp_path, tokenizer_path, capsys):
    sources = _corpus(tmp_path)
    toml = tmp_path / "data.toml"
    toml.write_text(
        f'output = "{tmp_path / "cli"}"\ntokenizer = "{tokenizer_path}"\nworkers = 1\n'
        f'[[sources]]\nname = "web"\npath = "{sources[0].path}"\nweight = 2.0\nfilters = {{ min_words = 5 }}\n'
        "[near_dedup]\nthreshold = 0.9\n"
    )
    assert prepare_main(["--config", str(toml), "--filters.min_chars", "50", "--source", f"code={sources[1].path}:1"]) == 0
    index = json.loads((tmp_path / "cli" / "index.json").read_text())
    assert index["mixture"] == {"web": 2.0, "code": 1.0}
    cfg = load_config(str(toml), {"filters.min_chars": "50"}, [])
    assert cfg.filters.min_chars == 50 and cfg.near_dedup.threshold == 0.9 and cfg.sources[0].filters == {"min_words": 5}
    with pytest.raises(ValueError, match=r"near_dedup.treshold: unknown key \(did you mean 'threshold'\?\)"):
        load_config(str(toml), {"near_dedup.treshold": "0.5"}, [])
    with pytest.raises(ValueError, match="near_dedup.threshold=1.5: must be in"):
        load_config(str(toml), {"near_dedup.threshold": "1.5"}, [])
    with pytest.raises(ValueError, match="workers='two': expected int"):
        load_config(str(toml), {"workers": "two"}, [])
    with pytest.raises(ValueError, match=r"sources\[nope\].path=.*no such file"):
        load_config(None, {}, [f"nope={tmp_path / 'missing'}"])
    assert prepare_main(["--source", f"x={tmp_path / 'missing'}"]) == 2
    assert "no such file or directory" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"context": "a", "choices": [], "gold": 0}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl' line 1: expected .*\(gold = 0 with 0 choices\)"):
        run(tmp_path, tokenizer_path, sources, out="bad", decontamination__benchmarks=[str(bad)])
    assert not (tmp_path / "bad" / "index.json").exists()


def test_word_hash_pipeline_is_stable():
    from titan_k3.data.prepare.quality import ngram_hashes, word_hashes, words

    wh = word_hashes(words("The quick brown fox; the QUICK brown fox."))
    tri = ngram_hashes(wh, 3)
    assert len(tri) == 6 and tri[0] == tri[4] and len(np.unique(tri)) == 4
    assert word_hashes(["fox"])[0] == word_hashes(["fox"])[0] != word_hashes(["box"])[0]


def test_invalid_utf8_in_a_jsonl_line_is_replaced_as_in_text_files(tmp_path, tokenizer_path):
    """Text is decoded as UTF-8 with invalid bytes replaced, whatever the format (a plain .jsonl line stopped the
    whole prepare with a UnicodeDecodeError naming neither file nor line)."""
    texts = [prose(80, 900 + i).replace("\n", " ") for i in range(3)]  # one line: no JSON escapes
    lines = [json.dumps({"id": i, "text": t}).encode() for i, t in enumerate(texts)]
    at = len(json.dumps({"id": 1, "text": ""})) - 2 + 30  # 30 characters into the text
    lines[1] = lines[1][:at] + b"\xff\xfe" + lines[1][at:]
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    (tmp_path / "in" / "b.txt").write_bytes(texts[1][:30].encode() + b"\xff\xfe" + texts[1][30:].encode())
    _, d = run(tmp_path, tokenizer_path, [SourceConfig("a", str(tmp_path / "in"))], filters__min_chars=10)
    assert d["0"]["decision"] == d["1"]["decision"] == d["2"]["decision"] == "accepted"
    # the same bytes, replaced the same way in both formats
    assert d["b.txt"]["decision"] == "exact_duplicate" and d["b.txt"]["reason"] == {"duplicate_of": "a/1"}


def test_a_parquet_text_column_that_is_not_text_stops_before_any_work(tmp_path, tokenizer_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    (tmp_path / "pq").mkdir()
    pq.write_table(pa.table({"text": [1, 2, 3]}), tmp_path / "pq" / "ints.parquet")
    with pytest.raises(ValueError, match=r"ints.parquet: column 'text' holds int64, expected strings"):
        run(tmp_path, tokenizer_path, [SourceConfig("p", str(tmp_path / "pq"))])
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "pq" / "ints.parquet")
    with pytest.raises(ValueError, match=r"ints.parquet: no column 'text'; columns are \['body'\]"):
        run(tmp_path, tokenizer_path, [SourceConfig("p", str(tmp_path / "pq"))])
    assert not (tmp_path / "out").exists()  # the output directory was not created
    pq.write_table(pa.table({"text": pa.array([prose(80, 7)]).dictionary_encode()}), tmp_path / "pq" / "ints.parquet")
    _, d = run(tmp_path, tokenizer_path, [SourceConfig("p", str(tmp_path / "pq"))])
    assert d["ints.parquet#0"]["decision"] == "accepted"


def test_an_output_that_is_a_source_or_someone_elses_folder_is_refused_and_kept(tmp_path, tokenizer_path):
    """--force deletes the output directory: pointed at a source it deleted the inputs; a folder of one's own
    files is refused too, and a prepared dataset is still replaced."""
    sources = _corpus(tmp_path)
    web = Path(sources[0].path)
    before = sorted(p.name for p in web.iterdir())
    for out, what in ((web, "is"), (web / "ds", "lies inside"), (tmp_path / "in", "holds")):
        with pytest.raises(ValueError, match=rf"output='{re.escape(str(out))}' {what} source 'web'"):
            prepare(PrepareConfig(output=str(out), tokenizer=tokenizer_path, workers=1, sources=sources), force=True,
                    log=lambda *_: None)
    assert sorted(p.name for p in web.iterdir()) == before and not (web / "ds").exists()
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.md").write_text("keep me")
    with pytest.raises(ValueError, match=r"holds files a prepare did not write \(notes.md\); choose a new or empty "
                                         r"directory \(--force deletes only"):
        prepare(PrepareConfig(output=str(mine), tokenizer=tokenizer_path, workers=1, sources=sources), force=True,
                log=lambda *_: None)
    assert (mine / "notes.md").read_text() == "keep me" and sorted(p.name for p in mine.iterdir()) == ["notes.md"]
    out, _ = run(tmp_path, tokenizer_path, sources, out="ds")
    again = prepare(PrepareConfig(output=str(out), tokenizer=tokenizer_path, workers=1, sources=sources,
                                  validation_fraction=0.2), force=True, log=lambda *_: None)
    assert json.loads((again / "index.json").read_text())["splits"]["validation"]["shards"]


def test_a_source_without_an_accepted_document_is_said_at_the_end(tmp_path, tokenizer_path):
    """Its weight is recorded with the others, so a run on the prepared weights stops on it: prepare says so."""
    sources = _corpus(tmp_path)
    (tmp_path / "empty.jsonl").write_text("")
    lines = []
    prepare(PrepareConfig(output=str(tmp_path / "ds"), tokenizer=tokenizer_path, workers=1,
                          sources=sources + [SourceConfig("empty", str(tmp_path / "empty.jsonl"), weight=0.2)]),
            log=lines.append)
    assert lines[-1] == ("prepare: warning: source 'empty' (weight 0.2) has no accepted document; a training run on "
                         "this dataset needs data.mixture over the other sources")
    assert not any("warning" in line for line in lines[:-1])
    with pytest.raises(ValueError, match=r"source\(s\) 'empty' \(weight 0.2\) that have no documents"):
        build_dataloader(str(tmp_path / "ds"), load_tokenizer(tokenizer_path), 32, 2, 0, 1, seed=0)


def test_a_null_text_is_a_no_text_decision_in_every_format(tmp_path, tokenizer_path):
    """A null text field is recorded in decisions.jsonl with its place (a Parquet null was skipped without a
    line, a JSONL null stopped the prepare)."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    zstd = pytest.importorskip("zstandard")

    (tmp_path / "in").mkdir()
    pq.write_table(pa.table({"text": [prose(80, 700), None, prose(80, 701)], "id": ["p0", "p1", None]}),
                   tmp_path / "in" / "a.parquet")
    pq.write_table(pa.table({"text": [None, prose(80, 702)]}), tmp_path / "in" / "b.parquet")
    lines = [json.dumps({"id": "j0", "text": prose(80, 703)}), json.dumps({"text": None}),
             json.dumps({"id": "j2", "text": None})]
    (tmp_path / "in" / "c.jsonl").write_text("\n".join(lines) + "\n")
    zst = [line.replace('"j', '"z') for line in lines]
    (tmp_path / "in" / "d.jsonl.zst").write_bytes(zstd.ZstdCompressor().compress("\n".join(zst).encode() + b"\n"))
    out, d = run(tmp_path, tokenizer_path, [SourceConfig("s", str(tmp_path / "in"))], unit_mb=0.0005)
    at = len(lines[0]) + 1
    no_text = {k: v["reason"]["at"] for k, v in d.items() if v["decision"] == "no_text"}
    assert no_text == {"p1": "a.parquet#1", "b.parquet#0": "b.parquet#0", f"c.jsonl@{at}": f"c.jsonl@{at}",
                       "j2": f"c.jsonl@{at + len(lines[1]) + 1}", "d.jsonl.zst:2": "d.jsonl.zst:2", "z2": "d.jsonl.zst:3"}
    assert all(d[k]["reason"]["field"] == "text" and d[k]["source"] == "s" for k in no_text)
    assert d["a.parquet#2"]["decision"] == d["p0"]["decision"] == d["j0"]["decision"] == "accepted"
    assert json.loads((out / "stats.json").read_text())["counts"]["s"]["no_text"] == 6
    assert "no_text" in (out / "report.md").read_text()


@pytest.mark.parametrize("compressed", [False, True])
def test_bad_json_is_named_by_line_and_column(tmp_path, tokenizer_path, compressed):
    lines = [json.dumps({"id": f"j{i}", "text": prose(40, 800 + i)}) for i in range(6)]
    lines[4] = '{"id": "j4", "text": "a" "b"}'
    data = ("\n".join(lines) + "\n").encode()
    (tmp_path / "in").mkdir()
    name = "c.jsonl.zst" if compressed else "c.jsonl"
    if compressed:
        data = pytest.importorskip("zstandard").ZstdCompressor().compress(data)
    (tmp_path / "in" / name).write_bytes(data)
    with pytest.raises(ValueError) as e:
        run(tmp_path, tokenizer_path, [SourceConfig("s", str(tmp_path / "in"))], unit_mb=0.0004)  # several units
    assert str(e.value) == f"{tmp_path / 'in' / name} line 5 column 26: invalid JSON (Expecting ',' delimiter)"
    lines[4] = json.dumps({"id": "j4", "text": 7})
    (tmp_path / "in" / "c.jsonl").write_text("\n".join(lines) + "\n")
    if not compressed:
        with pytest.raises(ValueError, match=r"c.jsonl line 5: expected a JSON object with a string \(or null\) field"):
            run(tmp_path, tokenizer_path, [SourceConfig("s", str(tmp_path / "in"))], unit_mb=0.0004, out="out2")
