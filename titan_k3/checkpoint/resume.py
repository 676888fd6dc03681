"""What a start resumes from, and whether it fits: chosen and checked before the run directory is touched.

`plan_resume` picks the newest intact checkpoint of the run (checkpoint.load_step), else initial_load_path's weights
(a DCP checkpoint, a checkpoints folder or an exported K3 directory), verifying their checksums and, for weights
alone, their tokenizer. `check_resumable` then compares shapes on metadata alone, so a checkpoint of another model or
optimizer stops with one line before any tensor is read. `load_model_weights` is the model-only load
(initial_load_path, evaluation, export).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from titan_k3.checkpoint import layout, verify
from titan_k3.checkpoint.verify import ResumePlan

_MAX_LISTED = 5
"""Mismatches named in one refusal; the rest are counted."""


def flat_tensor_shapes(state: dict[str, Any], prefix: str = "") -> dict[str, tuple[int, ...]]:
    """{DCP key: global shape} for every tensor of a nested state dict (DCP joins keys with '.')."""
    out = {}
    for k, v in state.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flat_tensor_shapes(v, key + "."))
        elif isinstance(v, torch.Tensor):
            out[key] = tuple(v.shape)
    return out


def check_compatible(path: Path, state: dict[str, Any], *, model_only: bool = False) -> None:
    """Raise one ValueError listing the first mismatched keys and shapes between `path` and `state`.

    Reads only DCP's metadata, so a checkpoint of another model stops before any tensor is read.
    """
    if not (path / layout.DCP_METADATA).is_file():
        raise ValueError(f"checkpoint {path}: not a complete checkpoint (no {layout.DCP_METADATA})")
    try:
        metadata = dcp.FileSystemReader(str(path)).read_metadata()
    except Exception as e:  # a damaged .metadata fails inside pickle with any error type
        raise ValueError(f"checkpoint {path}: cannot read {layout.DCP_METADATA} ({type(e).__name__})") from None
    saved = {k: tuple(m.size) for k, m in metadata.state_dict_metadata.items() if isinstance(m, TensorStorageMetadata)}
    want = flat_tensor_shapes(state)
    if model_only:
        saved = {k: v for k, v in saved.items() if k.startswith("model.")}
    problems = [f"{k}: checkpoint {list(saved[k])} vs this run {list(s)}"
                for k, s in want.items() if k in saved and saved[k] != s]
    problems += [f"{k}: missing from the checkpoint (this run {list(s)})" for k, s in want.items() if k not in saved]
    problems += [f"{k}: not in this run (checkpoint {list(s)})" for k, s in saved.items() if k not in want]
    if problems:
        listed = "; ".join(problems[:_MAX_LISTED])
        more = f" (+{len(problems) - _MAX_LISTED} more)" if len(problems) > _MAX_LISTED else ""
        raise ValueError(
            f"checkpoint {path} does not match this model/optimizer ({len(problems)} mismatches): {listed}{more}"
        )


def plan_start(c, folder: Path, group=None) -> ResumePlan:
    """What a run with [checkpoint] section `c` starts from: the newest intact checkpoint of `folder`,
    else initial_load_path's (model weights only), else nothing. Collective over `group` when distributed."""
    notes: list[str] = []
    if c.enable or getattr(c, "save_on_stop", False):
        plan = verify.choose(Path(folder), c.load_step, group)
        if plan.path is not None:
            return plan
        notes = plan.notes
    if not c.initial_load_path:
        return ResumePlan(notes=notes)
    src, key = Path(c.initial_load_path), f"config key 'checkpoint.initial_load_path' = '{c.initial_load_path}'"
    from titan_k3.checkpoint.export import is_export_dir, verify_export

    if is_export_dir(src):
        try:
            problem, unverified = verify_export(src, group)
        except ValueError as e:
            raise ValueError(f"{key}: {e}") from None
        if problem is not None:
            raise ValueError(f"{key}: damaged: {problem}")
        return ResumePlan(src, initial=True, notes=notes, unverified=unverified)
    if (src / layout.DCP_METADATA).is_file():
        problem, unverified = verify.verify(src, group)
        if problem is not None:
            raise ValueError(f"{key}: damaged: {problem}")
        return ResumePlan(src, initial=True, notes=notes, unverified=unverified)
    try:
        plan = verify.choose(src, -1, group)
    except ValueError as e:
        raise ValueError(f"{key}: {e}") from None
    if plan.path is None:
        raise ValueError(f"{key}: no checkpoint there")
    plan.initial, plan.notes = True, notes + plan.notes
    return plan


