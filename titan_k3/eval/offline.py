"""Evaluate saved checkpoints and exports: `python -m titan_k3.eval`.

    python -m titan_k3.eval --checkpoint RUN_DIR/checkpoints/step-N [--tasks a.jsonl,b.jsonl] [--val-steps K] [--json]
    python -m titan_k3.eval --checkpoint EXPORT_DIR [--tasks ...] [--val-steps K] [--json]
    python -m titan_k3.eval --runs RUN_DIR [--tasks ...] [--val-steps K] [--json]

The model is rebuilt from the run's resolved `config.toml` (the run directory
is the nearest folder above the step dir whose config.toml names its checkpoint
folder: RUN_DIR for RUN_DIR/checkpoints/step-N) and only its weights are loaded. Defaults
come from the run's [eval] section, so `--checkpoint` on the step the trainer
evaluated reproduces the val_loss it logged (same seed, same sequences, one
process). `--runs` evaluates every complete checkpoint of the run, oldest
first, and writes RUN_DIR/eval_table.md: the benchmarks across tokens.
Every checkpoint's files are checked against its checksums.json first, as
the trainer's load does: a damaged one (a step dir without .metadata included)
is named and nothing is evaluated; so is one trained with another tokenizer
than the one the run's data.tokenizer loads now.

An export directory (`python -m titan_k3.checkpoint.export --out EXPORT_DIR`)
is evaluated as the checkpoint it came from: the model from its config.json,
the weights from its shards, the tokenizer from the file it holds, the
settings from the source run's config it holds (titan_k3_config.toml), so a
float32 export scores what its checkpoint scores. Its files are checked
against its checksums.json; one without config.json (written last) is partial
and refused. An export made before exports held these files is evaluated with
the default settings and the default data.tokenizer (checked against the
sha256 its config.json records), unverified, and says so.
Prints a table (or JSON with `--json`). Exit status 2 with one line on bad input.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

import torch

from titan_k3.checkpoint import layout, load_model_weights, verify
from titan_k3.checkpoint.export import (
    CONFIG_FILE,
    EXPORT_KEY,
    INDEX_FILE,
    RUN_CONFIG_FILE,
    export_record,
    is_export_dir,
    verify_export,
)
from titan_k3.checkpoint.layout import TOKENIZER_KEY
from titan_k3.checkpoint.resume import saved_tokenizer
from titan_k3.config import JobConfig
from titan_k3.eval.runner import Evaluator, load_tasks, task_names, training_dtype
from titan_k3.eval.validation import validation_split_tokens
from titan_k3.metrics.run_dir import load_run_config

TABLE_NAME = "eval_table.md"


def run_dir_of(checkpoint: Path) -> Path:
    """RUN_DIR for RUN_DIR/<checkpoint.folder>/step-N (layout.run_dir_of: a nested folder too)."""
    return layout.run_dir_of(checkpoint)


def build_model(cfg: JobConfig, device: torch.device, args=None):
    """(model, tokenizer, kernel fallbacks) as the trainer builds them, on one device, weights not loaded.

    The model comes from the registry by `model.name` (titan_k3/models/registry.py), as in the trainer:
    its flavor, kernel choice and build are the family's `ModelSpec`. `args` (an export's) stands in for the flavor's.
    """
    from titan_k3.data.tokenizer import load_tokenizer
    from titan_k3.models.registry import get_model_spec

    tokenizer = load_tokenizer(cfg.data.tokenizer)
    spec = get_model_spec(cfg.model.name)
    if args is None:
        # NOTE: the trainer's rule for the vocabulary (titan_k3/train.py): the tokenizer's, rounded up to 64.
        vocab = cfg.model.vocab_size or -(-tokenizer.vocab_size // 64) * 64
        args = spec.args(cfg.model.flavor, vocab)
    # NOTE: no optimizer keeps weight shadows here: the experts cast their weights as they read them.
    impl = spec.resolve_kernels(dataclasses.replace(cfg.kernels, expert_weight_shadows=False), device, args,
                                training_dtype(cfg))
    with torch.device(device):
        model = spec.build(args, impl, cfg.model)
    return model.eval(), tokenizer, impl.fallbacks


def _checkpoint_tokens(step_dir: Path) -> int | None:
    try:
        return int(json.loads((step_dir / "meta.json").read_text())["train"]["tokens_seen"])
    except (FileNotFoundError, KeyError, TypeError, ValueError):
        return None


def _step_of(step_dir: Path) -> int:
    name = step_dir.name
    if not layout.is_complete(step_dir):
        raise ValueError(f"checkpoint {str(step_dir)!r}: not a complete step-N checkpoint directory nor an export (--checkpoint "
                         "takes RUN_DIR/checkpoints/step-N or an export directory; --runs RUN_DIR evaluates every "
                         "checkpoint of a run)")
    return int(name.split("-", 1)[1])


def _check_intact(step_dir: Path, note) -> None:
    """Stop on a checkpoint whose files do not match its checksums.json, as the trainer's load does."""
    problem, unverified = verify.verify(step_dir)
    if problem is not None:
        raise ValueError(f"checkpoint {str(step_dir)!r} is damaged: {problem}")
    if unverified:
        note(f"note: checkpoint {step_dir} was saved before checksums existed (meta.json version 1): not verified")


