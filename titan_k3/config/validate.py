"""Checks on a whole JobConfig: ranges and combinations of keys.

Each failure is a ConfigError whose one line names the key, the value and
what is allowed. Torch-free; the degrees against a world size are
`resolve_degrees`, which the trainer (parallel/dims.py) calls under torchrun.
"""

from __future__ import annotations

import difflib
import fnmatch
import math
from pathlib import PurePosixPath

from titan_k3.config.errors import ConfigError, toml_value
from titan_k3.config.job_config import JobConfig
from titan_k3.config.run_files import RUN_DIR_NAMES
from titan_k3.spec import KDA_CHUNK, MODEL_FLAVORS, experts_per_token, routed_experts


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _positive(key: str, value: float) -> None:
    _require(value > 0, f"config key '{key}' = {toml_value(value)}: must be > 0")


def _non_negative(key: str, value: float) -> None:
    _require(value >= 0, f"config key '{key}' = {toml_value(value)}: must be >= 0")


def _one_of(key: str, value: str, allowed: list[str]) -> None:
    if value not in allowed:
        close = difflib.get_close_matches(value, allowed, n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        _require(False, f"config key '{key}' = {toml_value(value)}: expected one of {', '.join(map(toml_value, allowed))}{hint}")


def check_run_name(name: str) -> None:
    """job.name becomes one directory inside job.dump_folder: refuse a name that is a path or leaves the folder."""
    bad = name in (".", "..") or "/" in name or "\\" in name or any(ord(c) < 32 for c in name) or name != name.strip()
    _require(not bad, f"config key 'job.name' = {toml_value(name)}: must be a plain directory name inside job.dump_folder "
                      "(no '/', '\\', '..', control characters or surrounding spaces)")


def parse_context_stages(spec: str) -> list[tuple[int, int]]:
    """'update:seq_len,...' -> [(update, seq_len)], or ConfigError naming the bad part."""
    stages = []
    for part in spec.split(","):
        start, _, seq = part.partition(":")
        try:
            stages.append((int(start), int(seq)))
        except ValueError:
            _require(False, f"config key 'training.context_stages' = {toml_value(spec)}: expected 'update:seq_len,...' (bad part {toml_value(part)})")
        _require(stages[-1][1] > 0, f"config key 'training.context_stages' = {toml_value(spec)}: seq_len must be > 0")
    return stages


def parse_mixture(spec: str) -> dict[str, float] | None:
    """'name:weight,...' -> {name: weight} (None for ''), or ConfigError naming the bad part."""
    if not spec:
        return None
    weights = {}
    for part in spec.split(","):
        name, _, weight = part.partition(":")
        try:
            ok = bool(name.strip()) and math.isfinite(float(weight)) and float(weight) >= 0
        except ValueError:
            ok = False
        _require(ok, f"config key 'data.mixture' = {toml_value(spec)}: expected 'name:weight,...' with weights >= 0, 0 excluding "
                     f"a source (bad part {toml_value(part)})")
        weights[name.strip()] = float(weight)
    _require(sum(weights.values()) > 0, f"config key 'data.mixture' = {toml_value(spec)}: every weight is 0; give one source more")
    return weights


def seq_len_at(update: int, base_seq_len: int, stages: list[tuple[int, int]]) -> int:
    """Sequence length of update number `update` (1-based) under the context curriculum."""
    seq = base_seq_len
    for start, stage_seq in stages:
        if update >= start:
            seq = stage_seq
    return seq


def resolve_degrees(parallelism, world_size: int, n_experts: int) -> tuple[int, int, int]:
    """(replicate, shard, ep) of the [parallelism] section `parallelism` on `world_size` ranks, shard -1 resolved;
    a degree that does not fit is a one-line ConfigError naming its key.

    NOTE: torch-free, so that a launcher that knows the world size before the run (the control service) refuses a
    layout with the line the run's ranks would print.
    """
    rep, shard, ep = (parallelism.data_parallel_replicate_degree, parallelism.data_parallel_shard_degree,
                      parallelism.expert_parallel_degree)
    _require(rep >= 1 and world_size % rep == 0,
             f"config key 'parallelism.data_parallel_replicate_degree' = {rep}: must divide the world size {world_size}")
    if shard == -1:
        shard = world_size // rep
    _require(shard >= 1 and rep * shard == world_size,
             f"config key 'parallelism.data_parallel_shard_degree' = {shard}: replicate {rep} x shard {shard} must equal "
             f"the world size {world_size} (use -1 for the rest)")
    replicas = f" (EP splits the experts over the shard ranks, not over the {rep} replicas)" if rep > 1 else ""
    _require(ep >= 1 and shard % ep == 0,
             f"config key 'parallelism.expert_parallel_degree' = {ep}: must divide the data-parallel shard degree "
             f"{shard}{replicas}")
    _require(n_experts % ep == 0,
             f"config key 'parallelism.expert_parallel_degree' = {ep}: must divide the number of experts {n_experts}")
    return rep, shard, ep


DEFAULT_WARMUP_STEPS = 2


def warmup_updates(s, steps: int) -> int:
    """Updates of linear warmup of a run of `steps` updates under the [lr_scheduler] section `s`.

    warmup_fraction > 0: round(fraction x steps), at least 1 and below `steps`
    (none in a one-update run); else warmup_steps when set (>= 0); else
    DEFAULT_WARMUP_STEPS, below `steps`.
    """
    if s.warmup_fraction > 0:
        return min(max(1, round(s.warmup_fraction * steps)), steps - 1)
    if s.warmup_steps >= 0:
        return s.warmup_steps
    return min(DEFAULT_WARMUP_STEPS, steps - 1)


def _check_warmup(s, steps: int) -> None:
    f = s.warmup_fraction
    _require(math.isfinite(f) and 0 <= f < 1,
             f"config key 'lr_scheduler.warmup_fraction' = {toml_value(f)}: must be in [0, 1) (0: unset, warmup_steps applies)")
    _require(s.warmup_steps >= -1, f"config key 'lr_scheduler.warmup_steps' = {s.warmup_steps}: must be >= 0 (or -1: unset)")
    _require(
        not (f > 0 and s.warmup_steps >= 0),
        f"config keys 'lr_scheduler.warmup_steps' = {s.warmup_steps} and 'lr_scheduler.warmup_fraction' = {toml_value(f)} are both "
        "set: give one (warmup_steps = -1 or warmup_fraction = 0 unsets it)",
    )
    _require(
        s.warmup_steps < steps,
        f"config key 'lr_scheduler.warmup_steps' = {s.warmup_steps}: must be below training.steps = {steps}; pass "
        f"--lr_scheduler.warmup_steps N with N < {steps}, or --lr_scheduler.warmup_steps -1 "
        "--lr_scheduler.warmup_fraction F to warm up for a fraction F of the run",
    )


def _check_routing(model: str, flavor: str) -> None:
    """A flavor's top_k leaves an expert out: the router ranks the top_k + 1 largest scores of a token and Quantile
    Balancing measures its margins from the (top_k + 1)-th (docs/k3.md §2.3, §5).
    NOTE: K3Args refuses it too (models/k3/args.py:shape_problem), with every other shape; config imports no model
    (docs/architecture.md §3), so this check, which reads the table alone, stays here for the torch-free checker."""
    k, n = experts_per_token(model, flavor), routed_experts(model, flavor)
    _require(1 <= k < n, f"config key 'model.flavor' = {toml_value(flavor)}: its top_k = {k} (titan_k3/spec.py) must be "
                         f"in 1..{n - 1}, below its n_experts = {n}: routing ranks the top_k + 1 largest scores and "
                         "Quantile Balancing measures its margins from the (top_k + 1)-th")


def _check_decay(s, steps: int) -> None:
    """decay_ratio < 1 (WSD): the run's LR schedule decays over the last round(decay_ratio x steps) updates, at least
    one and none of them in the warmup (titan_k3/optim/lr_schedule.py)."""
    r = s.decay_ratio
    if r >= 1:  # decay right after warmup
        return
    decay, warmup = round(r * steps), warmup_updates(s, steps)
    _require(decay >= 1, f"config key 'lr_scheduler.decay_ratio' = {toml_value(r)}: must be above {0.5 / steps:g} with "
                         f"training.steps = {steps} (round({toml_value(r)} x {steps}) = 0 decay updates)")
    _require(
        warmup + decay <= steps,
        f"config key 'lr_scheduler.decay_ratio' = {toml_value(r)}: its {decay} decay updates and the {warmup} warmup "
        f"updates exceed training.steps = {steps}; lower it to at most {(steps - warmup) / steps:g} or shorten the warmup",
    )


def validate(cfg: JobConfig, needs_data: bool = True) -> None:
    """ConfigError on the first mistake in `cfg`; needs_data=False: an empty data.dataset is accepted."""
    t, o, s, p = cfg.training, cfg.optimizer, cfg.lr_scheduler, cfg.parallelism
    _one_of("model.name", cfg.model.name, list(MODEL_FLAVORS))
    _one_of("model.flavor", cfg.model.flavor, list(MODEL_FLAVORS[cfg.model.name]))
    _check_routing(cfg.model.name, cfg.model.flavor)
    _non_negative("model.vocab_size", cfg.model.vocab_size)
    _non_negative("model.qb_eta", cfg.model.qb_eta)
    for key in ("steps", "seq_len", "local_batch_size", "grad_accum", "max_skipped_in_row"):
        _positive(f"training.{key}", getattr(t, key))
    _non_negative("training.max_norm", t.max_norm)
    _non_negative("training.seed", t.seed)
    _non_negative("kernels.precompile_threads", cfg.kernels.precompile_threads)
    _non_negative("kernels.loss_chunk_rows", cfg.kernels.loss_chunk_rows)
    _require(not (cfg.kernels.loss_one_pass and cfg.kernels.loss_grad_fp8),
             "config keys 'kernels.loss_one_pass' and 'kernels.loss_grad_fp8' are both true: they are two ways to "
             "write the loss's gradient; set one of them")
    if cfg.kernels.expert_weight_shadows:
        _require(not cfg.kernels.experts_cast_in_kernel,
                 "config keys 'kernels.expert_weight_shadows' and 'kernels.experts_cast_in_kernel' are both true: they "
                 "are two ways to skip the experts' cast pass; set one of them")
        _require(o.name == "muon", f"config key 'kernels.expert_weight_shadows' = true: needs optimizer.name = 'muon' "
                                   f"(Per-Head Muon's update pass writes the shadows); got {toml_value(o.name)}")
        _require(t.compute_dtype != "float32",
                 "config key 'kernels.expert_weight_shadows' = true: needs training.compute_dtype = 'bfloat16' "
                 "(with float32 compute the experts read their masters and there is nothing to cast)")
    if cfg.kernels.kda != "torch":
        _require(
            t.seq_len % KDA_CHUNK == 0,
            f"config key 'training.seq_len' = {t.seq_len}: must be a multiple of the KDA chunk size {KDA_CHUNK} "
            f"when kernels.kda = {toml_value(cfg.kernels.kda)} (nearest: {max(KDA_CHUNK, round(t.seq_len / KDA_CHUNK) * KDA_CHUNK)})",
        )
    if t.context_stages:
        stages = parse_context_stages(t.context_stages)
        starts = [start for start, _ in stages]
        _require(
            starts == sorted(set(starts)) and 1 < starts[0] and starts[-1] <= t.steps,
            f"config key 'training.context_stages' = {toml_value(t.context_stages)}: updates must increase, within 2..training.steps = {t.steps}",
        )
        for _, seq in stages:
            _require(
                cfg.kernels.kda == "torch" or seq % KDA_CHUNK == 0,
                f"config key 'training.context_stages' = {toml_value(t.context_stages)}: seq_len {seq} is not a multiple of the KDA chunk size {KDA_CHUNK}",
            )
    _non_negative("profiling.memory_peak_updates", cfg.profiling.memory_peak_updates)
    _require(cfg.profiling.memory_peak_updates <= t.steps,
             f"config key 'profiling.memory_peak_updates' = {cfg.profiling.memory_peak_updates}: must be at most "
             f"training.steps = {t.steps}")
    if cfg.profiling.enable:
        _positive("profiling.start_step", cfg.profiling.start_step)
        _positive("profiling.steps", cfg.profiling.steps)
        last = cfg.profiling.start_step + cfg.profiling.steps - 1
        _require(last <= t.steps, f"config key 'profiling.start_step' = {cfg.profiling.start_step}: profiling updates "
                                  f"{cfg.profiling.start_step}-{last} must end by training.steps = {t.steps}")
    _positive("optimizer.lr", o.lr)
    _non_negative("optimizer.weight_decay", o.weight_decay)
    for key in ("beta1", "beta2", "momentum"):
        value = getattr(o, key)
        _require(0 <= value < 1, f"config key 'optimizer.{key}' = {toml_value(value)}: must be in [0, 1)")
    _positive("optimizer.eps", o.eps)
    _positive("optimizer.ns_steps", o.ns_steps)
    _non_negative("optimizer.ns_chunk", o.ns_chunk)
    _non_negative("optimizer.qk_clip_tau", o.qk_clip_tau)
    _check_warmup(s, t.steps)
    _require(0 < s.decay_ratio <= 1, f"config key 'lr_scheduler.decay_ratio' = {toml_value(s.decay_ratio)}: must be in (0, 1]")
    _check_decay(s, t.steps)
    _require(0 <= s.min_lr_factor <= 1, f"config key 'lr_scheduler.min_lr_factor' = {toml_value(s.min_lr_factor)}: must be in [0, 1]")
    _positive("parallelism.data_parallel_replicate_degree", p.data_parallel_replicate_degree)
    _require(
        p.data_parallel_shard_degree == -1 or p.data_parallel_shard_degree >= 1,
        f"config key 'parallelism.data_parallel_shard_degree' = {p.data_parallel_shard_degree}: must be -1 (the rest of the world) or >= 1",
    )
    _positive("parallelism.expert_parallel_degree", p.expert_parallel_degree)
    n_experts = routed_experts(cfg.model.name, cfg.model.flavor)
    _require(
        n_experts % p.expert_parallel_degree == 0,
        f"config key 'parallelism.expert_parallel_degree' = {p.expert_parallel_degree}: must divide the "
        f"{n_experts} experts of flavor {toml_value(cfg.model.flavor)}",
    )
    _require(
        p.expert_parallel_degree == 1 or p.expert_dispatch != "all_gather" or cfg.kernels.experts != "grouped_mm",
        "config key 'parallelism.expert_dispatch' = 'all_gather' with kernels.experts = 'grouped_mm': torch._grouped_mm "
        "leaves the rows of other ranks' experts unwritten; use kernels.experts = 'triton' or expert_dispatch = 'all_to_all'",
    )
    _positive("checkpoint.interval", cfg.checkpoint.interval)
    check_run_name(cfg.job.name)
    folder = cfg.checkpoint.folder
    _require(bool(folder) and not folder.startswith(("/", "\\")) and ".." not in folder.replace("\\", "/").split("/"),
             f"config key 'checkpoint.folder' = {toml_value(folder)}: must be a relative path inside the run directory (no '..')")
    top = next(iter(PurePosixPath(folder.replace("\\", "/")).parts), "")
    _require(not any(fnmatch.fnmatchcase(top, name) for name in RUN_DIR_NAMES),
             f"config key 'checkpoint.folder' = {toml_value(folder)}: {toml_value(top)} is a file or folder the run "
             "writes at the top of its run directory; name another folder (default 'checkpoints')")
    for key in ("crash_at_step", "kill_in_save_at_step", "checkpoint_write_error_at_step"):
        # NOTE: a fault at an update the run never makes (0, past training.steps, below -1) was taken, announced
        # when >= 0, and never fired: the test it was for passed or waited on nothing.
        step = getattr(cfg.debug, key)
        _require(step == -1 or 1 <= step <= t.steps,
                 f"config key 'debug.{key}' = {step}: must be -1 (off) or an update in 1..training.steps = {t.steps}")
    c = cfg.checkpoint
    for key in ("kill_in_save_at_step", "checkpoint_write_error_at_step"):
        # NOTE: refused only where no update saves: with checkpoint.enable or save_on_stop a stop signal saves after
        # whichever update it ends (CheckpointManager.after_step), so any update may save and the fault may fire.
        step = getattr(cfg.debug, key)
        _require(step == -1 or c.enable or c.save_on_stop,
                 f"config key 'debug.{key}' = {step}: no update saves with checkpoint.enable = false and "
                 f"checkpoint.save_on_stop = false, so the fault never fires; set checkpoint.enable = true (saves at "
                 f"multiples of checkpoint.interval = {c.interval} and the last update {t.steps}), or -1 (off)")
    _require(cfg.debug.checkpoint_free_bytes >= -1,
             f"config key 'debug.checkpoint_free_bytes' = {cfg.debug.checkpoint_free_bytes}: must be -1 (off) or >= 0")
    _non_negative("checkpoint.keep_latest_k", cfg.checkpoint.keep_latest_k)
    _non_negative("training.gc_every", cfg.training.gc_every)
    _require(
        cfg.checkpoint.load_step >= -1,
        f"config key 'checkpoint.load_step' = {cfg.checkpoint.load_step}: must be -1 (latest) or a saved step",
    )
    _require(
        cfg.checkpoint.load_step == -1 or cfg.checkpoint.enable or cfg.checkpoint.save_on_stop,
        f"config key 'checkpoint.load_step' = {cfg.checkpoint.load_step}: no checkpoint is read with checkpoint.enable "
        "= false and checkpoint.save_on_stop = false; enable one of them, or set load_step to -1",
    )
    _positive("metrics.log_freq", cfg.metrics.log_freq)
    _require(
        cfg.metrics.prometheus_port == 0 or 1024 <= cfg.metrics.prometheus_port <= 65535,
        f"config key 'metrics.prometheus_port' = {cfg.metrics.prometheus_port}: must be 0 (off) or in 1024..65535",
    )
    _non_negative("metrics.peak_tflops", cfg.metrics.peak_tflops)
    _require(
        0 < cfg.metrics.collapse_dead_fraction <= 1,
        f"config key 'metrics.collapse_dead_fraction' = {toml_value(cfg.metrics.collapse_dead_fraction)}: must be in (0, 1]",
    )
    _positive("metrics.collapse_patience", cfg.metrics.collapse_patience)
    _positive("invariants.interval", cfg.invariants.interval)
    _non_negative("eval.interval", cfg.eval.interval)
    _positive("eval.steps", cfg.eval.steps)
    _positive("eval.batch_size", cfg.eval.batch_size)
    _non_negative("data.prefetch", cfg.data.prefetch)
    _require(
        bool(cfg.data.dataset) or not needs_data,
        "config key 'data.dataset' is empty: this recipe trains on a prepared dataset, not the embedded probe corpus; "
        "build one with `python -m titan_k3.data.prepare --source NAME=PATH --output DIR` (or --config with a TOML like "
        "the example in titan_k3/data/prepare/config.py) and pass --data.dataset DIR",
    )
    parse_mixture(cfg.data.mixture)
    _require(
        not (cfg.kernels.attention == "flex" and cfg.compile.enable and cfg.compile.backend != "inductor"),
        f"config key 'kernels.attention' = 'flex' with compile.backend = '{cfg.compile.backend}': inside a compiled "
        "sublayer flex_attention is fused by inductor only (another backend runs its unfused reference, the whole "
        "score matrix); use compile.backend = 'inductor' or another kernels.attention",
    )
    _require(
        not (cfg.kernels.attention == "flex" and t.compute_dtype != "bfloat16"),
        "config key 'kernels.attention' = 'flex': needs training.compute_dtype = 'bfloat16' "
        "(flex_attention's tiles for MLA's 192-wide heads do not fit float32 in shared memory)",
    )
    _require(
        not (cfg.kernels.attention == "varlen" and t.compute_dtype != "bfloat16"),
        "config key 'kernels.attention' = 'varlen': needs training.compute_dtype = 'bfloat16' "
        "(flash attention computes in 16-bit floats only)",
    )
    _non_negative("compile.cuda_graph_max_documents", cfg.compile.cuda_graph_max_documents)
    _positive("compile.cuda_graph_warmup", cfg.compile.cuda_graph_warmup)
    if cfg.compile.cuda_graph:
        graph = "config key 'compile.cuda_graph' = true"
        _require(t.device != "cpu", f"{graph}: CUDA graphs need a CUDA device (training.device = 'cpu')")
        for op in ("kda", "experts"):
            asked = getattr(cfg.kernels, op)
            _require(asked in ("auto", "triton"), f"{graph}: needs our Triton {op} kernels (they read the batch's "
                                                  f"layout from the device); kernels.{op} = '{asked}'")
        _require(cfg.kernels.attention != "flex", f"{graph}: flex attention builds its block mask on the host every "
                                                  "forward; use kernels.attention = 'varlen' or 'auto'")
    if cfg.compile.cuda_graph_share_pool:
        share = "config key 'compile.cuda_graph_share_pool' = true"
        _require(cfg.compile.cuda_graph, f"{share}: needs compile.cuda_graph = true (the pool is the update graph's)")
        _require(cfg.optimizer.name == "muon" and cfg.optimizer.ns_cuda_graphs,
                 f"{share}: needs optimizer.name = 'muon' and optimizer.ns_cuda_graphs = true (the graphs that join "
                 f"the pool); got '{cfg.optimizer.name}', ns_cuda_graphs = {toml_value(cfg.optimizer.ns_cuda_graphs)}")
    _require(
        not (cfg.float8.enable and t.compute_dtype != "bfloat16"),
        "config key 'float8.enable' = true: needs training.compute_dtype = 'bfloat16'",
    )
    _positive("float8.min_dim", cfg.float8.min_dim)
