"""Controlled sweeps: a family of runs that differ in exactly one declared knob, run, then compared.

    # generate (and check) a family from a base recipe; --run runs it here, --service submits it
    python -m titan_k3.tools.sweep --base tomls/pilot.toml --knob optimizer.lr --values 1e-3,3e-3,1e-2 --out sweeps/lr
    # check a hand-made family (exit 2 naming the keys when it differs in anything else), and run it
    python -m titan_k3.tools.sweep --configs a.toml b.toml c.toml [--knob optimizer.lr] --run --dump-folder runs
    python -m titan_k3.tools.sweep --configs ... --service http://host:8080 --token T [--gpus 1]
    # compare finished runs at equal token budgets -> Markdown report
    python -m titan_k3.tools.sweep --compare runs/a runs/b runs/c --report sweep.md

Knobs: optimizer.lr, training.local_batch_size, training.seq_len, lr_scheduler.warmup_steps,
kernels.loss_grad_fp8, kernels.loss_one_pass.
A batch or sequence-length knob changes the tokens per update, so generation
sets training.steps to keep the token budget (steps x batch x seq_len x
grad_accum) equal, and refuses a value for which no whole number of steps
does; the check accepts training.steps differing only under such a knob and
only with equal budgets. job.name, job.dump_folder, job.description and
job.config_file may differ freely. Configs are compared resolved (defaults
filled in), so writing a default explicitly is not a difference.

The comparison reads only run directories (metrics.jsonl, events.jsonl,
config.toml): the token budget is the largest count every run reached; each
run's loss there is interpolated between its logged records, and also
averaged over its logged records in the last window (`--window`, a fraction
of the budget) before it; grad-norm spikes are logged norms above 3x the
median of the norms logged before them; skipped updates and non-finite
events are counted up to the budget.
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import re
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import tomli
import tomli_w

from titan_k3.config import JobConfig, config_to_dict, load_job_config
from titan_k3.config.errors import toml_value
from titan_k3.config.manager import is_run_config
from titan_k3.metrics.run_dir import load_run_config
from titan_k3.textfiles import unreadable
from titan_k3.tools.run_records import read_events, read_records, run_dir_problem

# NOTE: kernels.loss_grad_fp8 trades precision in the loss's gradients for speed, and kernels.loss_one_pass rounds
# them once more (h's rows scaled in h's dtype before dW): whether a run's loss notices is a question for a paired
# sweep (benchmarks/results/fp8.md, session 26; docs/k3.md §4).
KNOBS = ("optimizer.lr", "training.local_batch_size", "training.seq_len", "lr_scheduler.warmup_steps",
         "kernels.loss_grad_fp8", "kernels.loss_one_pass")
TOKEN_KNOBS = ("training.local_batch_size", "training.seq_len")
FREE_KEYS = frozenset({"job.name", "job.dump_folder", "job.description", "job.config_file"})
SPIKE_FACTOR = 3.0
SPIKE_MIN_HISTORY = 3
EXIT_REFUSED = 2


class SweepError(ValueError):
    """A family or a run set the sweep refuses; one line naming what differs."""


# ---------------------------------------------------------------------- configs
def flat_config(cfg: JobConfig) -> dict[str, object]:
    """{'section.key': value} of a resolved config."""
    return {f"{s}.{k}": v for s, fields in config_to_dict(cfg).items() for k, v in fields.items()}


def tokens_per_update(cfg: JobConfig) -> int:
    t = cfg.training
    return t.local_batch_size * t.seq_len * t.grad_accum


def token_budget(cfg: JobConfig) -> int:
    return cfg.training.steps * tokens_per_update(cfg)


@dataclass
class Member:
    """One config of a family: where it came from, its TOML text and its resolved config."""

    origin: str
    text: str
    cfg: JobConfig
    name: str = ""

    def __post_init__(self):
        self.name = self.name or self.cfg.job.name or Path(self.origin).stem


def load_member(path: Path) -> Member:
    if not path.is_file():
        raise SweepError(f"config {str(path)!r}: no such file")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise SweepError(unreadable(f"config {str(path)!r}", e)) from None
    try:
        return Member(str(path), text, load_job_config([], toml_text=text, resolved=is_run_config(path),
                                                       toml_origin=str(path)))
    except ValueError as e:  # named by the file where it set the key, else by the config
        raise SweepError(str(e) if str(e).startswith(f"{path}: ") else f"config {str(path)!r}: {e}") from None


def check_family(members: list[Member], knob: str | None = None) -> str:
    """The one knob the family varies (declared or inferred); raises SweepError otherwise.

    Allowed differences: the knob; training.steps too under a batch/seq_len knob
    when every member's token budget is equal; the FREE_KEYS.
    """
    if len(members) < 2:
        raise SweepError(f"a sweep needs at least 2 configs, got {len(members)}")
    if knob is not None and knob not in KNOBS:
        raise SweepError(f"--knob {knob!r}: expected one of {', '.join(KNOBS)}")
    flats = [flat_config(m.cfg) for m in members]
    differing = sorted(k for k in flats[0] if k not in FREE_KEYS and len({repr(f[k]) for f in flats}) > 1)
    if knob is None:
        candidates = [k for k in differing if k in KNOBS]
        if len(candidates) != 1:
            listed = " and ".join(differing) if differing else "nothing"
            raise SweepError(f"configs differ in {listed}: cannot infer the one knob (declare it with --knob; "
                             f"one of {', '.join(KNOBS)})")
        knob = candidates[0]
    allowed = {knob} | ({"training.steps"} if knob in TOKEN_KNOBS else set())
    extra = [k for k in differing if k not in allowed]
    if extra:
        a, b = _first_pair_differing(members, flats, extra[0])
        keys = " and ".join([knob, *extra] if knob in differing else extra)
        raise SweepError(f"configs differ in {keys} ({extra[0]}: {a.origin} {toml_value(_value(a, extra[0]))} vs "
                         f"{b.origin} {toml_value(_value(b, extra[0]))}); a sweep varies only the declared knob {knob}")
    if knob not in differing:
        raise SweepError(f"configs do not differ in the declared knob {knob}")
    values = [repr(f[knob]) for f in flats]
    if len(set(values)) < len(values):
        raise SweepError(f"two configs have the same {knob}: {', '.join(toml_value(f[knob]) for f in flats)}")
    names = [m.name for m in members]
    if len(set(names)) < len(names):
        raise SweepError(f"two configs share the run name {min(n for n in names if names.count(n) > 1)!r} "
                         "(the second run would resume the first); give each its own job.name")
    budgets = {m.origin: token_budget(m.cfg) for m in members}
    if knob in TOKEN_KNOBS and len(set(budgets.values())) > 1:
        listed = ", ".join(f"{o} {b:,}" for o, b in budgets.items())
        raise SweepError(f"token budgets (training.steps x local_batch_size x seq_len x grad_accum) differ: {listed}")
    return knob


def _first_pair_differing(members, flats, key):
    for m, f in zip(members[1:], flats[1:]):
        if repr(f[key]) != repr(flats[0][key]):
            return members[0], m
    return members[0], members[1]


def _value(member: Member, key: str):
    return flat_config(member.cfg)[key]


def _name_part(value: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", value)


def generate(base: Path, knob: str, values: list[str]) -> list[Member]:
    """The family: the base TOML with `knob` set to each value (and training.steps for equal tokens)."""
    if knob not in KNOBS:
        raise SweepError(f"--knob {knob!r}: expected one of {', '.join(KNOBS)}")
    if len(values) < 2:
        raise SweepError(f"--values {','.join(values)!r}: a sweep needs at least 2 values")
    base_member = load_member(base)
    budget, stem = token_budget(base_member.cfg), base.stem
    section, key = knob.split(".")
    members = []
    given: dict[str, str] = {}  # repr of each value -> the --values entry that gave it
    for raw in values:
        try:
            cfg = load_job_config([f"--{knob}", raw], toml_text=base_member.text)
        except ValueError as e:
            raise SweepError(f"--values: {e}") from None
        value = getattr(getattr(cfg, section), key)
        if (same := given.setdefault(repr(value), raw)) != raw:
            raise SweepError(f"--values {same} and {raw}: the same {knob} ({toml_value(value)}) twice")
        data = tomli.loads(base_member.text)
        data.setdefault(section, {})[key] = value
        note = ""
        if knob in TOKEN_KNOBS:
            per_update = tokens_per_update(cfg)
            if budget % per_update:
                raise SweepError(f"--values {raw}: {knob} = {toml_value(value)} gives {per_update:,} tokens per update, which does "
                                 f"not divide the base token budget of {budget:,}; pick values that do")
            data.setdefault("training", {})["steps"] = budget // per_update
            note = f"; training.steps = {budget // per_update} keeps the token budget at {budget:,}"
        name = f"{stem}-{key}-{_name_part(raw)}"
        data.setdefault("job", {}).update(name=name, description=f"sweep {stem}: {knob} = {toml_value(value)}{note}")
        data["job"].pop("config_file", None)
        text = tomli_w.dumps(data)
        try:
            members.append(Member(f"{name}.toml", text, load_job_config([], toml_text=text)))
        except ValueError as e:
            raise SweepError(f"{knob} = {raw}: {e}") from None
    check_family(members, knob)
    return members


# ---------------------------------------------------------------------- running
def run_local(members: list[Member], paths: list[Path], dump_folder: str, parallel: int = 1) -> list[tuple[Path, int]]:
    """Each config as `python -m titan_k3.train`; (run dir, exit status) per config, in the family's order.

    parallel > 1 runs that many at once, the i-th slot on GPU i (CUDA_VISIBLE_DEVICES);
    a slot takes the next config when its run ends.
    """
    pending = list(zip(members, paths))
    running: dict[int, tuple[Member, subprocess.Popen]] = {}
    status: dict[str, int] = {}
    while pending or running:
        for slot in range(parallel):
            if slot in running or not pending:
                continue
            m, path = pending.pop(0)
            env = dict(os.environ, CUDA_VISIBLE_DEVICES=str(slot)) if parallel > 1 else None
            print(f"sweep: running {m.name} ({path})" + (f" on GPU {slot}" if env else ""), flush=True)
            cmd = [sys.executable, "-m", "titan_k3.train", "--job.config_file", str(path),
                   "--job.dump_folder", dump_folder, "--job.name", m.name]
            running[slot] = (m, subprocess.Popen(cmd, env=env))
        for slot, (m, proc) in list(running.items()):
            if proc.poll() is not None:
                print(f"sweep: {m.name} exited with status {proc.returncode}", flush=True)
                status[m.name] = proc.returncode
                del running[slot]
        time.sleep(0.2)
    return [(Path(dump_folder) / m.name, status[m.name]) for m in members]


def submit(members: list[Member], url: str, token: str, gpus: int, nproc_per_node: int) -> list[dict]:
    """POST /v1/runs with each config's TOML inline; returns the service's run records."""
    import httpx

    created = []
    for m in members:
        body = {"toml": m.text, "name": m.name, "gpus": gpus, "nproc_per_node": nproc_per_node}
        try:
            resp = httpx.post(f"{url.rstrip('/')}/v1/runs", json=body, headers={"Authorization": f"Bearer {token}"},
                              timeout=30)
        except httpx.HTTPError as e:
            raise SweepError(f"--service {url}: {e}") from None
        if resp.status_code != 201:
            detail = resp.json().get("detail", resp.text) if resp.headers.get("content-type", "").startswith(
                "application/json") else resp.text
            raise SweepError(f"--service {url}: run {m.name!r} refused ({resp.status_code}): {detail}")
        created.append(resp.json())
        print(f"sweep: submitted {m.name} -> run {created[-1].get('id')} ({created[-1].get('state')})", flush=True)
    return created


# ---------------------------------------------------------------------- comparing
@dataclass
class RunView:
    path: Path
    records: list[dict]
    events: list[dict]
    cfg: JobConfig | None
    flat: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def max_tokens(self) -> int:
        return self.records[-1]["tokens_seen"]


RECORD_KEYS = ("step", "tokens_seen", "loss", "grad_norm", "skipped_updates")
"""What the comparison reads of every metrics.jsonl record (the trainer writes each in every record)."""


def load_run(path: Path) -> RunView:
    if problem := run_dir_problem(path):
        raise SweepError(f"run {problem}")
    try:
        metrics = read_records(path / "metrics.jsonl", RECORD_KEYS, optional=("val_loss",))
        events = read_events(path / "events.jsonl")
    except ValueError as e:
        raise SweepError(str(e)) from None
    # NOTE: a resumed run logs again the steps after its last checkpoint; the later record of a step wins.
    by_step = {r["step"]: r for r in metrics}
    records = [by_step[s] for s in sorted(by_step)]
    if not records:
        raise SweepError(f"run {str(path)!r}: no metrics.jsonl records (is it a finished titan_k3 run directory?)")
    cfg = None
    if (path / "config.toml").is_file():
        try:
            cfg = load_run_config(path)
        except ValueError as e:
            raise SweepError(f"run {str(path)!r}: config.toml: {e}") from None
    return RunView(path, records, events, cfg, flat_config(cfg) if cfg else {})


def interpolate(records: list[dict], key: str, tokens: float) -> float:
    """`key` at `tokens`, linear between the logged records around it (records sorted by tokens)."""
    pts = [(r["tokens_seen"], r[key]) for r in records if key in r]
    if not pts or tokens < pts[0][0] or tokens > pts[-1][0]:
        return math.nan
    for (t0, v0), (t1, v1) in itertools.pairwise(pts):
        if t0 <= tokens <= t1:
            return v0 if t1 == t0 else v0 + (v1 - v0) * (tokens - t0) / (t1 - t0)
    return pts[-1][1]


def spikes(records: list[dict]) -> list[int]:
    """Steps whose logged grad norm exceeds SPIKE_FACTOR x the median of those logged before it."""
    out, history = [], []
    for r in records:
        g = r.get("grad_norm")
        if g is None or not math.isfinite(g):
            continue
        if len(history) >= SPIKE_MIN_HISTORY and g > SPIKE_FACTOR * statistics.median(history):
            out.append(r["step"])
        history.append(g)
    return out


@dataclass
class Row:
    run: str
    knob_value: object
    steps_at_budget: float
    loss_at_budget: float
    window_mean: float
    window_std: float
    window_records: int
    val_loss: float
    spikes: list[int]
    skipped: int
    nonfinite: int
    events: dict[str, int]


def compare_runs(runs: list[RunView], window: float = 0.1) -> tuple[int, str | None, list[str], list[Row]]:
    """(token budget, knob or None, keys that differ, one Row per run)."""
    if len(runs) < 2:
        raise SweepError(f"--compare needs at least 2 run directories, got {len(runs)}")
    seen: dict[Path, Path] = {}
    for r in runs:
        if r.path.resolve() in seen:
            raise SweepError(f"--compare: run {str(r.path)!r} is given twice"
                             + (f" (as {str(seen[r.path.resolve()])!r})" if seen[r.path.resolve()] != r.path else ""))
        seen[r.path.resolve()] = r.path
    if not 0 < window <= 1:
        raise SweepError(f"--window={window}: must be in (0, 1]")
    budget = min(r.max_tokens for r in runs)
    shortest = min(runs, key=lambda r: r.max_tokens)
    for r in runs:
        if r.records[0]["tokens_seen"] > budget:
            raise SweepError(f"--compare: run {r.name!r} logged its first record at {r.records[0]['tokens_seen']:,} "
                             f"tokens, past the {budget:,} that {shortest.name!r} reached: nothing of it to compare "
                             "at that budget (compare once that run has gone further)")
    flats = [r.flat for r in runs if r.flat]
    differing = sorted(k for k in (flats[0] if flats else {}) if k not in FREE_KEYS
                       and len({repr(f.get(k)) for f in flats}) > 1) if len(flats) == len(runs) else []
    knobs = [k for k in differing if k in KNOBS]
    knob = knobs[0] if len(knobs) == 1 else None
    rows = []
    for run in runs:
        upto = [r for r in run.records if r["tokens_seen"] <= budget]
        lo = budget * (1 - window)
        in_window = [r["loss"] for r in upto if r["tokens_seen"] > lo and math.isfinite(r["loss"])] or \
            [upto[-1]["loss"]]
        step_at_budget = interpolate(run.records, "step", budget)
        evals = [r for r in upto if "val_loss" in r]
        events = {}
        for e in run.events:
            if e.get("step", 0) <= step_at_budget and e.get("kind") not in ("kernel_report", "checkpoint_saved", "initial_load"):
                events[e["kind"]] = events.get(e["kind"], 0) + 1
        rows.append(Row(
            run=run.name, knob_value=run.flat.get(knob) if knob else None, steps_at_budget=step_at_budget,
            loss_at_budget=interpolate(run.records, "loss", budget),
            window_mean=statistics.fmean(in_window),
            window_std=statistics.stdev(in_window) if len(in_window) > 1 else math.nan,
            window_records=len(in_window), val_loss=evals[-1]["val_loss"] if evals else math.nan,
            spikes=spikes(upto), skipped=int(upto[-1].get("skipped_updates", 0)),
            nonfinite=events.get("nonfinite", 0), events=events,
        ))
    return budget, knob, differing, rows


def _fmt(x: float, spec: str = ".4f") -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def report(runs: list[RunView], window: float = 0.1) -> str:
    """The Markdown comparison, ending with what it can and cannot conclude."""
    budget, knob, differing, rows = compare_runs(runs, window)
    first_out = min(runs, key=lambda r: r.max_tokens)
    lines = [f"# Sweep comparison{f': {knob}' if knob else ''}", ""]
    stops = "all runs stop there" if all(r.max_tokens == budget for r in runs) else f"`{first_out.name}` stops there"
    lines.append(f"Compared at **{budget:,} tokens**, the largest count every run reached "
                 f"({stops}). Loss at the budget is interpolated between logged records; "
                 f"the window mean averages the logged losses in the last {100 * window:g}% of the budget.")
    lines.append("")
    head = ["run", knob or "knob", "updates at budget", "loss @ budget", "window mean ± std (n)", "last val_loss",
            "grad-norm spikes", "skipped updates", "non-finite events"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        spike_text = f"{len(r.spikes)}" + (f" (steps {', '.join(map(str, r.spikes[:5]))}{'...' if len(r.spikes) > 5 else ''})"
                                          if r.spikes else "")
        lines.append("| " + " | ".join([
            f"`{r.run}`", "n/a" if r.knob_value is None else str(r.knob_value), _fmt(r.steps_at_budget, ".0f"),
            _fmt(r.loss_at_budget), f"{_fmt(r.window_mean)} ± {_fmt(r.window_std)} ({r.window_records})",
            _fmt(r.val_loss), spike_text, str(r.skipped), str(r.nonfinite),
        ]) + " |")
    other = sorted({k for r in rows for k in r.events if k != "nonfinite"})
    if other:
        lines += ["", "Other events up to the budget: " + "; ".join(
            f"`{r.run}`: " + (", ".join(f"{k} {r.events[k]}" for k in other if k in r.events) or "none") for r in rows)]
    ranked = sorted((r for r in rows if math.isfinite(r.window_mean)), key=lambda r: r.window_mean)
    lines += ["", "## Reading", ""]
    if len(ranked) >= 2:
        best, second = ranked[0], ranked[1]
        gap = second.window_mean - best.window_mean
        noise = max((r.window_std for r in (best, second) if math.isfinite(r.window_std)), default=math.nan)
        lead = (f"- Lowest window-mean loss: `{best.run}` ({_fmt(best.window_mean)}), ahead of `{second.run}` by "
                f"{_fmt(gap)} nats; ")
        by_name = {r.name: r for r in runs}
        paired = paired_gap(by_name[best.run], by_name[second.run], budget, window) if same_stream(runs, knob) else None
        if paired is not None:
            mean, std, n = paired
            lines.append(lead + f"both read the same batches in the same order, so their per-update difference "
                         f"cancels the batch-to-batch fluctuation: {_fmt(mean)} ± {_fmt(std)} over the {n} updates "
                         f"both logged in the window; the gap is "
                         + ("consistent (its mean exceeds twice its spread)." if math.isfinite(std) and mean > 2 * std
                            else "**not** consistent (its mean is within twice its spread, or there are too few "
                                 "shared records)."))
        elif not math.isfinite(noise):
            lines.append(lead + "the window holds a single logged record, so the loss's own fluctuation is unknown and "
                         "the gap cannot be told from noise (log more often or widen --window).")
        else:
            lines.append(lead + f"the logged loss fluctuates by ± {_fmt(noise)} within the window, so the gap is "
                         + ("larger than twice that spread." if gap > 2 * noise else
                            "**not** larger than twice that spread: within the noise of one seed."))
    unstable = [r.run for r in rows if r.spikes or r.skipped or r.nonfinite]
    lines.append(f"- Instability up to the budget: {', '.join(f'`{u}`' for u in unstable) if unstable else 'none seen'} "
                 f"(grad-norm spikes > {SPIKE_FACTOR:g}x the running median, skipped updates, non-finite events).")
    lines += ["", "## What this comparison can and cannot conclude", ""] + _limits(runs, knob, differing, rows, budget)
    return "\n".join(lines) + "\n"


# Keys that fix which tokens each update reads: equal in every run, the runs see the same batches in the same order.
STREAM_KEYS = ("training.seed", "data.dataset", "data.mixture", "training.seq_len", "training.local_batch_size",
               "training.grad_accum")


def same_stream(runs: list[RunView], knob: str | None) -> bool:
    """Whether every run reads the same token stream update for update (so losses can be compared pairwise)."""
    if knob in TOKEN_KNOBS or not all(r.flat for r in runs):
        return False
    return all(len({repr(r.flat.get(k)) for r in runs}) == 1 for k in STREAM_KEYS)


def paired_gap(best: RunView, other: RunView, budget: int, window: float) -> tuple[float, float, int] | None:
    """(mean, std, n) of other's loss minus best's at the updates both logged in the window; None if none."""
    lo = budget * (1 - window)
    a = {r["step"]: r["loss"] for r in best.records if lo < r["tokens_seen"] <= budget}
    diffs = [r["loss"] - a[r["step"]] for r in other.records if r["step"] in a and math.isfinite(r["loss"])]
    if not diffs:
        return None
    return statistics.fmean(diffs), statistics.stdev(diffs) if len(diffs) > 1 else math.nan, len(diffs)


def _limits(runs, knob, differing, rows, budget) -> list[str]:
    seeds = {r.flat.get("training.seed") for r in runs}
    out = [("**Can:** rank these settings by training loss at the same number of tokens, on this data order, "
            "and say which of them showed instability (spikes, skipped updates, non-finite values) before that point.")]
    out += ["", "**Cannot:**", ""]
    if len(differing) > 1 and not (knob in TOKEN_KNOBS and set(differing) == {knob, "training.steps"}):
        out.append(f"- attribute a difference to one knob: the runs differ in {', '.join(differing)}.")
    elif not differing:
        out.append("- attribute a difference to a knob: the configs (or their absence) show no declared difference.")
    out.append(f"- separate the setting from luck: {'one seed' if len(seeds) == 1 else 'a different seed per run'} "
               "per setting, so there is no run-to-run variance; a gap inside the within-window spread is noise.")
    out.append(f"- predict the ranking later in training: the window ends at {budget:,} tokens; short-horizon "
               "rankings (above all of learning rates and warmup) often flip as training goes on, and the LR "
               "schedule of each run decays over its own length.")
    out.append("- compare cost: equal tokens is not equal compute or wall-clock time"
               + (" — batch size and sequence length change FLOPs per token (attention), memory and throughput; "
                  "and the runs take different numbers of updates, with warmup counted in updates" if knob in TOKEN_KNOBS
                  else "") + ".")
    out.append("- speak for downstream quality: training loss on the training stream"
               + (", and a validation loss on a few batches," if any(math.isfinite(r.val_loss) for r in rows) else "")
               + " is not benchmark accuracy.")
    out.append("- speak for other model sizes, data mixtures or hardware: one model, one mixture.")
    return out


# ---------------------------------------------------------------------- CLI
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m titan_k3.tools.sweep", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--base", type=Path, help="base TOML to generate the family from (with --knob and --values)")
    mode.add_argument("--configs", type=Path, nargs="+", help="a hand-made family to check (and run)")
    mode.add_argument("--compare", type=Path, nargs="+", metavar="RUN_DIR", help="finished runs to compare")
    parser.add_argument("--knob", help=f"the one varied key: {', '.join(KNOBS)}")
    parser.add_argument("--values", help="comma-separated values of the knob (with --base)")
    parser.add_argument("--out", type=Path, default=Path("sweep"), help="folder for generated configs (default ./sweep)")
    run = parser.add_mutually_exclusive_group()
    run.add_argument("--run", action="store_true", help="run the family here, one after the other, then compare")
    run.add_argument("--service", help="control service URL: submit each config as POST /v1/runs")
    parser.add_argument("--parallel", type=int, default=1, help="with --run: runs at once, one per GPU (default 1)")
    parser.add_argument("--token", default=os.environ.get("K3_SERVICE_TOKEN"),
                        help="the service's bearer token (default $K3_SERVICE_TOKEN)")
    parser.add_argument("--gpus", type=int, default=0, help="GPUs per run asked of the service (default 0)")
    parser.add_argument("--nproc-per-node", type=int, default=1, help="processes per run asked of the service")
    parser.add_argument("--dump-folder", default="./runs", help="where --run creates the run directories")
    parser.add_argument("--report", type=Path, default=None, help="comparison report path (default: <out>/compare.md)")
    parser.add_argument("--window", type=float, default=0.1, help="last fraction of the token budget averaged (default 0.1)")
    args = parser.parse_args(argv)
    try:
        for flag, value, least in (("--parallel", args.parallel, 1), ("--gpus", args.gpus, 0),
                                   ("--nproc-per-node", args.nproc_per_node, 1)):
            if value < least:
                raise SweepError(f"{flag}={value}: must be >= {least}")
        if args.compare:
            runs = [load_run(p) for p in args.compare]
            _write_report(report(runs, args.window), args.report or args.out / "compare.md", runs)
            return 0
        if args.service and not args.token:
            raise SweepError("--service needs --token or $K3_SERVICE_TOKEN (the service's bearer token)")
        if args.base:
            if not args.knob or not args.values:
                raise SweepError("--base needs --knob and --values")
            members = generate(args.base, args.knob, [v.strip() for v in args.values.split(",") if v.strip()])
            paths = [args.out / m.origin for m in members]
            try:
                args.out.mkdir(parents=True, exist_ok=True)
                for m, path in zip(members, paths):
                    path.write_text(m.text)
            except OSError as e:
                raise SweepError(f"--out {str(args.out)!r}: cannot write the configs there ({e.strerror or e})") from None
            knob = args.knob
        else:
            members = [load_member(p) for p in args.configs]
            knob = check_family(members, args.knob)
            paths = list(args.configs)
        _print_family(members, paths, knob)
        if args.service:
            submit(members, args.service, args.token, args.gpus, args.nproc_per_node)
        elif args.run:
            results = run_local(members, paths, args.dump_folder, args.parallel)
            failed = [f"{d.name} (status {rc})" for d, rc in results if rc != 0]
            done = [d for d, _ in results if (d / "metrics.jsonl").exists()]
            unreadable = None
            if len(done) >= 2:
                try:
                    runs = [load_run(d) for d in done]
                    _write_report(report(runs, args.window), args.report or args.out / "compare.md", runs)
                except SweepError as e:
                    if not failed:
                        raise
                    # NOTE: a run that failed early is often what the comparison cannot read; the failure comes first.
                    unreadable = e
            if failed:
                print(f"error: runs failed: {', '.join(failed)}"
                      + (f"; the others are not compared: {unreadable}" if unreadable else ""), file=sys.stderr)
                return 1
    except SweepError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_REFUSED
    return 0


def _print_family(members: list[Member], paths: list[Path], knob: str) -> None:
    print(f"sweep over {knob}: {len(members)} configs, identical otherwise"
          + (" (training.steps keeps the token budget equal)" if knob in TOKEN_KNOBS else ""))
    section, key = knob.split(".")
    for m, path in zip(members, paths):
        print(f"  {m.name}: {knob} = {toml_value(getattr(getattr(m.cfg, section), key))}, training.steps = {m.cfg.training.steps}, "
              f"{token_budget(m.cfg):,} tokens  [{path}]")


def plot_runs(runs: list[RunView], path: Path) -> Path:
    """PNG of training loss (and validation loss where logged) against tokens, one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for run in runs:
        line, = ax.plot([r["tokens_seen"] for r in run.records], [r["loss"] for r in run.records], label=run.name)
        evals = [r for r in run.records if "val_loss" in r]
        if evals:
            ax.plot([r["tokens_seen"] for r in evals], [r["val_loss"] for r in evals], "o--", color=line.get_color(),
                    label=f"{run.name} (validation)")
    ax.set_xlabel("tokens")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _write_report(text: str, path: Path, runs: list[RunView]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        png = plot_runs(runs, path.with_suffix(".png"))
        text += f"\n![loss against tokens]({png.name})\n"
        path.write_text(text)
    except OSError as e:
        raise SweepError(f"--report {str(path)!r}: cannot write the report there ({e.strerror or e})") from None
    print(text, end="")
    print(f"report written to {path}, plot to {png}")


if __name__ == "__main__":
    sys.exit(main())
