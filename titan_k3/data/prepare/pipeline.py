"""The prepare pipeline: three resumable stages over a work directory.

  A  per work unit, in worker processes: read -> normalise -> rule filters ->
     content hash, MinHash signature, benchmark n-gram check. One result file per
     unit (metadata + signatures, and the texts separately), renamed into place
     when complete.
  B  in order, in the main process: exact dedup (first occurrence wins, across
     sources) -> near dedup (LSH) -> decontamination -> decisions.jsonl, the
     train/validation split, and a fixed plan of which documents go in which shard.
  C  per planned shard, in worker processes: tokenise, append EOS, write the shard
     (temporary names, renamed) and then its completion record.
  Then index.json (last, so its presence means the dataset is complete), report.md
  and stats.json; the work directory is removed.

A killed run resumes on rerun: finished units and shards are kept, the rest is
redone; B is deterministic and cheap, so it simply reruns unless its result is
saved. The shard plan depends only on the inputs and the config, so a resumed run
writes the same shards as an uninterrupted one.

Debug knob: TITAN_K3_PREPARE_CRASH_AFTER=<stage>:<k>[:kill] (stage a or c) raises
after k tasks of that stage complete in this run, or with ``:kill`` sends the
process SIGKILL (no cleanup runs), to test resumption. A rerun first deletes the
temporary files a killed run left behind.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
import shutil
import signal
import time
from collections import Counter, defaultdict
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import asdict
from multiprocessing import get_context
from pathlib import Path

import numpy as np

from titan_k3.data.prepare.config import FilterConfig, PrepareConfig
from titan_k3.data.prepare.dedup import BenchmarkNgrams, NearDuplicateIndex, minhash_signature
from titan_k3.data.prepare.quality import normalize, rule_filter, word_hashes, words
from titan_k3.data.prepare.report import write_report
from titan_k3.data.prepare.sources import plan_units, read_unit
from titan_k3.data.shards import INDEX_NAME, token_dtype, write_index, write_shard
from titan_k3.data.tokenizer import load_tokenizer

# no_text: a record whose text field is null (JSONL or Parquet), recorded with its place (sources.py).
DECISIONS = ("accepted", "no_text", "too_short", "low_quality", "exact_duplicate", "near_duplicate", "contaminated")
WORK_DIR = ".prepare-work"
_CRASH_ENV = "TITAN_K3_PREPARE_CRASH_AFTER"


def _dump(path: Path, obj) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        pickle.dump(obj, f, protocol=pickle.HIGHEST_PROTOCOL)
    os.replace(tmp, path)


def _load(path: Path):
    with open(path, "rb") as f:
        return pickle.load(f)


def _write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


# ---------------------------------------------------------------- worker side

_WORKER_CACHE: dict = {}


def _benchmarks(paths: tuple[str, ...], n: int) -> BenchmarkNgrams:
    key = ("bench", paths, n)
    if key not in _WORKER_CACHE:
        _WORKER_CACHE[key] = BenchmarkNgrams(list(paths), n)
    return _WORKER_CACHE[key]


def stage_a_unit(unit: dict, cfg: dict, out_stem: str) -> dict:
    """Read, normalise, filter and fingerprint one work unit; write `out_stem`.meta / .text."""
    filters = FilterConfig(**{**cfg["filters"], **cfg["source_filters"]})
    near = cfg["near_dedup"]
    bench = _benchmarks(tuple(cfg["decontamination"]["benchmarks"]), cfg["decontamination"]["n"])
    clock = Counter()
    metas, texts, sigs = [], [], []
    bytes_in = 0
    cpu0 = time.process_time()
    t = time.perf_counter()
    for doc_id, raw, where in read_unit(unit):
        t = _tick(clock, "read", t)
        if raw is None:
            metas.append({"id": doc_id, "sha256": None, "chars": 0, "decision": "no_text",
                          "reason": {"at": where, "field": unit["text_key"]}})
            continue
        bytes_in += len(raw.encode("utf-8"))
        text = normalize(raw)
        t = _tick(clock, "normalize", t)
        toks = words(text)
        wh = word_hashes(toks)
        meta = {"id": doc_id, "sha256": hashlib.sha256(text.encode()).hexdigest(), "chars": len(text)}
        verdict = rule_filter(text, toks, wh, filters)
        t = _tick(clock, "filter", t)
        if verdict:
            meta["decision"], meta["reason"] = verdict
        else:
            if near["enable"]:
                meta["sig"] = len(sigs)
                sigs.append(minhash_signature(wh, near["shingle"], near["num_perm"]))
            t = _tick(clock, "minhash", t)
            meta["contam"] = bench.first_hit(toks, wh)
            meta["text"] = len(texts)
            texts.append(text)
            t = _tick(clock, "decontaminate", t)
        metas.append(meta)
    sig_arr = np.stack(sigs) if sigs else np.zeros((0, near["num_perm"]), np.uint32)
    out = Path(out_stem)
    _dump(out.with_name(out.name + ".text"), texts)
    _dump(out.with_name(out.name + ".meta"), {"docs": metas, "sigs": sig_arr, "bytes": bytes_in})
    return {"bytes": bytes_in, "docs": len(metas), "clock": dict(clock), "cpu_s": time.process_time() - cpu0}


def _tick(clock: Counter, name: str, t0: float) -> float:
    t1 = time.perf_counter()
    clock[name] += t1 - t0
    return t1


def stage_c_shard(task: dict, tokenizer_spec: str, tokenizer_sha: str, out_dir: str, work_dir: str) -> dict:
    """Tokenise one planned shard, write it, then its completion record."""
    key = ("tok", tokenizer_spec)
    if key not in _WORKER_CACHE:
        _WORKER_CACHE[key] = load_tokenizer(tokenizer_spec)
    tok = _WORKER_CACHE[key]
    if tok.sha256 != tokenizer_sha:
        raise ValueError(f"tokenizer {tokenizer_spec!r} changed during prepare (sha256 {tok.sha256[:12]}...)")
    cpu0 = time.process_time()
    t0 = time.perf_counter()
    texts, loaded = [], {}
    for unit_stem, idx in task["items"]:
        if unit_stem not in loaded:
            loaded = {unit_stem: _load(Path(work_dir) / "a" / f"{unit_stem}.text")}
        texts.append(loaded[unit_stem][idx])
    t1 = time.perf_counter()
    dtype = token_dtype(tok.vocab_size)
    # NOTE: one text at a time: batch encoders start their own threads, and the
    # parallelism here is the worker processes.
    docs = [np.asarray(tok.encode(t) + [tok.eos_id], dtype=dtype) for t in texts]
    t2 = time.perf_counter()
    record = write_shard(out_dir, task["stem"], docs, source=task["source"], dtype=dtype, provenance=task["provenance"])
    _write_text(Path(work_dir) / "c" / f"{task['stem']}.json", json.dumps(record))
    t3 = time.perf_counter()
    n_bytes = sum(len(t.encode("utf-8")) for t in texts)
    clock = {"load": t1 - t0, "tokenize": t2 - t1, "write": t3 - t2}
    return {"bytes": n_bytes, "clock": clock, "cpu_s": time.process_time() - cpu0}


# ---------------------------------------------------------------- main side


def _crash_after(stage: str) -> tuple[int, bool] | None:
    """(after how many tasks, kill instead of raise) from the debug knob, for `stage`."""
    name, k, *mode = os.environ.get(_CRASH_ENV, "").split(":") + [""]
    return (int(k), mode[0] == "kill") if name == stage and k else None


def _make_pool(workers: int) -> ProcessPoolExecutor | None:
    """None for workers = 1 (run in process: a pool of one only adds start-up time)."""
    if workers == 1:
        return None
    # NOTE: forkserver: workers fork from a clean server that preloaded this module,
    # so they start fast and never inherit the caller's threads (as fork would).
    ctx = get_context("forkserver")
    ctx.set_forkserver_preload([__name__])
    return ProcessPoolExecutor(max_workers=workers, mp_context=ctx)


def _run_parallel(pool: ProcessPoolExecutor | None, fn, jobs: list[tuple], stage: str) -> list[dict]:
    """Run fn(*job) for every job (on the pool, if any); results in completion order."""
    crash = _crash_after(stage)
    results: list[dict] = []

    def done(result: dict) -> None:
        results.append(result)
        if crash is not None and len(results) >= crash[0]:
            if crash[1]:
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError(f"{_CRASH_ENV}: debug crash in stage {stage} after {len(results)} tasks")

    if pool is None:
        for job in jobs:
            done(fn(*job))
        return results
    pending = {pool.submit(fn, *job) for job in jobs}
    try:
        while pending:
            finished, pending = wait(pending, return_when=FIRST_COMPLETED)
            for fut in finished:
                done(fut.result())
    finally:
        for fut in pending:
            fut.cancel()
    return results


def _input_signature(units: list[dict]) -> str:
    """sha256 over every input file's path, size and mtime, in unit order."""
    digest = hashlib.sha256()
    for u in units:
        for rel in u["files"]:
            st = (Path(u["root"]) / rel).stat()
            digest.update(f"{u['source']}|{u['root']}|{rel}|{st.st_size}|{st.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def _unit_stem(unit: dict) -> str:
    return f"{unit['source']}-{unit['index']:06d}"


def _is_validation(sha: str, fraction: float) -> bool:
    return int(sha[:12], 16) % 1_000_000 < fraction * 1_000_000


class _Decider:
    """The global stages in order: exact dedup -> near dedup -> decontamination."""

    def __init__(self, cfg: PrepareConfig):
        self.near = NearDuplicateIndex(cfg.near_dedup.threshold, cfg.near_dedup.num_perm) if cfg.near_dedup.enable else None
        self.first_seen: dict[str, str] = {}  # content sha256 -> first "source/id"
        self.refs: list[str] = []  # near-dedup key -> "source/id"

    def decide(self, ref: str, doc: dict, sigs: np.ndarray) -> tuple[str, dict]:
        if doc.get("decision"):
            return doc["decision"], doc["reason"]
        if doc["sha256"] in self.first_seen:
            return "exact_duplicate", {"duplicate_of": self.first_seen[doc["sha256"]]}
        self.first_seen[doc["sha256"]] = ref
        if self.near is not None:
            self.refs.append(ref)
            hit = self.near.check_and_add(len(self.refs) - 1, sigs[doc["sig"]])
            if hit is not None:
                return "near_duplicate", {"duplicate_of": self.refs[hit[0]], "jaccard": round(hit[1], 4)}
        if doc["contam"] is not None:
            return "contaminated", doc["contam"]
        return "accepted", {}


def stage_b(cfg: PrepareConfig, units: list[dict], work: Path, out: Path) -> dict:
    """Global decisions in input order; writes decisions.jsonl and returns the shard plan and counts."""
    decider = _Decider(cfg)
    counts: dict[str, Counter] = defaultdict(Counter)
    rules: Counter = Counter()
    contam: dict[str, dict] = defaultdict(lambda: {"docs": 0, "examples": []})
    accepted: dict[tuple[str, str], list] = defaultdict(list)
    decisions_tmp = out / f"decisions.jsonl.tmp{os.getpid()}"
    with open(decisions_tmp, "w") as sink:
        for unit in units:
            stem, source = _unit_stem(unit), unit["source"]
            meta = _load(work / "a" / f"{stem}.meta")
            for doc in meta["docs"]:
                rec = {"source": source, "id": doc["id"], "sha256": doc["sha256"]}
                decision, reason = decider.decide(f"{source}/{doc['id']}", doc, meta["sigs"])
                if decision == "accepted":
                    split = "validation" if _is_validation(doc["sha256"], cfg.validation_fraction) else "train"
                    reason = {"split": split}
                    accepted[(split, source)].append((stem, doc["text"], doc["chars"], rec))
                elif decision == "contaminated":
                    entry = contam[reason["benchmark"]]
                    entry["docs"] += 1
                    entry["examples"] = (entry["examples"] + [reason["ngram"]])[:3]
                elif decision in ("too_short", "low_quality"):
                    rules[reason["rule"]] += 1
                counts[source][decision] += 1
                sink.write(json.dumps({**rec, "decision": decision, "reason": reason}, sort_keys=True) + "\n")
    os.replace(decisions_tmp, out / "decisions.jsonl")
    return {
        "plan": _plan_shards(accepted, int(cfg.shard_mb * 1e6)),
        "counts": {k: dict(v) for k, v in counts.items()},
        "rules": dict(rules),
        "contamination": dict(contam),
    }


def _plan_shards(accepted: dict, shard_chars: int) -> list[dict]:
    plan = []
    for (split, source) in sorted(accepted):
        items, prov, chars, k = [], [], 0, 0
        for stem, idx, n_chars, rec in accepted[(split, source)]:
            items.append((stem, idx))
            prov.append(rec)
            chars += n_chars
            if chars >= shard_chars:
                plan.append({"stem": f"{split}-{source}-{k:05d}", "split": split, "source": source, "items": items, "provenance": prov})
                items, prov, chars, k = [], [], 0, k + 1
        if items:
            plan.append({"stem": f"{split}-{source}-{k:05d}", "split": split, "source": source, "items": items, "provenance": prov})
    return plan


def prepare(cfg: PrepareConfig, force: bool = False, log=print) -> Path:
    """Run (or resume) the pipeline; returns the output directory."""
    pool = _make_pool(cfg.workers)
    try:
        return _prepare(cfg, force, log, pool)
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)


