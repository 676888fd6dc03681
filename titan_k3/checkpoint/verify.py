"""Checksums across ranks, the choice of an intact checkpoint, and what a failed save says.

Sealing a save: once DCP has written every file of `step-N.tmp-*`, rank 0
lists the files, every rank hashes its share of the 64 MiB blocks
(integrity.share), rank 0 gathers the CRCs and writes checksums.json; then
the dir is committed. Choosing at start-up: the candidates (`latest`, then the
other complete checkpoints, newest first) come from rank 0; every rank checks
its share of each candidate's blocks and all ranks gather every rank's verdict,
so all of them take the same checkpoint: the first intact one. A damaged one
passed over is named in a note the manager emits as a `checkpoint_fallback`
event; when none is intact the start stops with one line naming the damaged
file of each.
"""

from __future__ import annotations

import errno
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from titan_k3.checkpoint import integrity, layout

# Below this many free bytes after a failed save, the disk is called full even when the error does not say so
# (torch's zip writer reports a full disk as "unexpected pos ...").
_NEARLY_FULL = 64 << 20


def _dist_ctx(group) -> tuple[int, int, bool]:
    """(rank, world, distributed) in `group` (the default group when None)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group), True
    return 0, 1, False


def _all_gather(obj: Any, group) -> list[Any]:
    rank, world, distributed = _dist_ctx(group)
    if not distributed:
        return [obj]
    out = [None] * world
    dist.all_gather_object(out, obj, group=group)
    return out


def _from_rank0(obj: Any, group) -> Any:
    _, _, distributed = _dist_ctx(group)
    if not distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    return box[0]


# ---------------------------------------------------------------------- saving
def seal(tmp: Path, group) -> None:
    """Write checksums.json into a fully written save dir `tmp` (every rank of `group` calls this).

    Raises on the rank that failed (rank 0 when it could not list or write);
    the manager agrees on failures across ranks afterwards.
    """
    rank, world, _ = _dist_ctx(group)
    sizes, listing_error = None, None
    if rank == 0:
        try:
            sizes = integrity.file_sizes(tmp)
        except OSError as e:
            listing_error = e
    sizes = _from_rank0(sizes, group)
    if sizes is None:
        if listing_error is not None:
            raise listing_error
        return
    mine = integrity.share(integrity.blocks_of(sizes), rank, world)
    try:
        crcs, error = dict(zip(mine, integrity.hash_blocks(tmp, mine))), None
    except (OSError, ValueError) as e:
        crcs, error = None, f"hashing on rank {rank}: {e}"
    gathered = _all_gather((crcs, error), group)
    if rank != 0:
        return
    errors = [e for _, e in gathered if e]
    if errors:
        raise OSError(errors[0])
    merged = {b: c for part, _ in gathered for b, c in part.items()}
    integrity.write(tmp, integrity.build(sizes, merged))


def state_bytes(state: Any) -> int:
    """Bytes of every tensor in a nested state dict, by global shape (a DTensor counts whole, once)."""
    if isinstance(state, dict):
        return sum(state_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(state_bytes(v) for v in state)
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    return 0


def format_bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def _root_cause(exc: BaseException) -> BaseException:
    """The innermost error behind `exc` (through DCP's per-rank CheckpointException), an OSError if any."""
    seen, stack, found = set(), [exc], []
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        found.append(e)
        if isinstance(e, CheckpointException):
            stack.extend(wrapped[0] for wrapped in e.failures.values())
        stack.extend([e.__cause__, e.__context__])
    for e in found:
        if isinstance(e, OSError) and e.errno is not None:
            return e
    return found[-1]


def describe_failure(exc: BaseException, folder: Path, free_bytes: int) -> str:
    """One line on why a save failed; names ENOSPC when the error or the free space says the disk is full."""
    root = _root_cause(exc)
    if isinstance(root, OSError) and root.errno == errno.ENOSPC:
        return f"no space left on device (ENOSPC) at {folder}: {format_bytes(free_bytes)} free"
    first = (str(root).strip().splitlines() or [""])[0]
    text = f"{type(root).__name__}: {first}"
    if free_bytes < _NEARLY_FULL:
        text += f" (the disk is full, ENOSPC: {format_bytes(free_bytes)} free at {folder})"
    return text


# ---------------------------------------------------------------------- loading
@dataclass
class ResumePlan:
    """What a run starts from, chosen before the run directory is touched; the same on every rank.

    path: the checkpoint dir to load, or None (a fresh start).
    initial: path is checkpoint.initial_load_path's (model weights only).
    notes: how path was chosen when not plainly (damaged checkpoints passed over, a stale 'latest').
    unverified: path was saved before checksums existed.
    discarded: tmp dirs of interrupted saves removed at start-up (rank 0).
    tokenizer_unchecked: why initial_load_path's tokenizer could not be compared with this run's ("" when it was).
    """

    path: Path | None = None
    initial: bool = False
    notes: list[str] = field(default_factory=list)
    unverified: bool = False
    discarded: list[str] = field(default_factory=list)
    tokenizer_unchecked: str = ""

    def discard_leftovers(self, folder: Path) -> None:
        """Remove interrupted saves' tmp dirs (rank 0, before anything new is written: they may fill the disk)."""
        self.discarded = layout.remove_leftovers(folder)


def _meta_version(path: Path) -> int | None:
    try:
        return int(json.loads((path / layout.META_FILE).read_text()).get("version"))
    except (OSError, ValueError, TypeError, AttributeError):
        return None


def verify(path: Path, group=None) -> tuple[str | None, bool]:
    """(the first problem found, or None; whether `path` predates checksums): the same on every rank.

    Every rank checks the sizes (no byte read) and CRCs its share of the blocks.
    """
    rank, world, _ = _dist_ctx(group)
    problem, unverified, doc = None, False, None
    try:
        doc = integrity.read(path)
        problem = integrity.check_sizes(path, doc)
    except ValueError as e:
        # NOTE: meta.json version 1 was written before checksums existed; such a checkpoint loads, announced.
        if _meta_version(path) == 1:
            unverified = True
        else:
            problem = str(e)
    if problem is None and doc is not None:
        try:
            problem = integrity.check_blocks(path, doc, integrity.share(integrity.expected_blocks(doc), rank, world))
        except (OSError, ValueError, KeyError, IndexError) as e:
            problem = f"{path}: {type(e).__name__}: {e}"
    verdicts = _all_gather((problem, unverified), group)
    problems = [p for p, _ in verdicts if p]
    return (problems[0] if problems else None), verdicts[0][1]


def choose(folder: Path, load_step: int, group=None) -> ResumePlan:
    """The newest intact checkpoint of `folder` (load_step -1: `latest` first), else a fresh plan.

    load_step >= 0 takes exactly that step: damaged, it stops (ValueError). All
    checkpoints damaged: ValueError naming each one's damaged file. A `step-N`
    dir without .metadata is a damaged checkpoint too (layout.incomplete_steps):
    one newer than the checkpoint loaded is named as passed over, and one alone
    stops the start, so a run never takes it for absent and saves over it.
    """
    rank, _, _ = _dist_ctx(group)
    found: tuple[list[str], str, dict[int, str]] | str = ([], "", {})
    if rank == 0:
        try:
            paths, note = layout.candidates(folder, load_step)
            incomplete = {s: p.name for s, p in layout.incomplete_steps(folder).items()} if load_step < 0 else {}
            found = ([p.name for p in paths], note, incomplete)
        except ValueError as e:
            found = str(e)
    found = _from_rank0(found, group)
    if isinstance(found, str):
        raise ValueError(found)
    names, note, incomplete = found
    missing = {s: f"{folder / name / layout.DCP_METADATA}: missing" for s, name in incomplete.items()}
    if not names and note and not missing:
        raise ValueError(f"{folder}: {note}")
    damaged = []
    for name in names:
        problem, unverified = verify(folder / name, group)
        if problem is None:
            notes = [note] if note else []
            step = int(name.removeprefix("step-"))
            passed = [m for s, m in sorted(missing.items(), reverse=True) if s > step] + damaged
            if passed:
                notes.append(f"{'; '.join(passed)}: damaged, passed over; loading the newest intact checkpoint, {name}")
            return ResumePlan(folder / name, notes=notes, unverified=unverified)
        damaged.append(problem)
    if damaged and load_step >= 0:
        raise ValueError(f"config key 'checkpoint.load_step' = {load_step}: that checkpoint is damaged: {damaged[0]}")
    damaged += [m for _, m in sorted(missing.items(), reverse=True)]
    if damaged:
        raise ValueError(f"{folder}: no intact checkpoint to load: {'; '.join(damaged)} (restore the files, or move "
                         "the damaged step dirs aside to start without them)")
    return ResumePlan()