def _check_tokenizer(step_dir: Path, tokenizer, note, loaded_by: str = "the run's data.tokenizer now loads") -> None:
    """Stop when the run's data.tokenizer is no longer the tokenizer the checkpoint was trained with (the file at
    its path replaced, 'embedded' rebuilt): its scores would be of other token ids."""
    name, sha256 = saved_tokenizer(step_dir)
    if not sha256:
        note(f"note: checkpoint {step_dir} does not record its tokenizer's sha256 (saved before checkpoints did): "
             f"the tokenizer {tokenizer.name!r} could not be checked")
    elif sha256 != tokenizer.sha256:
        raise ValueError(f"checkpoint {str(step_dir)!r} was trained with tokenizer {name!r} (sha256 {sha256[:12]}...), "
                         f"but {loaded_by} {tokenizer.name!r} (sha256 {tokenizer.sha256[:12]}...)")


def _check_request(cfg: JobConfig, tasks: str | None, val_steps: int | None) -> None:
    """Stop on what was asked before any checkpoint is read: a bad task file, no validation split, nothing at all."""
    if val_steps is not None and val_steps < 0:
        raise ValueError(f"--val-steps {val_steps}: must be >= 0 (0: no validation loss)")
    steps = cfg.eval.steps if val_steps is None else val_steps
    named = load_tasks(cfg.eval.tasks if tasks is None else tasks)
    if not steps and not named:
        raise ValueError("nothing to evaluate: no validation batches (--val-steps, or the run's eval.steps) and no task "
                         "files (--tasks, or the run's eval.tasks)")
    if steps and validation_split_tokens(cfg.data.dataset) == 0:
        raise ValueError(f"dataset {cfg.data.dataset!r} has no validation split: --val-steps 0 scores the tasks only")


def evaluate_checkpoints(step_dirs: list[Path], cfg: JobConfig, device: torch.device, *, tasks: str | None,
                         val_steps: int | None, note=print) -> list[dict]:
    """One row per checkpoint: {"step", "tokens", "checkpoint", **metrics}. What was asked is checked first, then
    every checkpoint (complete, its checksums matching), before the model is built."""
    for step_dir in step_dirs:
        _step_of(step_dir)
    _check_request(cfg, tasks, val_steps)
    for step_dir in step_dirs:
        _check_intact(step_dir, note)
    model, tokenizer, fallbacks = build_model(cfg, device)
    for choice in fallbacks:
        note(f"note: kernel {choice.op}: {choice.chosen} (fallback from '{choice.requested}': {choice.reason})")
    for step_dir in step_dirs:
        _check_tokenizer(step_dir, tokenizer, note)
    evaluator = Evaluator(cfg, tokenizer, device, val_steps=val_steps, tasks=tasks, offline=True)
    rows = []
    for step_dir in step_dirs:
        step = _step_of(step_dir)
        load_model_weights(model, step_dir)
        rows.append({"step": step, "tokens": _checkpoint_tokens(step_dir), "checkpoint": str(step_dir),
                     **evaluator.run(model)})
    return rows