def _prepare(cfg: PrepareConfig, force: bool, log, pool) -> Path:
    out = Path(cfg.output)
    work = out / WORK_DIR
    fingerprint = cfg.fingerprint()
    if (out / INDEX_NAME).is_file() and not force:
        done = json.loads((out / INDEX_NAME).read_text()).get("prepare", {}).get("config_sha256")
        if done != fingerprint:
            raise ValueError(f"output={str(out)!r} holds a dataset prepared with another config; choose another output or --force")
        log(f"prepare: {out} is already complete")
        return out
    _check_output(cfg, out, force)
    # Everything that can refuse the inputs comes before the output directory is created or changed.
    tok = load_tokenizer(cfg.tokenizer)
    BenchmarkNgrams(cfg.decontamination.benchmarks, cfg.decontamination.n)  # bad benchmark files fail before any work
    units = [u for s in cfg.sources for u in plan_units(s, int(cfg.unit_mb * 1e6))]
    inputs = _input_signature(units)
    cfg_path = work / "config.json"
    if not force and cfg_path.is_file() and json.loads(cfg_path.read_text())["fingerprint"] != fingerprint:
        raise ValueError(f"output={str(out)!r} holds an unfinished prepare with another config; choose another output or --force")
    if force and out.exists():
        shutil.rmtree(out)
    (work / "a").mkdir(parents=True, exist_ok=True)
    (work / "c").mkdir(exist_ok=True)
    for stale in [*out.glob("*.tmp*"), *(work / "a").glob("*.tmp*"), *(work / "c").glob("*.tmp*")]:
        stale.unlink()  # a killed run's partial files: their tasks are redone below
    if cfg_path.is_file() and json.loads(cfg_path.read_text()).get("inputs") != inputs:
        raise ValueError(f"output={str(out)!r}: the input files changed since the unfinished prepare; rerun with --force")
    _write_text(cfg_path, json.dumps({"fingerprint": fingerprint, "inputs": inputs, "config": asdict(cfg)}, indent=1))
    timings: dict[str, dict] = {}
    base = asdict(cfg)
    jobs = []
    for u in units:
        stem = work / "a" / _unit_stem(u)
        if not stem.with_name(stem.name + ".meta").is_file():
            src = next(s for s in cfg.sources if s.name == u["source"])
            jobs.append((u, {**base, "source_filters": src.filters}, str(stem)))
    log(f"prepare: stage A: {len(jobs)} of {len(units)} work units to process with {cfg.workers} workers")
    t0 = time.perf_counter()
    res_a = _run_parallel(pool, stage_a_unit, jobs, "a")
    timings["A"] = _stage_timing(res_a, time.perf_counter() - t0)

    t0 = time.perf_counter()
    b_path = work / "b.pkl"
    if b_path.is_file():
        result_b = _load(b_path)
    else:
        result_b = stage_b(cfg, units, work, out)
        _dump(b_path, result_b)
    timings["B"] = {"wall_s": time.perf_counter() - t0}

    plan = result_b["plan"]
    jobs = [
        (task, cfg.tokenizer, tok.sha256, str(out), str(work))
        for task in plan
        if not (work / "c" / f"{task['stem']}.json").is_file()
    ]
    log(f"prepare: stage C: {len(jobs)} of {len(plan)} shards to tokenize and write")
    t0 = time.perf_counter()
    res_c = _run_parallel(pool, stage_c_shard, jobs, "c")
    timings["C"] = _stage_timing(res_c, time.perf_counter() - t0)

    records: dict[str, list[dict]] = {"train": [], "validation": []}
    for task in plan:
        records[task["split"]].append(json.loads((work / "c" / f"{task['stem']}.json").read_text()))
    stats = {
        "config_sha256": fingerprint,
        "counts": result_b["counts"],
        "rules": result_b["rules"],
        "contamination": result_b["contamination"],
        "benchmarks": BenchmarkNgrams(cfg.decontamination.benchmarks, cfg.decontamination.n).stats,
        "timings": timings,
    }
    tokens: Counter = Counter()
    for split_records in records.values():
        for r in split_records:
            tokens[r["source"]] += r["n_tokens"]
    stats["tokens"] = dict(tokens)
    _write_text(out / "stats.json", json.dumps(stats, indent=1, sort_keys=True))
    write_report(out / "report.md", cfg, stats)
    write_index(
        out,
        tok,
        records,
        mixture={s.name: s.weight for s in cfg.sources},
        prepare={"config_sha256": fingerprint, "decisions": "decisions.jsonl", "report": "report.md"},
    )
    shutil.rmtree(work)
    log(f"prepare: wrote {out} ({sum(tokens.values())} tokens); report: {out / 'report.md'}")
    for src in cfg.sources:
        if src.weight > 0 and not tokens[src.name]:
            # NOTE: its weight is recorded with the others, and a training run that takes the prepared weights
            # stops on it; said here, where the inputs can still be fixed.
            log(f"prepare: warning: source {src.name!r} (weight {src.weight:g}) has no accepted document; a training "
                "run on this dataset needs data.mixture over the other sources")
    return out


