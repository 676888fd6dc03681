"""Save and resume a run with torch.distributed.checkpoint (DCP): atomic, async, reshardable.

What one checkpoint (`checkpoints/step-N/`) holds:

    DCP files + .metadata   "model.*"  the model state dict as it lives (DTensor shards under FSDP2,
                                       plain tensors otherwise), incl. the persistent Quantile Balancing
                                       buffers layers.N.ffn.router.qb_bias
                            "optim.*"  Optimizers.state_dict(): {"muon"|"adamw": {"state": {param name:
                                       {...}}, "param_groups": [...]}}, keyed by parameter name
    meta.json               the TrainState (step, tokens seen, skipped updates, sequence length, and the data
                            loader's position), LR schedule state, model args, the tokenizer's name and
                            sha256 (a weights-only load checks it), world sizes (rank 0; human-readable; the
                            exporter reads the model args from it)
    rank-R.pt               per rank R: the torch CPU/CUDA and Python RNG states
    checksums.json          size and CRC-32 per 64 MiB block of every other file (integrity.py)

DCP stores every tensor by its global shape, so a checkpoint saved on W ranks
loads on any other number of ranks (resharding). The data position is global
by construction (titan_k3/data/loader.py: the stream does not depend on the
ranks, and every rank holds the same state), so the TrainState rank 0 writes
serves every rank, and a different dp_world continues at the same global
sequence index; the loader itself refuses, with a clear message, a position
that is not a whole number of new global batches. The checkpointer reaches the
data position only through the TrainState (its `data` owner is the loader).
RNG states are per rank: on another world size, rank R takes rank R's saved
state when there was one, and otherwise keeps its seeded state.

Saving (every `interval` updates, at the last update, and on SIGTERM) writes
under `step-N.tmp-<nonce>`; when DCP's coordinator has written `.metadata`
(which happens after every rank's data is written) rank 0 renames the dir to
`step-N`, moves `latest`, then applies retention. In async mode the tensors
are staged to host memory during the call and written by a background thread
while training continues; the next save (and the end of the run) waits for it.

Before a save, the state's bytes are checked against the free space of the
checkpoint folder. After DCP has written the files, every rank hashes its share
of them and rank 0 writes checksums.json (verify.seal; in async mode on a
worker thread, after the write). A save that fails (no space, a write error,
on any rank) removes its tmp dir, leaves `latest` where it was, emits
`checkpoint_failed` and stops the run (CheckpointSaveError): the rerun resumes
from the last good checkpoint. A start loads the newest checkpoint whose
checksums match (verify.choose), with a `checkpoint_fallback` event naming the
damaged file of each newer one passed over.
"""

from __future__ import annotations

import json
import random
import shutil
import signal
import threading
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

from titan_k3.checkpoint import layout, verify
from titan_k3.checkpoint.faults import CheckpointFaults
from titan_k3.checkpoint.resume import check_compatible, check_tokenizer, load_model_weights, plan_start
from titan_k3.checkpoint.verify import ResumePlan, format_bytes
from titan_k3.train_state import DATA_KEY

META_FILE = layout.META_FILE
# 2: the step dir has checksums.json. Version 1 checkpoints (none) still load, announced as unverified.
# 3: the TrainState holds the data position; versions 1 and 2 kept it in each rank-R.pt (still read on load).
META_VERSION = 3
_READABLE_META_VERSIONS = (1, 2, 3)
# Room for the small files of a save (rank-R.pt, meta.json, .metadata, checksums.json), per rank.
_SMALL_FILES_BYTES = 1 << 20
# NOTE: a single-process run saves and loads with no_dist; DCP still warns about it on every call.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


def rank_file(rank: int) -> str:
    return f"rank-{rank}.pt"


@dataclass
class _Pending:
    """A save whose files are still being written (async) or not yet committed."""

    step: int
    tmp: Path
    future: Future | None
    started: float
    stage_seconds: float
    needed_bytes: int
    error: str | None = None


class CheckpointSaveError(RuntimeError):
    """A save failed (no space, a write error); its partial files are gone and `latest` is unchanged."""


class StopRequest:
    """SIGTERM (and SIGINT when asked) sets a flag; the loop finishes its update, saves and exits 0.

    The handler only records the signal: stopping between two updates is what
    keeps the checkpoint consistent. Installed only from the main thread.
    """

    def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM,)):
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for s in signals:
                self._previous[s] = signal.signal(s, self._handle)

    def _handle(self, signum, _frame) -> None:
        self.signum = signum

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}