def evaluate_export(export_dir: Path, device: torch.device, *, tasks: str | None, val_steps: int | None,
                    note=print) -> list[dict]:
    """One row, as evaluate_checkpoints gives for the checkpoint the export came from ("checkpoint": the export).
    The export is checked (whole, its checksums matching, its tokenizer the recorded one) before the model is built."""
    from titan_k3.checkpoint.hf import args_from_hf_config
    from titan_k3.config import load_job_config

    record = export_record(export_dir)
    run_config = export_dir / RUN_CONFIG_FILE if record.get("run_config") else None
    try:
        cfg = load_job_config([], toml_text=run_config.read_text()) if run_config else load_job_config([])
    except (OSError, ValueError) as e:
        raise ValueError(f"{run_config or 'the default config'}: {e}") from None
    _check_request(cfg, tasks, val_steps)
    problem, unverified = verify_export(export_dir)
    if problem is not None:
        raise ValueError(f"export {str(export_dir)!r} is damaged: {problem}")
    config = json.loads((export_dir / CONFIG_FILE).read_text())
    try:
        args = args_from_hf_config(config)
    except (KeyError, TypeError) as e:
        raise ValueError(f"{export_dir / CONFIG_FILE}: not a K3 export config (no valid {e})") from None
    if unverified:
        note(f"note: export {export_dir} was made before exports carried checksums: not verified; evaluated with "
             "the default settings")
    if run_config is None and not unverified:
        note(f"note: export {export_dir} holds no {RUN_CONFIG_FILE} (its checkpoint had no run config.toml beside "
             "it): evaluated with the default settings")
    tokenizer_file = (config.get(TOKENIZER_KEY) or {}).get("file")
    loaded_by = "its tokenizer file holds" if tokenizer_file else f"data.tokenizer = {cfg.data.tokenizer!r} loads"
    if tokenizer_file:
        cfg.data.tokenizer = str(export_dir / tokenizer_file)
    model, tokenizer, fallbacks = build_model(cfg, device, args)
    for choice in fallbacks:
        note(f"note: kernel {choice.op}: {choice.chosen} (fallback from '{choice.requested}': {choice.reason})")
    _check_tokenizer(export_dir, tokenizer, note, loaded_by)
    evaluator = Evaluator(cfg, tokenizer, device, val_steps=val_steps, tasks=tasks, offline=True)
    load_model_weights(model, export_dir)
    step = record.get("step")
    if step is None:
        step = json.loads((export_dir / INDEX_FILE).read_text()).get("metadata", {}).get("source_step")
    return [{"step": step, "tokens": record.get("tokens_seen"), "checkpoint": str(export_dir), **evaluator.run(model)}]


