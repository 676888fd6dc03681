"""The prepare summary report (Markdown): decisions per source, rules, decontamination, timings.

A filter that removed nothing is called out: a filter that never fires is usually
misconfigured (wrong threshold, wrong text field, benchmark file of another format).
"""

from __future__ import annotations

from pathlib import Path

from titan_k3.data.prepare.config import PrepareConfig
from titan_k3.data.prepare.quality import LOW_QUALITY_RULES, TOO_SHORT_RULES

_DECISIONS = ("accepted", "no_text", "too_short", "low_quality", "exact_duplicate", "near_duplicate", "contaminated")


def _table(header: list[str], rows: list[list]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return out + [""]


def silent_filters(cfg: PrepareConfig, stats: dict) -> list[str]:
    """Names of the configured filters that removed no document."""
    totals = {d: sum(c.get(d, 0) for c in stats["counts"].values()) for d in _DECISIONS}
    silent = [f"too_short/{r}" for r in TOO_SHORT_RULES if not stats["rules"].get(r)]
    silent += [f"low_quality/{r}" for r in LOW_QUALITY_RULES if not stats["rules"].get(r)]
    if not totals["exact_duplicate"]:
        silent.append("exact_duplicate")
    if cfg.near_dedup.enable and not totals["near_duplicate"]:
        silent.append("near_duplicate")
    silent += [f"contaminated/{b}" for b in stats["benchmarks"] if not stats["contamination"].get(b, {}).get("docs")]
    return silent


def write_report(path: Path, cfg: PrepareConfig, stats: dict) -> None:
    lines = ["# Prepare report", "", f"Output `{cfg.output}`, tokenizer `{cfg.tokenizer}`, config sha256 `{stats['config_sha256'][:16]}`.", ""]
    silent = silent_filters(cfg, stats)
    if silent:
        lines += ["**Filters that removed nothing (check their configuration):** " + ", ".join(f"`{s}`" for s in silent), ""]

    lines += ["## Decisions per source", ""]
    rows = []
    for src in cfg.sources:
        c = stats["counts"].get(src.name, {})
        n = sum(c.values())
        rows.append([src.name, src.weight, n] + [c.get(d, 0) for d in _DECISIONS] + [stats["tokens"].get(src.name, 0)])
    totals = [sum(r[i] for r in rows) for i in range(2, len(rows[0]))] if rows else []
    rows.append(["**all**", ""] + totals)
    lines += _table(["source", "weight", "documents"] + list(_DECISIONS) + ["tokens"], rows)

    lines += ["## Rule filters", ""]
    rule_rows = [["too_short", r, stats["rules"].get(r, 0)] for r in TOO_SHORT_RULES]
    rule_rows += [["low_quality", r, stats["rules"].get(r, 0)] for r in LOW_QUALITY_RULES]
    lines += _table(["decision", "rule", "documents removed"], rule_rows)

    lines += [f"## Decontamination ({cfg.decontamination.n}-grams)", ""]
    if stats["benchmarks"]:
        rows = []
        for name, b in stats["benchmarks"].items():
            c = stats["contamination"].get(name, {"docs": 0, "examples": []})
            example = "; ".join(f"`{e}`" for e in c["examples"][:2]) or "-"
            rows.append([name, b["examples"], b["ngrams"], b["too_short_for_n"], c["docs"], example])
        lines += _table(["benchmark", "examples", "n-grams", "examples shorter than n", "documents removed", "matched n-grams"], rows)
    else:
        lines += ["No benchmark files configured: nothing was checked for contamination.", ""]

    lines += ["## Stages", ""]
    rows = []
    for stage, t in stats["timings"].items():
        mb = t.get("bytes", 0) / 1e6
        rate = f"{mb / t['wall_s']:.2f}" if t.get("bytes") and t["wall_s"] > 0 else "-"
        detail = ", ".join(f"{k} {v:.1f}s" for k, v in t.get("worker_s", {}).items()) or "-"
        cpu = f"{t['cpu_s']:.1f}" if "cpu_s" in t else "-"
        rows.append([stage, f"{t['wall_s']:.2f}", f"{mb:.1f}" if mb else "-", rate, cpu, detail])
    lines += _table(["stage", "wall s", "MB", "MB/s", "worker CPU s", "worker time by step"], rows)
    lines += ["Decisions for every document are in `decisions.jsonl`; shard provenance in `*.docs.jsonl`.", ""]
    path.write_text("\n".join(lines))