class CheckpointManager:
    """Saves and loads one run's checkpoints.

    Args:
        cfg: the [checkpoint] section.
        folder: run_dir / cfg.folder.
        model, optimizers, schedule: the trainer's objects (optimizers is an `Optimizers`, schedule an
            `LRSchedule`).
        train_state: where the run is (the trainer's TrainState, the data position included): its state_dict()
            is saved in meta.json and handed back to its load_state_dict() on resume.
        meta: JSON-able facts stored in meta.json (model args, flavor, ...).
        events: an EventLog (rank 0 writes; others print nothing).
        restore_data: False hands the TrainState back without its data position on resume, so the loader
            stays at its start (a fixed-batch run trains on the loader's first batch, which a fresh loader
            yields again).
        faults: the [debug] checkpoint fault injections (faults.py); none by default.
    """

    def __init__(self, cfg, folder: Path, *, model: torch.nn.Module, optimizers, schedule, train_state, meta: dict[str, Any], events, rank: int = 0, world_size: int = 1,
                 dp_rank: int = 0, dp_world: int = 1, restore_data: bool = True, faults: CheckpointFaults | None = None):
        self.cfg = cfg
        self.folder = Path(folder)
        self.model, self.optimizers, self.schedule = model, optimizers, schedule
        self.train_state = train_state
        self.meta = meta
        self.events = events
        self.rank, self.world_size, self.dp_rank, self.dp_world = rank, world_size, dp_rank, dp_world
        self.distributed = dist.is_available() and dist.is_initialized()
        # NOTE: an async save runs DCP's collectives in a background thread, so DCP gets a gloo
        # group of its own, and the main thread's small agreements (stop flag, save done, tmp dir
        # name) another: two threads must never interleave collectives on one group.
        self.dcp_group = dist.new_group(backend="gloo") if self.distributed else None
        self.group = dist.new_group(backend="gloo") if self.distributed else None
        self.stop = StopRequest()
        self._pending: _Pending | None = None
        self._last_saved_step: int | None = None
        self.restore_data = restore_data
        self.faults = faults or CheckpointFaults()
        # Hashes an async save's files once DCP has written them, off the training thread.
        self._sealer: ThreadPoolExecutor | None = None
        for key, value in self.faults.active().items() if rank == 0 else ():
            events.emit("fault_injection", f"FAULT INJECTED: {key} = {value}", step=0, key=key, value=value)

    # ------------------------------------------------------------------ state dicts
    def _dcp_state(self) -> dict[str, Any]:
        """The sharded part; tensors are the live ones, so dcp.load fills them in place."""
        return {"model": get_model_state_dict(self.model), "optim": self.optimizers.state_dict()}

    def _rank_state(self) -> dict[str, Any]:
        rng = {"torch_cpu": torch.get_rng_state(), "python": random.getstate()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            rng["torch_cuda"] = torch.cuda.get_rng_state()
        return {"rank": self.rank, "dp_rank": self.dp_rank, "dp_world": self.dp_world, "rng": rng}

    # ------------------------------------------------------------------ saving
    @property
    def enabled(self) -> bool:
        return bool(self.cfg.enable)

    @property
    def resumes(self) -> bool:
        """Whether a stop saves and a start resumes: periodic checkpoints, or only the stop's (save_on_stop)."""
        return bool(self.cfg.enable or self.cfg.save_on_stop)

    def after_step(self, step: int, last: bool) -> bool:
        """Call after every update: commits finished async saves, saves on schedule or on SIGTERM.

        Returns True when the run must stop now (a stop signal arrived on any rank).
        """
        if self._pending is not None and self._pending.future is not None and self._all_done():
            self._finalize()
        signum = self._stop_agreed()
        if (self.enabled and (last or step % self.cfg.interval == 0)) or (signum and self.resumes):
            self.save(step)
        if signum:
            self.events.emit("stopped", f"{signal.Signals(signum).name} received: stopping after update {step}"
                             + (" with a checkpoint" if self.resumes else " (checkpoints disabled)"), step=step)
        return bool(signum)

    def save(self, step: int) -> None:
        """Save the state after update `step` (blocking, or async per cfg.async_mode).

        Raises CheckpointSaveError on every rank when the space is short or a write fails.
        """
        if self._last_saved_step == step:
            return
        self.wait()
        t0 = time.perf_counter()
        state = self._dcp_state()
        needed = self._check_space(step, state)
        tmp = self._agree_tmp_dir(step)
        error = None
        try:
            tmp.mkdir(parents=True, exist_ok=True)
            torch.save(self._rank_state(), tmp / rank_file(self.rank))
            if self.rank == 0:
                meta = {"version": META_VERSION, "step": step, "train": self.train_state.state_dict(),
                        "schedule": self.schedule.state_dict(), "world_size": self.world_size,
                        "dp_world": self.dp_world, "saved_unix": time.time(), **self.meta}
                (tmp / META_FILE).write_text(json.dumps(meta, indent=2, default=str))
        except (OSError, RuntimeError) as e:
            error = self._describe(e)
        # NOTE: agree before DCP's collectives: a rank that could not write its own file must not leave the
        # others waiting inside dcp.save.
        error = self._agree(error)
        if error is not None:
            self._fail(_Pending(step, tmp, None, t0, 0.0, needed), error)
        kw = dict(checkpoint_id=str(tmp), process_group=self.dcp_group, no_dist=not self.distributed,
                  storage_writer=self.faults.storage_writer(step, tmp))
        future = None
        try:
            if self.cfg.async_mode == "async":
                upload = dcp.async_save(state, **kw)
                # NOTE: newer torch returns an AsyncSaveResponse (staging + upload futures) for some stagers.
                upload = getattr(upload, "upload_completion", upload)
                if self._sealer is None:
                    self._sealer = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-seal")
                future = self._sealer.submit(self._written_then_sealed, upload, tmp)
            else:
                dcp.save(state, **kw)
                verify.seal(tmp, self.dcp_group)
        except (Exception, CheckpointException) as e:
            error = self._describe(e)
        self._pending = _Pending(step, tmp, future, t0, time.perf_counter() - t0, needed, error)
        self._last_saved_step = step
        self.faults.kill_before_commit(step, lambda: future.result() if future is not None else None)
        if future is None:
            self._finalize()

    def _written_then_sealed(self, upload: Future, tmp: Path) -> None:
        """The async save's worker: wait for DCP's write, then hash the files (verify.seal)."""
        upload.result()
        verify.seal(tmp, self.dcp_group)

    def _check_space(self, step: int, state: dict[str, Any]) -> int:
        """The bytes this save needs; CheckpointSaveError when rank 0's file system has fewer free."""
        needed = verify.state_bytes(state) + _SMALL_FILES_BYTES * self.world_size
        free = 0
        if self.rank == 0:
            self.folder.mkdir(parents=True, exist_ok=True)
            free = self.faults.free_bytes_at(self.folder)
        sizes = torch.tensor([needed, free], dtype=torch.int64)
        if self.distributed:
            dist.broadcast(sizes, src=0, group=self.group)
        needed, free = sizes.tolist()
        if needed > free:
            kept = f" (kept: checkpoint.keep_latest_k = {self.cfg.keep_latest_k})" if self.cfg.keep_latest_k else ""
            self._refuse(step, f"checkpoint of update {step} needs {format_bytes(needed)}, "
                               f"{format_bytes(free)} free at {self.folder}{kept}: not saved")
        return needed

    def _describe(self, exc: BaseException) -> str:
        free = self.faults.free_bytes_at(self.folder) if self.folder.is_dir() else 0
        return verify.describe_failure(exc, self.folder, free)

    def _agree(self, error: str | None) -> str | None:
        """The first rank's error (None when every rank succeeded), the same on every rank."""
        if not self.distributed:
            return error
        errors = [None] * self.world_size
        dist.all_gather_object(errors, error, group=self.group)
        return next((e for e in errors if e), None)

    def _fail(self, pending: _Pending, error: str) -> None:
        """Remove a failed save's tmp dir (rank 0), keep `latest`, emit the event, raise on every rank."""
        if self.rank == 0:
            shutil.rmtree(pending.tmp, ignore_errors=True)
        self._last_saved_step = None
        self._refuse(pending.step, f"checkpoint save of update {pending.step} failed: {error}; its partial files "
                                   f"are removed", path=str(pending.tmp))

    def _refuse(self, step: int, message: str, **fields) -> None:
        latest = layout.read_latest(self.folder)
        message += f"; 'latest' stays on {latest}" if latest else "; no checkpoint of this run exists yet"
        if self.rank == 0:
            self.events.emit("checkpoint_failed", message, step=step, latest=latest, **fields)
        raise CheckpointSaveError(message)

    def wait(self) -> None:
        """Block until a pending async save is written, then commit it (all ranks call this)."""
        if self._pending is not None:
            self._finalize()

    def _all_done(self) -> bool:
        """Whether the pending async save has finished writing; rank 0's future decides (it finishes last)."""
        done = torch.tensor([int(self._pending.future.done())])
        if self.distributed:
            dist.broadcast(done, src=0, group=self.group)
        return bool(done.item())

    def _finalize(self) -> None:
        pending, self._pending = self._pending, None
        error, final = pending.error, None
        if error is None:
            try:
                if pending.future is not None:
                    pending.future.result()
                if self.rank == 0:
                    final = layout.commit(pending.tmp, pending.step)
            except (Exception, CheckpointException) as e:
                error = self._describe(e)
        error = self._agree(error)
        if error is not None:
            self._fail(pending, error)
        if self.rank != 0:
            return
        deleted = layout.apply_retention(self.folder, self.cfg.keep_latest_k)
        seconds = time.perf_counter() - pending.started
        size = sum(f.stat().st_size for f in final.iterdir() if f.is_file())
        self.events.emit(
            "checkpoint_saved",
            f"saved {final} ({size / 2**20:.1f} MiB, {self.cfg.async_mode}: blocked {pending.stage_seconds:.2f}s, "
            f"total {seconds:.2f}s)" + (f"; deleted steps {deleted}" if deleted else ""),
            step=pending.step, path=str(final), bytes=size, expected_bytes=pending.needed_bytes,
            mode=self.cfg.async_mode, blocking_seconds=pending.stage_seconds, seconds=seconds, deleted_steps=deleted,
        )

    def _agree_tmp_dir(self, step: int) -> Path:
        names = [layout.new_tmp_dir(self.folder, step).name]
        if self.distributed:
            dist.broadcast_object_list(names, src=0, group=self.group)
        return self.folder / names[0]

    def _stop_agreed(self) -> int:
        """The stop signal's number (0: none); one on any rank stops every rank after the same update."""
        signum = torch.tensor([self.stop.signum or 0])
        if self.distributed:
            dist.all_reduce(signum, op=dist.ReduceOp.MAX, group=self.group)
        return int(signum.item())

    def close(self) -> None:
        """Wait for and commit a pending save; restore the signal handlers."""
        try:
            self.wait()
        finally:
            self.stop.restore()
            if self._sealer is not None:
                self._sealer.shutdown()

    # ------------------------------------------------------------------ loading
    def load(self, plan: ResumePlan | None = None) -> int | None:
        """Resume from this run's checkpoint, else initialise the model from initial_load_path.

        plan: what check_resumable chose before the run directory was touched (the trainer passes it, so
        the files are hashed once); None chooses here. Returns the step resumed from, or None when the
        run starts fresh.
        """
        if plan is None:
            discarded = layout.remove_leftovers(self.folder) if self.rank == 0 else []
            self._barrier()
            plan = plan_start(self.cfg, self.folder, group=self.group)
            plan.discarded = discarded
            check_tokenizer(plan, self.meta.get("tokenizer", ""), self.meta.get("tokenizer_sha256", ""))
        if self.rank == 0:
            if plan.discarded:
                self.events.emit("checkpoint_discarded", f"removed {len(plan.discarded)} incomplete save(s) of an "
                                 f"interrupted run: {', '.join(plan.discarded)}", step=0, removed=plan.discarded)
            for note in plan.notes:
                self.events.emit("checkpoint_fallback", note, step=0, path=str(plan.path))
            if plan.unverified:
                self.events.emit("checkpoint_unverified", f"{plan.path} was saved before checkpoints carried "
                                 "checksums: loading it unverified", step=0, path=str(plan.path))
        if plan.path is None:
            return None
        if plan.initial:
            if plan.tokenizer_unchecked and self.rank == 0:
                self.events.emit("tokenizer_unchecked", plan.tokenizer_unchecked, step=0, path=str(plan.path))
            load_model_weights(self.model, plan.path, process_group=self.dcp_group)
            self.events.emit("initial_load", f"model weights initialised from {plan.path} (optimizer and data "
                             "start fresh)", step=0, path=str(plan.path))
            return None
        return self.load_from(plan.path)

    def load_from(self, path: Path) -> int:
        """Load the full training state of checkpoint dir `path` (all ranks)."""
        meta = json.loads((path / META_FILE).read_text())
        if meta.get("version") not in _READABLE_META_VERSIONS:
            raise ValueError(f"checkpoint {path}: {META_FILE} version {meta.get('version')!r}; this build reads "
                             f"{', '.join(map(str, _READABLE_META_VERSIONS))}")
        state = self._dcp_state()
        check_compatible(path, state)
        dcp.load(state, checkpoint_id=str(path), process_group=self.dcp_group, no_dist=not self.distributed)
        set_model_state_dict(self.model, state["model"])
        self.optimizers.load_state_dict(state["optim"])
        self.schedule.load_state_dict(meta["schedule"])
        try:
            self.train_state.load_state_dict(self._saved_train_state(path, meta))
        except ValueError as e:
            raise ValueError(f"checkpoint {path}: {e}") from None
        note = "; ".join(filter(None, (self._load_rng(path, meta), getattr(self.train_state.data, "resume_note", ""))))
        step = int(meta["step"])
        self._last_saved_step = step
        self.events.emit("resumed", f"resumed from {path} at update {step}" + (f"; {note}" if note else ""),
                         step=step, path=str(path), saved_world_size=meta["world_size"],
                         world_size=self.world_size)
        return step

    def _saved_train_state(self, path: Path, meta: dict) -> dict[str, Any]:
        """The TrainState of checkpoint `path` as this run takes it back: without the data position when the
        run restarts its data (restore_data False)."""
        train = dict(meta["train"])
        if not self.restore_data:
            train.pop(DATA_KEY, None)
        elif DATA_KEY not in train:
            # NOTE: checkpoints of meta.json version <= 2 kept the data position beside the RNG states, in every
            # rank-R.pt; it is the same on every rank, so rank 0's serves any world size.
            train[DATA_KEY] = torch.load(path / rank_file(0), weights_only=False)["loader"]
        return train

    def _load_rng(self, path: Path, meta: dict) -> str:
        """Restore this rank's saved RNG states, if it had any; returns the resharding note ("" on the same world)."""
        same_world = meta["world_size"] == self.world_size and meta["dp_world"] == self.dp_world
        own = path / rank_file(self.rank)
        if own.is_file():
            rng = torch.load(own, weights_only=False)["rng"]
            torch.set_rng_state(rng["torch_cpu"])
            random.setstate(rng["python"])
            if "torch_cuda" in rng and torch.cuda.is_available():
                torch.cuda.set_rng_state(rng["torch_cuda"])
        if same_world:
            return ""
        return (f"saved on {meta['world_size']} ranks (dp {meta['dp_world']}), loaded on {self.world_size} "
                f"(dp {self.dp_world}): model and optimizer resharded; data continues at the global position "
                f"(per-source token counts split evenly over the new ranks); ranks without a saved RNG state keep their seeded one")

    def _barrier(self) -> None:
        if self.distributed:
            dist.barrier(group=self.group)


# ---------------------------------------------------------------------- helpers
def build_checkpointer(trainer) -> CheckpointManager:
    """The trainer's CheckpointManager (reads the trainer's attributes; see Trainer.__init__)."""
    cfg = trainer.cfg
    meta = {"flavor": cfg.model.flavor, "model_args": asdict(trainer.args), "qb_eta": cfg.model.qb_eta,
            "tokenizer": getattr(trainer.tokenizer, "name", ""), "tokenizer_sha256": getattr(trainer.tokenizer, "sha256", "")}
    return CheckpointManager(
        cfg.checkpoint, trainer.run_dir / cfg.checkpoint.folder, model=trainer.model, optimizers=trainer.optimizers,
        schedule=trainer.schedule, train_state=trainer.state, meta=meta, events=trainer.events,
        rank=trainer.rank, world_size=trainer.world_size, dp_rank=trainer.dp_rank, dp_world=trainer.dp_world,
        restore_data=not cfg.training.fixed_batch, faults=CheckpointFaults.from_debug(cfg.debug),
    )