def check_resumable(cfg, run_dir: Path, model: torch.nn.Module, optimizers) -> ResumePlan:
    """Choose, before the run directory is touched, what the run starts from, and refuse what it would fail to load.

    Verifies the checksums of the checkpoint it picks (and of each damaged newer
    one it passes over) and initial_load_path's tokenizer (plan_resume), then
    compares shapes on metadata alone: the checkpoint's model and optimizer, or
    initial_load_path's model (a DCP checkpoint's metadata or an export's
    safetensors headers).
    """
    group = dist.new_group(backend="gloo") if dist.is_available() and dist.is_initialized() else None
    plan = plan_resume(cfg, run_dir, group)
    if plan.path is None:
        return plan
    if not plan.initial:
        check_compatible(plan.path, {"model": get_model_state_dict(model), "optim": optimizers.state_dict()})
    elif (plan.path / "config.json").is_file():
        from titan_k3.checkpoint.export import export_shapes

        _check_export_shapes(plan.path, get_model_state_dict(model), export_shapes(plan.path))
    else:
        check_compatible(plan.path, {"model": get_model_state_dict(model)}, model_only=True)
    return plan


def plan_resume(cfg, run_dir: Path, group=None) -> ResumePlan:
    """What check_resumable refuses without the model (--job.validate_only asks too): the checkpoint the run starts
    from (plan_start: checkpoint.load_step, initial_load_path, their checksums) and initial_load_path's tokenizer."""
    plan = plan_start(cfg.checkpoint, Path(run_dir) / cfg.checkpoint.folder, group=group)
    if plan.initial:
        from titan_k3.data.tokenizer import tokenizer_identity

        check_tokenizer(plan, *tokenizer_identity(cfg.data.tokenizer))
    return plan


def saved_tokenizer(path: Path) -> tuple[str, str]:
    """(name, sha256) of the tokenizer checkpoint dir or export directory `path` was trained with; sha256 is ""
    when it does not record one (saved before checkpoints recorded the hash)."""
    if (path / "config.json").is_file():
        record = json.loads((path / "config.json").read_text()).get(layout.TOKENIZER_KEY) or {}
        return record.get("name", ""), record.get("sha256", "")
    meta = json.loads((path / layout.META_FILE).read_text())
    return meta.get("tokenizer", ""), meta.get("tokenizer_sha256", "")


def check_tokenizer(plan: ResumePlan, name: str, sha256: str) -> None:
    """Refuse initial_load_path weights trained with another tokenizer than this run's (`name`, `sha256`).

    A full resume needs no check: the data position carries the dataset's hash, which covers its tokenizer.
    Weights alone carry token ids only: another tokenizer of the same vocabulary size loads without a shape
    mismatch and trains on ids that mean other text. A checkpoint that does not record its tokenizer's hash
    loads, with the reason in plan.tokenizer_unchecked.
    """
    if plan.path is None or not plan.initial or not sha256:
        return
    try:
        saved_name, saved_sha = saved_tokenizer(plan.path)
    except (OSError, ValueError) as e:
        plan.tokenizer_unchecked = f"{plan.path}: tokenizer not checked: its record is unreadable ({e})"
        return
    if not saved_sha:
        plan.tokenizer_unchecked = (
            f"{plan.path} does not record its tokenizer's sha256 (saved before checkpoints did"
            + (f"; its tokenizer's name: {saved_name!r}" if saved_name else "")
            + f"): the tokenizer could not be checked against this run's {name!r} (sha256 {sha256[:12]}...)")
        return
    if saved_sha != sha256:
        raise ValueError(
            f"checkpoint.initial_load_path {plan.path} was trained with tokenizer {saved_name!r} "
            f"(sha256 {saved_sha[:12]}...), but this run's data.tokenizer is {name!r} (sha256 {sha256[:12]}...): "
            "its token ids would mean other text; use the checkpoint's tokenizer, or start without initial_load_path")


def _check_export_shapes(src: Path, current: dict[str, torch.Tensor], got: dict[str, tuple[int, ...]]) -> None:
    want = {k: tuple(v.shape) for k, v in current.items()}
    if want != got:
        bad = [f"{k}: export {list(got.get(k, ()))} vs model {list(s)}" for k, s in want.items() if got.get(k) != s]
        bad += [f"{k}: not in this model" for k in got if k not in want]
        raise ValueError(f"initial_load_path {src} does not match this model: {'; '.join(bad[:_MAX_LISTED])}")


def load_model_weights(model: torch.nn.Module, src: Path, process_group=None) -> None:
    """Model-only load: a DCP step dir, a checkpoints folder (its `latest`), or an exported K3 dir."""
    if (src / "config.json").is_file():
        from titan_k3.checkpoint.export import import_state_dict

        _, full = import_state_dict(src)
        _check_export_shapes(src, get_model_state_dict(model), {k: tuple(v.shape) for k, v in full.items()})
        set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True))
        return
    if not (src / layout.DCP_METADATA).is_file():
        path, _ = layout.resolve(src, -1)
        if path is None:
            raise ValueError(f"config key 'checkpoint.initial_load_path' = '{src}': no checkpoint there")
        src = path
    state = {"model": get_model_state_dict(model)}
    check_compatible(src, state, model_only=True)
    distributed = dist.is_available() and dist.is_initialized()
    dcp.load(state, checkpoint_id=str(src), process_group=process_group, no_dist=not distributed)
    set_model_state_dict(model, state["model"])
