"""The Trainer and `python -m titan_k3.train` (also under torchrun).

One update, as in docs/architecture.md §4: fetch grad_accum microbatches, count the valid
targets of the whole update (all microbatches, all data-parallel ranks),
backward each microbatch's summed loss divided by that count, clip by the
global grad norm, skip the update if anything is non-finite, step Muon and
AdamW, apply QK-Clip, advance the LR schedule, report.
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections import deque
from typing import Callable

if __name__ == "__main__" and {"-h", "--help"} & set(sys.argv[1:]):
    # NOTE: --help answers before torch and the model are imported (those imports take seconds, the help none).
    from titan_k3.config.manager import print_help

    sys.exit(print_help())

if __name__ == "__main__":
    # NOTE: a stop during the imports below ends the process as a stop before the first update does (main's
    # StopSignals take over from these handlers).
    from titan_k3.signals import exit_on_stop_signals

    exit_on_stop_signals()

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import get_error_handler

from kernels.device import host_to_device
from kernels.specializations import Precompile
from titan_k3.checkpoint import CheckpointSaveError, build_checkpointer, check_resumable, plan_resume
from titan_k3.config import ConfigError, JobConfig, load_job_config
from titan_k3.config.errors import toml_value
from titan_k3.config.manager import print_help
from titan_k3.config.check import (
    CONFIG_ERROR_EXIT, check_compile_cache, check_data, check_files, check_host, check_packages,
)
from titan_k3.config.validate import parse_context_stages, seq_len_at, warmup_updates
from titan_k3.data.budget import describe_run_data, report_lines, run_tokens
from titan_k3.data.loader import check_token_ids
from titan_k3.eval.runner import format_metrics
from titan_k3.gc_schedule import ScheduledGC
from titan_k3.metrics.clocks import TwoClocks, process_start_time
from titan_k3.metrics.events import EventLog
from titan_k3.invariants import InvariantRunner, InvariantViolationError
from titan_k3.job_errors import OutlivesItsReader, exit_on_config_error, first_to_report, report_error
from titan_k3.metrics.memory_peak import PeakRecorder, check_memory_peak
from titan_k3.metrics.profile import StepProfiler
from titan_k3.metrics.reporter import MetricsReporter
from titan_k3.metrics.run_dir import Tee, check_run_dir, prepare_run_dir, run_dir_path, run_dir_problem
from titan_k3.models.registry import get_model_spec
from titan_k3.optim import LRSchedule, ParamSpec, build_optimizers
from titan_k3.parallel import (
    CompileWatch, ParallelDims, grad_norm_and_clip_coef, init_weights, parallelize, precision_fallbacks, set_microbatch_sync,
    setup_distributed, sum_replicated_grads,
)
from titan_k3.parallel.faults import active_injections, check_injections, inject_replica_drift
from titan_k3.run_faults import RunFaults
from titan_k3.signals import EXIT_STATUS, StopNow, StopSignals
from titan_k3.spec import routed_experts
from titan_k3.step_graph import StepGraph, check_capturable, side_stream_choice
from titan_k3.train_state import TrainState
from titan_k3.trainer_setup import (
    build_evaluator, build_loader, expandable_segments_to_set, pick_device, resolve_kernels, saved_train_state,
    set_allocator, tokenizer_and_vocab,
)

IGNORE_INDEX = -100


class TrainingStopped(RuntimeError):
    """The run cannot continue (e.g. too many non-finite updates in a row); the message says why."""


class StepResult:
    """One update: its tokens at once; its loss, grad norm, valid tokens and skip read back from the device.

    NOTE: the values are copied to the host without waiting and read when first
    needed (`Trainer._settle`, in update order), so the host queues the optimizer
    and the next update while the GPU still runs this one's backward. Reading a
    value early waits for the copy; nothing is lost either way.
    """

    def __init__(self, step: int, n_tokens: int, settle: Callable[["StepResult"], None]):
        self.step, self.n_tokens = step, n_tokens
        self._settle = settle
        self._values: tuple[float, float, int, bool] | None = None

    def _read(self) -> tuple[float, float, int, bool]:
        if self._values is None:
            self._settle(self)
        return self._values

    loss = property(lambda self: self._read()[0], doc="Mean loss over the update's valid tokens.")
    grad_norm = property(lambda self: self._read()[1], doc="Global gradient norm before clipping.")
    n_valid = property(lambda self: self._read()[2], doc="Valid (non-ignored) target tokens over all ranks.")
    skipped = property(lambda self: self._read()[3], doc="Whether the update was skipped (non-finite loss or norm).")


def _copy_to_host(x: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """x on the host without waiting: (host tensor, the event after which it is valid, None if it already is)."""
    if x.device.type != "cuda":
        return x.cpu(), None
    host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
    host.copy_(x, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()
    return host, copied


def _state_field(name: str) -> property:
    """A Trainer attribute that is `self.state.<name>` (read and write)."""
    return property(lambda self: getattr(self.state, name), lambda self, value: setattr(self.state, name, value),
                    doc=f"TrainState.{name}")


class Trainer:
    def __init__(self, cfg: JobConfig, stop_signals: StopSignals | None = None):
        self.cfg = cfg
        # The entry point's stop signals (titan_k3/signals.py; None: the checkpointer's SIGTERM handler alone).
        self.stop_signals = stop_signals
        self.clocks = TwoClocks()
        self.startup_seconds = float("nan")  # set after this process's first update
        self._session_first: StepResult | None = None  # this session's first update (train())
        self.device = pick_device(cfg)
        set_allocator(cfg, self.device)
        # First, so that everything the run allocates is in the trace.
        self.memory_peak = PeakRecorder(cfg.profiling.memory_peak_updates, self.device)
        # First: our kernels compile in the background while everything below builds and dynamo traces.
        self.precompile = Precompile(self.device, cfg.kernels.precompile_threads).start() \
            if self.device.type == "cuda" and cfg.kernels.precompile_threads > 0 else None
        self.world_size = int(os.environ.get("WORLD_SIZE", 1))
        self.rank = int(os.environ.get("RANK", 0))
        t = cfg.training

        self.tokenizer, vocab = tokenizer_and_vocab(cfg)
        self.model_spec = get_model_spec(cfg.model.name)
        self.args = self.model_spec.args(cfg.model.flavor, vocab)
        self.dist = setup_distributed(cfg.parallelism, self.device, self.model_spec.routed_experts(self.args))
        check_run_dir(cfg)  # a dump folder or reused name this run must not write stops here, before the model
        self.dp_rank, self.dp_world, self.dp_group = self.dist.dp_rank, self.dist.dp_world, self.dist.dp_group
        check_injections(cfg.debug, self.dp_world)
        # debug.inject_same_data: the last data-parallel rank reads the first one's sequences.
        data_rank = 0 if cfg.debug.inject_same_data and self.dp_rank == self.dp_world - 1 else self.dp_rank
        self.loader = build_loader(cfg, self.tokenizer, data_rank, self.dp_world, cfg.data.prefetch)
        # Before the model: a task file that does not parse stops the run before any work.
        self.evaluator = build_evaluator(cfg, self.tokenizer, self.device, self.dp_rank, self.dp_world, self.dp_group)

        self.impl = resolve_kernels(cfg, self.model_spec, self.device, self.args, self.world_size)
        self._graph_choice = None
        if cfg.compile.cuda_graph:
            self._graph_choice = check_capturable(cfg, self.device, self.world_size, self.impl.choices,
                                                  self.model_spec.graph_inputs)
        torch.manual_seed(t.seed)
        with torch.device("meta"):
            model = self.model_spec.build(self.args, self.impl, cfg.model)
        self.impl.choices += parallelize(model, self.dist.dims, self.dist.mesh, cfg, self.device)
        if self._graph_choice is not None:
            self.impl.choices.append(self._graph_choice)
        stream_choice = side_stream_choice(cfg, self.device, self.world_size)
        if stream_choice is not None:
            self.impl.choices.append(stream_choice)
        model.to_empty(device=self.device)
        self._build_model = lambda: self.model_spec.build(self.args, self.impl, cfg.model)
        init_weights(model, self._build_model, t.seed, self.device)
        self.hooks = self.model_spec.step_hooks(model, cfg, self.device, self.dp_group)
        self.model = model.train()

        hints = model.optim_hints()
        o = cfg.optimizer
        self.optimizers = build_optimizers(
            model.named_parameters(), lambda name, _p: ParamSpec(**hints[name]),
            lr=o.lr, weight_decay=o.weight_decay, betas=(o.beta1, o.beta2), eps=o.eps,
            momentum=o.momentum, ns_steps=o.ns_steps, use_muon=o.name == "muon", ns_cuda_graphs=o.ns_cuda_graphs,
            momentum_dtype=getattr(torch, o.momentum_dtype),
            ns_chunk=o.ns_chunk, side_stream=stream_choice is not None and stream_choice.chosen == "on",
        )
        self.hooks.bind_optimizers(self.optimizers)
        s = cfg.lr_scheduler
        self.schedule = LRSchedule(
            self.optimizers, base_lr=o.lr, total_steps=t.steps, warmup_steps=warmup_updates(s, t.steps),
            decay_type=s.decay_type, decay_ratio=None if s.decay_ratio >= 1 else s.decay_ratio,
            min_lr_factor=s.min_lr_factor,
        )
        self.context_stages = parse_context_stages(t.context_stages) if t.context_stages else []
        self.state = TrainState(seq_len=t.seq_len, data=self.loader)
        self.flops_per_token = self.model_spec.flops_per_token(self.args, t.seq_len)
        self._unsettled: deque = deque()
        self._fixed = None

        resume = check_resumable(cfg, run_dir_path(cfg), model, self.optimizers)
        saved = saved_train_state(cfg, resume, self.loader)
        done_steps, done_tokens = (int(saved["step"]), int(saved["tokens_seen"])) if saved is not None else (0, 0)
        self.data = describe_run_data(self.loader.describe(), fixed_batch=t.fixed_batch, total_tokens=run_tokens(
            steps=t.steps, seq_len=t.seq_len, context_stages=t.context_stages, local_batch_size=t.local_batch_size,
            grad_accum=t.grad_accum, dp_world=self.dp_world, done_steps=done_steps, done_tokens=done_tokens))

        # Everything above can still refuse the job; only now does the run directory appear.
        self.run_dir = run_dir_path(cfg)
        self.reporter = MetricsReporter(cfg, rank=self.rank, device=self.device, flops_per_token=self.flops_per_token,
                                        n_devices=self.world_size, group=self.dp_group)
        if self.rank == 0:
            resume.discard_leftovers(self.run_dir / cfg.checkpoint.folder)  # first: a killed save may fill the disk
            prepare_run_dir(cfg, {
                "flavor": cfg.model.flavor, "vocab_size": vocab,
                "tokenizer": {"name": self.tokenizer.name, "sha256": self.tokenizer.sha256},
                "dataset": self.data,
                "kernels": [c.as_dict() for c in self.impl.choices],
            }, resuming=resume.path is not None and not resume.initial)
            self._stdout = sys.stdout
            sys.stdout = Tee(sys.stdout, self.run_dir / "stdout.log")
        self.events = EventLog(self.run_dir / "events.jsonl" if self.rank == 0 else None, echo=self.rank == 0)
        self.compile_watch = CompileWatch(self.events) if cfg.compile.enable else None
        self.step_graph = self._build_step_graph()
        self.reporter.start(self.run_dir, self.events)
        self.profiler = StepProfiler(cfg.profiling, self.run_dir, self.rank, self.events)
        self.invariants = InvariantRunner(cfg.invariants, self.events, group=self.dp_group, rank=self.rank, device=self.device,
                                          on_violation=self.reporter.violation,
                                          probe_rtol=0.1 if self._bf16_autocast else 1e-3,
                                          last_step=cfg.training.steps, clocks=self.clocks)
        self._report_start()
        self.checkpointer = build_checkpointer(self)
        if self.stop_signals is not None:
            self.stop_signals.install()  # back from the checkpointer's handler: ours hands it signals after update 1
        self.checkpointer.load(resume)
        self.reporter.expose_counters(self.step, self.tokens_seen, self.skipped_updates)
        self._use_seq_len(self.state.seq_len)  # a resumed run continues at its curriculum stage
        self._inject_faults()
        self.gc_schedule = ScheduledGC(t.gc_every)  # last: a failed start leaves Python's collector as it was
        self._built_at = time.time()

    def _build_step_graph(self) -> StepGraph | None:
        """The CUDA graph of each update's forward and backward (compile.cuda_graph), or None."""
        c = self.cfg.compile
        if self._graph_choice is None or self._graph_choice.fallback:
            return None
        graph = StepGraph(self.model, self._forward_backward, self.model_spec.graph_inputs, self.device,
                          max_documents=c.cuda_graph_max_documents, warmup=c.cuda_graph_warmup, emit=self.events.emit)
        if c.cuda_graph_share_pool:
            self.optimizers.optimizers["muon"].ns_graphs.join(graph.memory_pool)
        return graph

    def _stop_after_update(self, signum: int) -> None:
        """A stop signal after update 1: the checkpointer saves after the current update and the loop ends."""
        self.checkpointer.stop.signum = signum

    def close(self) -> None:
        """Stop the metric sinks and teeing stdout into the run directory; give Python its collector back, and the
        process its signal handlers (the checkpointer's graceful stop turns SIGTERM into a flag while it lives)."""
        if getattr(self, "checkpointer", None) is not None:
            # NOTE: train() closes the checkpointer when its loop ends; a trainer stepped from outside (a benchmark,
            # a test, a notebook) or stopped by an exception must not leave a process that SIGTERM no longer ends.
            # Only the handlers: a pending save's commit may wait on other ranks, which an error path must not.
            self.checkpointer.stop.restore()
        if getattr(self, "precompile", None) is not None:
            self.precompile.finish()  # a run ended before its first update leaves no compile threads or Triton hook
        if getattr(self, "gc_schedule", None) is not None:
            self.gc_schedule.close()
        self.reporter.close()
        if isinstance(sys.stdout, Tee) and getattr(self, "_stdout", None) is not None:
            sys.stdout.file.close()
            sys.stdout = self._stdout

    def _inject_faults(self) -> None:
        """Announce the [debug] fault injections that are on; apply the replica drift (after init or load)."""
        self.run_faults = RunFaults.from_debug(self.cfg.debug)
        on = {**active_injections(self.cfg.debug), **self.run_faults.active()}
        for key, value in on.items() if self.rank == 0 else ():
            self.events.emit("fault_injection", f"FAULT INJECTED: {key} = {toml_value(value)}", step=self.step, key=key,
                             value=value)
        drift = self.cfg.debug.inject_replica_drift
        if drift and self.dp_rank == self.dp_world - 1:
            moved = inject_replica_drift(self.model, drift)
            print(f"debug.inject_replica_drift: rank {self.rank} moved {len(moved)} replicated tensors by {drift:g}", flush=True)

    # ------------------------------------------------------------------ reporting
    def _report_start(self) -> None:
        if self.rank != 0:
            return
        spec = self.model_spec
        pc, card = spec.count_params(self.args), spec.count_params(spec.args(spec.card_flavor, 0))
        t = self.cfg.training
        print(f"titan_k3 | run {self.run_dir}")
        print(f"model {self.cfg.model.flavor}: {pc.total / 1e6:.2f}M total, {pc.active / 1e6:.2f}M active "
              f"({spec.card_flavor} card: {card.total / 1e9:.1f}B total, {card.active / 1e9:.1f}B active)")
        print(f"tokens per update = {t.local_batch_size} batch x {t.seq_len} seq x {t.grad_accum} accum x "
              f"{self.dp_world} dp = {self.tokens_per_update}")
        print(f"mesh: {self.dist.dims.describe()}" + (f" | {self.dist.mesh}" if self.dist.mesh is not None else
                                                       " (one process, no device mesh)"))
        data_line, data_warning = report_lines(self.data)
        print(data_line)
        if data_warning:
            self.events.emit("data_epochs", data_warning, step=0, epochs=self.data["epochs"],
                             dataset=self.data["dataset"], sha256=self.data["sha256"])
        print(f"optimizers: {self.optimizers.summary_line()}")
        self.reporter.report_kernels(self.impl.choices)

    def _log(self, result: StepResult, window: dict, evals: dict | None = None) -> None:
        # NOTE: the session's first update, logged or not, in every record: the overfit probe compares with the start.
        first = {"session_first_step": self._session_first.step, "session_first_loss": self._session_first.loss}
        violations = {"invariant_violations": self.invariants.total_violations,
                      "invariant_checked_updates": self.invariants.checked_updates,
                      **{f"invariant_violations/{check}": n for check, n in self.invariants.counts.items()}}
        self.reporter.log(
            step=self.step, loss=result.loss, grad_norm=result.grad_norm, lr=self._last_lr, tokens_seen=self.tokens_seen,
            skipped_updates=self.skipped_updates, clocks=self.clocks, window=window, routers=self.model.moe_routers(),
            source_tokens=getattr(self.loader, "source_tokens_total", None), extra={**first, **violations, **(evals or {})},
        )

    def _evaluate(self) -> dict:
        """Validation loss and task scores (titan_k3/eval/runner.py), on every rank, outside the training clock."""
        self.hooks.before_forward()
        evals = self.evaluator.run(self.model)
        if self.rank == 0:
            print(f"eval step {self.step} | {format_metrics(evals)}", flush=True)
        return evals

    # ------------------------------------------------------------------ the step
    def _next_batch(self):
        if self.cfg.training.fixed_batch:
            if self._fixed is None:
                self._fixed = check_token_ids(next(self.loader), self.args.vocab_size)
            return self._fixed
        return check_token_ids(next(self.loader), self.args.vocab_size)

    def _all_reduce(self, x: torch.Tensor, op=None) -> torch.Tensor:
        if self.dp_group is not None:
            dist.all_reduce(x, op=op or dist.ReduceOp.SUM, group=self.dp_group)
        return x

    @property
    def _bf16_autocast(self) -> bool:
        return self.device.type == "cuda" and self.cfg.training.compute_dtype == "bfloat16"

    def _autocast(self) -> torch.autocast:
        return torch.autocast("cuda", dtype=torch.bfloat16, enabled=self._bf16_autocast)

    def train_step(self) -> StepResult:
        cfg = self.cfg
        self.gc_schedule.before_update(self.step + 1)
        batches = [self._next_batch() for _ in range(cfg.training.grad_accum)]
        self.hooks.before_forward()
        self.invariants.probe(self.step + 1, batches[0], model=self.model, build_copy=self._build_model,
                              autocast=self._autocast)
        n_valid = host_to_device(sum((b.labels != IGNORE_INDEX).sum() for b in batches).float(), self.device)
        global_valid = self._all_reduce(n_valid.clone()).clamp(min=1)
        # debug.inject_grad_scale = 'local_normaliser': the loss divided by this rank's targets, not the update's.
        normaliser = n_valid.clamp(min=1) if cfg.debug.inject_grad_scale == "local_normaliser" else global_valid
        if self.step_graph is not None:
            loss_sum = self.step_graph.forward_backward(batches, normaliser, self.step + 1)
        else:
            loss_sum = self._forward_backward([self.model_spec.batch_inputs(b, self.device) for b in batches], normaliser)
        sum_replicated_grads(self.model, self.dp_group)
        loss_t = self._all_reduce(loss_sum) / global_valid
        params = [p for p in self.model.parameters() if p.grad is not None]
        logs = self.reporter.is_log_step(self.step + 1) or self.evaluator.due(self.step + 1, self.step + 1 == cfg.training.steps)
        if logs:  # an evaluation step is a log step too
            self.reporter.capture_grads(self.model.named_parameters())
        self.invariants.before_clip(self.step + 1, batches=batches, model=self.model, optimizers=self.optimizers,
                                    normaliser=normaliser, local_valid=n_valid, loader=self.loader,
                                    qk_clip_max_logits=self.hooks.qk_clip_max_logits)
        max_norm = cfg.training.max_norm if cfg.training.max_norm > 0 else float("inf")
        # NOTE: the clip coefficient rides on the optimizers' first read of each gradient (Optimizers.step),
        # not on a pass over every gradient of its own (2.2 ms of a k3-mini step).
        grad_norm_t, clip_coef = grad_norm_and_clip_coef(params, max_norm)
        # NOTE: no host sync in the step. A non-finite loss or norm skips the update on the device (the
        # optimizers leave parameters and state untouched); the host learns of it from an asynchronous
        # copy when the result settles, at the latest one update later (_settle).
        skip = ~(torch.isfinite(loss_t) & torch.isfinite(grad_norm_t))
        stats = torch.stack([loss_t, grad_norm_t.float(), global_valid])
        result = StepResult(self.step + 1, sum(b.input_ids.numel() for b in batches) * self.dp_world, self._settle)
        self._unsettled.append((result, *_copy_to_host(stats)))
        if self.invariants.pending:
            self.invariants.after_clip(result.grad_norm)  # reads the norm now: a violation can stop the update
        self._last_lr = self.optimizers.lr
        self.optimizers.step(skip_if=skip, grad_scale=clip_coef if cfg.training.max_norm > 0 else None)
        self.hooks.after_step(skip)  # the model's own work after the step (QK-Clip); a skipped update changes nothing
        self.optimizers.zero_grad(set_to_none=True)
        self.schedule.step()
        self._settle(wait=False)
        while len(self._unsettled) > 1:
            self._settle(self._unsettled[0][0])
        return result

    def _forward_backward(self, inputs: list[tuple], normaliser: torch.Tensor) -> torch.Tensor:
        """Forward and backward of each micro-batch (`inputs`: the model's arguments of each); the summed loss.

        Each micro-batch's summed loss is divided by `normaliser` (the update's valid targets) before its backward,
        so the gradients add up to those of the update's mean loss. A CUDA graph of the step records this pass.
        """
        defer_reduce = self.cfg.parallelism.fsdp_defer_grad_reduce and len(inputs) > 1
        loss_sum = torch.zeros((), device=self.device)
        for i, args in enumerate(inputs):
            if defer_reduce:
                set_microbatch_sync(self.model, last=i == len(inputs) - 1)
            with self._autocast():
                out = self.model(*args)
            (out.loss_sum / normaliser).backward()
            self.hooks.after_backward()  # the model's own work before the next micro-batch routes (QB)
            loss_sum += out.loss_sum.detach().float()
        return loss_sum

    def _settle(self, upto: StepResult | None = None, wait: bool = True) -> None:
        """Read back pending results in update order, through `upto` (None: all); wait=False: only landed copies.

        A skipped update is counted and reported here, with its own update number.
        """
        while self._unsettled:
            result, host, copied = self._unsettled[0]
            if not wait and copied is not None and not copied.query():
                return
            if copied is not None:
                copied.synchronize()
            self._unsettled.popleft()
            loss, grad_norm, n_valid = host.tolist()
            skipped = not (math.isfinite(loss) and math.isfinite(grad_norm))
            result._values = (loss, grad_norm, int(n_valid), skipped)
            if skipped:
                self.skipped_updates += 1
                self.skipped_in_row += 1
                self.events.emit("nonfinite", f"loss {loss} / grad norm {grad_norm}: update skipped", step=result.step)
            else:
                self.skipped_in_row = 0
            if result is upto:
                return

    def _enter_context_stage(self, update: int) -> None:
        """Switch to the curriculum's sequence length for `update`; the loader keeps its exact token position."""
        seq = seq_len_at(update, self.cfg.training.seq_len, self.context_stages)
        if seq == self.state.seq_len:
            return
        self.loader.set_seq_len(seq)
        self._use_seq_len(seq)
        self.events.emit("context_stage", f"sequence length {seq} from update {update} "
                         f"({self.tokens_per_update} tokens per update)", step=update, seq_len=seq)

    def _use_seq_len(self, seq: int) -> None:
        """Make `seq` the current sequence length (TrainState) and update what derives from it."""
        self.state.seq_len = seq
        self.flops_per_token = self.reporter.flops_per_token = self.model_spec.flops_per_token(self.args, seq)

    @property
    def tokens_per_update(self) -> int:
        t = self.cfg.training
        return t.local_batch_size * self.state.seq_len * t.grad_accum * self.dp_world

    # Where the run is lives in `self.state` (a TrainState, what the checkpointer saves and restores); the
    # trainer reads and writes these counters through it.
    step = _state_field("step")
    tokens_seen = _state_field("tokens_seen")
    skipped_updates = _state_field("skipped_updates")
    skipped_in_row = _state_field("skipped_in_row")

    def train(self) -> list[StepResult]:
        cfg = self.cfg
        results: list[StepResult] = []
        window = {"tokens": 0, "training_seconds": 0.0, "data_wait": 0.0}
        while self.step < cfg.training.steps:
            self._enter_context_stage(self.step + 1)
            wait0 = getattr(self.loader, "wait_seconds", 0.0)
            t0 = self.clocks.training_seconds
            self.profiler.before(self.step + 1)
            with self.clocks.training():
                result = self.train_step()
                if self._window_ends(self.step + 1):
                    # NOTE: between window ends the host runs ahead into the next step while the GPU
                    # finishes this one's optimizer; a window's training clock stops once its work is done.
                    if self.device.type == "cuda":
                        torch.cuda.synchronize()
                    self._settle()
            if not results and self.stop_signals is not None:
                self.stop_signals.check()  # a stop during the first update whose StopNow library code swallowed
            self.step += 1
            if not results:
                if self.stop_signals is not None:
                    self.stop_signals.hand_over(self._stop_after_update)  # an update to save exists from now on
                self._report_startup()
                self._session_first = result
            self.profiler.after(self.step)
            self.memory_peak.after(self.step, self.run_dir, self.rank, self.events)
            self.tokens_seen += result.n_tokens
            self.clocks.add_tokens(result.n_tokens)
            window["tokens"] += result.n_tokens
            window["training_seconds"] += self.clocks.training_seconds - t0
            window["data_wait"] += getattr(self.loader, "wait_seconds", 0.0) - wait0
            results.append(result)
            if self.compile_watch is not None:
                self.compile_watch.check(self.step)
            if self.skipped_in_row >= cfg.training.max_skipped_in_row:
                message = (f"{self.skipped_in_row} updates in a row had a non-finite loss or grad norm "
                           f"(limit training.max_skipped_in_row = {cfg.training.max_skipped_in_row}); stopping")
                self.events.emit("stopped", message, step=self.step)
                raise TrainingStopped(message)
            last = self.step == cfg.training.steps
            # An evaluation step is always a log step: its metrics go into that step's metrics.jsonl record.
            evals = self._evaluate() if self.evaluator.due(self.step, last) else None
            if evals is not None or self.step % cfg.metrics.log_freq == 0 or last:
                self._log(result, window, evals)
                window = {"tokens": 0, "training_seconds": 0.0, "data_wait": 0.0}
            if self.checkpointer.after_step(self.step, last=self.step == cfg.training.steps):
                break  # a stop signal: the update is finished and saved
            self.run_faults.after_update(self.step)
        self.checkpointer.close()
        return results

    def _report_startup(self) -> None:
        """Seconds from this process's start (interpreter, imports, build, compile, first autotuning) to the end of
        its first update, GPU work included: the reporter's "startup" event and gauge, `startup_seconds` here."""
        if self.device.type == "cuda":
            torch.cuda.synchronize()  # once: the first update's GPU work counts
        now, start = time.time(), process_start_time()
        since, origin = (now - start, "process start") if start else (self.clocks.session_seconds, "trainer start")
        first = now - self._built_at  # compilation, autotuning and the update itself
        self.startup_seconds = since
        self.reporter.report_startup(self.step, since - first, first, origin)
        if self.precompile is not None:
            report = self.precompile.finish()  # every rank waits for its compiles
            if self.rank == 0:
                self.events.emit("precompile", report, step=self.step)

    def _violations_line(self, updates: int) -> str:
        """The summary's invariants line; `updates`: how many this session ran."""
        inv = self.invariants
        if not self.cfg.invariants.enable:
            return "invariant checks off (invariants.enable = false)"
        every = self.cfg.invariants.interval
        if not inv.checked_updates:
            return f"invariant checks: none ran (every {every} updates and the last; this session ran {updates})"
        named = ", ".join(f"{check} {n}" for check, n in inv.counts.items() if n)
        return f"invariant violations: {inv.total_violations}" + (f" ({named})" if named else "") + \
            f" in {inv.checked_updates} checked update(s) (every {every} updates and the last)"

    def _window_ends(self, step: int) -> bool:
        """Whether anything reads the clocks or the device state after update `step` (log, eval, checkpoint, end)."""
        cfg = self.cfg
        last = step == cfg.training.steps
        saves = cfg.checkpoint.enable and step % cfg.checkpoint.interval == 0
        return last or saves or step % cfg.metrics.log_freq == 0 or self.evaluator.due(step, last)

    def summary(self, results: list[StepResult]) -> str:
        c = self.clocks
        done = [r for r in results if not r.skipped]
        first, last = (done[0].loss, done[-1].loss) if done else (float("nan"), float("nan"))
        if not results:  # a resume at or past training.steps: no loss, clock or start-up to report
            session = [f"nothing to train: the run is at update {self.step} and training.steps = "
                       f"{self.cfg.training.steps} (raise training.steps to train on)"]
        else:
            session = [
                f"loss first {first:.4f} -> last {last:.4f}",
                f"tokens/update {self.tokens_per_update:,} | tokens seen {self.tokens_seen:,} "
                f"({c.session_tokens:,} in this session)",
                f"startup {self.startup_seconds:.1f} s to the end of the first update | this session's tokens/s: "
                f"training clock {c.session_tokens / max(c.training_seconds, 1e-9):,.0f} | "
                f"session clock {c.session_tokens / max(c.session_seconds, 1e-9):,.0f}",
            ]
        return "\n".join([
            "-" * 72,
            f"run {self.run_dir}  ({self.step} updates, {self.skipped_updates} skipped)",
            *session,
            self._violations_line(len(results)),
            f"files: {self.run_dir}/metrics.jsonl, events.jsonl, stdout.log, manifest.json, config.toml",
            "-" * 72,
        ])