def markdown_table(rows: list[dict]) -> str:
    """Steps down, metrics across: val_loss, then acc / acc_norm per task."""
    tasks = sorted({t for r in rows for t in task_names(r)})
    head = ["step", "tokens"] + (["val_loss"] if any("val_loss" in r for r in rows) else [])
    head += [f"{t} {m}" for t in tasks for m in ("acc", "acc_norm")]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [str(r["step"]), "?" if r["tokens"] is None else f"{r['tokens']:,}"]
        if "val_loss" in head:
            cells.append(f"{r['val_loss']:.4f}" if "val_loss" in r else "")
        cells += [f"{r[f'eval/{t}/{m}']:.3f}" if f"eval/{t}/{m}" in r else "" for t in tasks for m in ("acc", "acc_norm")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _device(spec: str) -> torch.device:
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(spec)
    except RuntimeError:
        raise ValueError(f"--device={spec!r}: expected 'auto', 'cpu', 'cuda' or 'cuda:N'") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device={spec!r}: no CUDA device is visible")
    return device


def _stderr(line: str) -> None:
    print(line, file=sys.stderr)


def _run_and_steps(checkpoint: Path | None, runs: Path | None) -> tuple[Path, list[Path]]:
    """(run dir, step dirs to evaluate) of --checkpoint STEP_DIR or --runs RUN_DIR."""
    if checkpoint is not None:
        _step_of(checkpoint)  # NOTE: first: a run's folder or its checkpoints folder has no run two levels up
        return run_dir_of(checkpoint), [checkpoint]
    cfg = load_run_config(runs)
    step_dirs = list(layout.complete_steps(runs / cfg.checkpoint.folder).values())
    incomplete = layout.incomplete_steps(runs / cfg.checkpoint.folder)
    if incomplete:
        # NOTE: left out, the table would show a run without that checkpoint and say nothing.
        raise ValueError(f"checkpoint {str(next(iter(incomplete.values())))!r} is damaged: no "
                         f"{layout.DCP_METADATA} (damaged step dirs: "
                         f"{', '.join(p.name for p in incomplete.values())}; move them aside to evaluate the rest)")
    if not step_dirs:
        raise ValueError(f"run directory {str(runs)!r}: no complete checkpoint under {cfg.checkpoint.folder}/")
    return runs, step_dirs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m titan_k3.eval", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--checkpoint", type=Path, help="a step dir (RUN_DIR/checkpoints/step-N) or an export directory "
                       "(python -m titan_k3.checkpoint.export --out DIR)")
    where.add_argument("--runs", type=Path, metavar="RUN_DIR", help="every checkpoint of this run; writes RUN_DIR/eval_table.md")
    parser.add_argument("--tasks", default=None, help="comma-separated task files (JSONL); default: the run's eval.tasks")
    parser.add_argument("--val-steps", type=int, default=None, help="validation batches (0: none); default: the run's eval.steps")
    parser.add_argument("--device", default="auto", help="'auto' (CUDA when visible), 'cpu', 'cuda' or 'cuda:N'")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    args = parser.parse_args(argv)
    try:
        if args.runs is not None:
            _check_writable(args.runs / TABLE_NAME)
        device = _device(args.device)
        if args.checkpoint is not None and is_export_dir(args.checkpoint):
            rows = evaluate_export(args.checkpoint, device, tasks=args.tasks, val_steps=args.val_steps, note=_stderr)
        else:
            run_dir, step_dirs = _run_and_steps(args.checkpoint, args.runs)
            rows = evaluate_checkpoints(step_dirs, load_run_config(run_dir), device, tasks=args.tasks,
                                        val_steps=args.val_steps, note=_stderr)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    table = markdown_table(rows)
    print(json.dumps(rows, indent=2) if args.json else table, end="" if not args.json else "\n")
    if args.runs is not None:
        # NOTE: after the print: a table that cannot be written (the disk filled during the evaluation) is not lost.
        try:
            (args.runs / TABLE_NAME).write_text(f"# Benchmarks across tokens: run `{args.runs.name}`\n\n{table}")
        except OSError as e:
            print(f"error: {args.runs / TABLE_NAME}: not written ({e.strerror or e}); the table is printed above",
                  file=sys.stderr)
            return 1
    return 0


def _check_writable(path: Path) -> None:
    """Raises ValueError, before any evaluation, where `path` (a file to write at the end) cannot be written."""
    if path.is_dir():
        raise ValueError(f"{path}: a directory, where the evaluation's table is written; move it away")
    if not os.access(path if path.exists() else path.parent, os.W_OK):
        raise ValueError(f"{path}: not writable, where the evaluation's table is written")