# What a prepare writes into its output directory (besides its shards); anything else there is someone else's.
_OUTPUT_FILES = (INDEX_NAME, "decisions.jsonl", "report.md", "stats.json", WORK_DIR)
_SHARD_FILE = re.compile(r"^(train|validation)-.+-\d{5}\.(bin|idx\.npy|docs\.jsonl)(\.tmp\d+)?$|^decisions\.jsonl\.tmp\d+$")


def _check_output(cfg: PrepareConfig, out: Path, force: bool) -> None:
    """Refuse an output that is, holds or lies inside a source, or holds files a prepare did not write.

    NOTE: --force deletes the output directory whole: pointed at a source (or at any folder of one's own) it
    deleted the inputs, and without it a rerun read its own shards as input.
    """
    resolved = out.resolve()
    for src in cfg.sources:
        path = Path(src.path).resolve()
        if resolved == path or resolved in path.parents or path in resolved.parents:
            where = "is" if resolved == path else ("holds" if resolved in path.parents else "lies inside")
            raise ValueError(f"output={str(out)!r} {where} source {src.name!r} (path {src.path!r}); write the dataset "
                             "to a directory apart from its inputs")
    if out.exists() and not out.is_dir():
        raise ValueError(f"output={str(out)!r} is a file, not a directory")
    foreign = sorted(p.name for p in out.iterdir() if p.name not in _OUTPUT_FILES and not _SHARD_FILE.match(p.name)) \
        if out.is_dir() else []
    if foreign:
        listed = ", ".join(foreign[:3]) + (f" (+{len(foreign) - 3} more)" if len(foreign) > 3 else "")
        raise ValueError(f"output={str(out)!r} holds files a prepare did not write ({listed}); choose a new or empty "
                         "directory" + (" (--force deletes only a prepared dataset or an unfinished prepare)" if force else ""))


def _stage_timing(results: list[dict], wall: float) -> dict:
    clock: Counter = Counter()
    for r in results:
        clock.update(r["clock"])
    n_bytes = sum(r["bytes"] for r in results)
    cpu = sum(r["cpu_s"] for r in results)
    return {"wall_s": wall, "bytes": n_bytes, "worker_s": dict(clock), "cpu_s": cpu, "tasks": len(results)}