def main(argv: list[str] | None = None, *, own_process: bool = False) -> int:
    """Exit status: 0 done (or stopped by SIGTERM), 1 stopped by the run's own checks, 130 stopped by SIGINT, 129
    by SIGHUP, CONFIG_ERROR_EXIT bad input; a stop signal saves first (titan_k3/signals.py).

    own_process: the process is the trainer's (the command line): a stop during start-up that a rank waiting in
    C++ code (a rendezvous, a collective) cannot act on ends the process (StopSignals' watchdog), and stdout and
    stderr outlive their readers (OutlivesItsReader).
    """
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        return print_help()
    if own_process:
        sys.stdout, sys.stderr = OutlivesItsReader(sys.stdout), OutlivesItsReader(sys.stderr)
    stop = StopSignals(watchdog=own_process)
    try:
        return _main(argv, stop, own_process)
    except StopNow as e:  # during start-up: no trainer yet
        stop.announce(e.signum)
        return EXIT_STATUS[e.signum]
    except Exception as e:
        # A bug, not a refusal: torchrun's failure summary shows its traceback (TORCHELASTIC_ERROR_FILE; nothing
        # outside torchrun). As torch's own @record does, which main's status codes rule out.
        get_error_handler().record_exception(e)
        raise
    finally:
        stop.restore()


def _validate_only(cfg: JobConfig) -> None:
    """--job.validate_only: the host checks, and the trainer's own that need no model, each by the function the run
    calls: the device, the memory-peak trace, the tokenizer's vocabulary, job.strict against the kernels', the CUDA
    graph's, the side stream's, FP8's and bf16's fallbacks, the mesh against this launch's world size (WORLD_SIZE, 1
    outside torchrun) and the fault injections it allows, the evaluator (task files, batch, validation split), the
    run directory, and the checkpoint the run would start from (its checksums and its data position against this
    run's seed, dataset and batch; not its shapes: those need the model)."""
    check_host(cfg)
    device = pick_device(cfg)
    expandable_segments_to_set(cfg, device)  # PYTORCH_CUDA_ALLOC_CONF against it
    check_memory_peak(cfg.profiling.memory_peak_updates, device)
    tokenizer, vocab = tokenizer_and_vocab(cfg)
    spec = get_model_spec(cfg.model.name)
    world = int(os.environ.get("WORLD_SIZE", 1))
    impl = resolve_kernels(cfg, spec, device, spec.args(cfg.model.flavor, vocab), world)
    if cfg.compile.cuda_graph:  # what the config chose against a capture, and job.strict against its fallback
        check_capturable(cfg, device, world, impl.choices, spec.graph_inputs)
    side_stream_choice(cfg, device, world)  # job.strict against its fallback
    precision_fallbacks(cfg, device, sharded=world > 1)  # job.strict against FP8's and bf16's
    dims = ParallelDims.from_config(cfg.parallelism, world, routed_experts(cfg.model.name, cfg.model.flavor))
    check_injections(cfg.debug, dims.dp)
    build_evaluator(cfg, tokenizer, device, dp_world=dims.dp)
    problem = run_dir_problem(cfg)  # a reused name or a dump folder the run would refuse at its start
    if problem:
        raise ConfigError(problem)
    resume = plan_resume(cfg, run_dir_path(cfg))  # the checkpoint it would start from, checked as the run checks it
    saved_train_state(cfg, resume, build_loader(cfg, tokenizer, 0, dims.dp, prefetch=0))  # and its data position


def _main(argv: list[str], stop: StopSignals, own_process: bool = False) -> int:
    try:
        cfg = load_job_config(argv)
        if cfg.job.validate_only:
            _validate_only(cfg)
            if first_to_report("config ok"):
                print("config ok")
            return 0
        # NOTE: the refusals --job.validate_only and the control service give, each naming its key (the metrics
        # port is the exporter's own to bind).
        check_packages(cfg)
        check_files(cfg)
        check_data(cfg)
        check_compile_cache(cfg)
        trainer = Trainer(cfg, stop)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        if own_process:
            exit_on_config_error(e)
        report_error(e)
        return CONFIG_ERROR_EXIT  # the control service does not retry it
    try:
        results = trainer.train()
        if trainer.rank == 0:
            print(trainer.summary(results))
    except (TrainingStopped, InvariantViolationError, CheckpointSaveError) as e:
        report_error(e)
        return 1
    except StopNow as e:
        where = f"checkpoint update {trainer.step}" if trainer.step else "the start"
        stop.announce(e.signum, lambda: trainer.events.emit(
            "stopped", f"{e} before this session's first update finished: stopping now, nothing new to save (the "
            f"next start resumes from {where})", step=trainer.step))
        return EXIT_STATUS[e.signum]
    finally:
        trainer.close()
    if dist.is_initialized():
        # NOTE: ranks leave together: one tearing the group down while a peer still talks can abort the peer.
        dist.barrier()
        dist.destroy_process_group()
    return EXIT_STATUS[stop.signum] if stop.signum else 0


if __name__ == "__main__":
    sys.exit(main(own_process=True))
