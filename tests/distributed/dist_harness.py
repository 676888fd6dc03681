"""Run the real Trainer in spawned gloo processes (tests/gloo_workers.py) or in one plain process and collect per-step numbers.

Every run sees the same global batch: GLOBAL_BATCH sequences per microbatch,
split by the loader over the data-parallel ranks (local_batch_size =
GLOBAL_BATCH / W). Recorded per step: loss, grad norm, the fingerprints of
every sequence this rank trained on, the largest MLA logit that QK-Clip saw,
and (distributed) whether the routing state is bit-identical on all ranks;
per run: how many blocking all-to-alls (expert parallelism's count exchanges,
each a host wait) and how many reduce-scatters ran, and how many graph breaks
fell at functions dynamo skips.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from gloo_workers import spawn_gloo

GLOBAL_BATCH = 4
STEPS = 5
GRAD_ACCUM = 2
BASE_ARGS = [
    "--model.flavor", "debug", "--training.seq_len", "32", "--training.grad_accum", str(GRAD_ACCUM),
    "--training.steps", str(STEPS), "--training.device", "cpu", "--training.compute_dtype", "float32",
    "--kernels.kda", "torch", "--kernels.experts", "torch", "--kernels.loss", "torch", "--kernels.attn_res", "torch",
    "--kernels.attention", "math",
    "--lr_scheduler.warmup_steps", "1", "--optimizer.qk_clip_tau", "0.05", "--metrics.log_freq", "1000",
    # NOTE: these runs compare training across layouts and count its collectives; the checks (whose probe adds a
    # forward and backward at the run's last update) have their own tests, and test_world_eight.py turns them on.
    "--invariants.enable", "false",
]


def run_trainer(argv: list[str], dump: str, name: str, steps: int = STEPS, whole: bool = False) -> dict:
    """Build a Trainer from BASE_ARGS + argv and run `steps` updates; return what it saw.

    whole: run `Trainer.train()` itself (checkpoints, logs, resumes; `steps` must then be training.steps,
    less the updates a resumed run has done) instead of calling `train_step` `steps` times.
    """
    from titan_k3.config import load_job_config
    from titan_k3.train import Trainer

    from torch._dynamo.utils import counters

    counters.clear()  # graph breaks of this run only
    cfg = load_job_config(BASE_ARGS + argv + ["--job.dump_folder", dump, "--job.name", name])
    trainer = Trainer(cfg)
    seen, max_logits = [], []
    next_batch = trainer._next_batch

    def recording_next_batch():
        batch = next_batch()
        seen.append(batch.fingerprints.tolist())
        return batch

    trainer._next_batch = recording_next_batch
    for layer in trainer.model.mla_layers().values():
        pop = layer.pop_max_logit

        def recording_pop(pop=pop):
            value = pop()
            max_logits.append(float(value.max()))
            return value

        layer.pop_max_logit = recording_pop
    out = {"loss": [], "grad_norm": [], "fingerprints": [], "routing_identical": [], "max_logit": max_logits,
           "count_exchanges": 0, "reduce_scatters": 0, "moe_layers": len(trainer.model.moe_routers())}
    counted = {"all_to_all_single": "count_exchanges",
               **{name: "reduce_scatters" for name in ("reduce_scatter_tensor", "reduce_scatter_single")
                  if hasattr(dist, name)}}
    originals = {name: getattr(dist, name) for name in counted}

    def counting(name):
        def call(*args, **kwargs):
            out[counted[name]] += 1
            return originals[name](*args, **kwargs)
        return call

    for name in counted:
        setattr(dist, name, counting(name))
    train_step = trainer.train_step

    def recording_train_step():
        result = train_step()
        out["loss"].append(result.loss)
        out["grad_norm"].append(result.grad_norm)
        out["fingerprints"].append(seen[-cfg.training.grad_accum:])
        if trainer.dp_group is not None:
            out["routing_identical"].append(_routing_identical(trainer))
        return result

    try:
        if whole:
            trainer.train_step = recording_train_step
            trainer.train()
            assert len(out["loss"]) == steps, (len(out["loss"]), steps)
        for _ in range(0 if whole else steps):
            recording_train_step()
            trainer.step += 1  # as Trainer.train does: the invariants and the GC schedule count updates by it
        out["qb_bias"] = torch.cat([r.qb_bias for r in trainer.model.moe_routers().values()]).clone()
        out["router_weight"] = torch.cat([_full(r.weight).detach().flatten() for r in trainer.model.moe_routers().values()])
        # Breaks at functions dynamo must skip (FSDP hooks inside a compiled region), apart from data-dependent ones.
        out["skipped_function_breaks"] = sum(n for reason, n in counters["graph_break"].items() if "skipped" in reason)
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
        trainer.close()
    return out


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _routing_identical(trainer) -> bool:
    state = torch.cat([r.qb_bias for r in trainer.model.moe_routers().values()])
    gathered = [torch.empty_like(state) for _ in range(dist.get_world_size(trainer.dp_group))]
    dist.all_gather(gathered, state, group=trainer.dp_group)
    return all(torch.equal(g, state) for g in gathered)


def _train_runs(rank: int, world: int, runs: list, dump: str) -> dict:
    local = ["--training.local_batch_size", str(GLOBAL_BATCH // world)]
    return {name: run_trainer(argv + local, dump, name, steps) for name, argv, steps in runs}


def run_distributed(world: int, runs: list[tuple[str, list[str], int]], tmp_path) -> list[dict]:
    """Run each (name, argv, steps) in turn in `world` spawned processes; returns one result dict per rank."""
    return spawn_gloo(world, _train_runs, runs, str(tmp_path), result_file=tmp_path / "results.pt")


def check_equivalent(ranks: list[dict], ref: dict, name: str, steps: int = STEPS) -> None:
    """Run `name` on every rank equals the single-process `ref` (run_trainer results) update for update.

    Loss within 1e-5 relative, grad norm within 1e-4, routing state bit-identical
    on every rank after every update, the ranks' sequences together exactly the
    reference's, and the router weights whole, equal and (after as many updates) the reference's.
    """
    import pytest

    for step in range(steps):
        for rank, result in enumerate(ranks):
            run = result[name]
            assert run["loss"][step] == pytest.approx(ref["loss"][step], rel=1e-5), f"{name}: loss, step {step + 1}, rank {rank}"
            assert run["grad_norm"][step] == pytest.approx(ref["grad_norm"][step], rel=1e-4), f"{name}: grad norm, step {step + 1}"
            assert run["routing_identical"][step], f"{name}: routing state differs between ranks after step {step + 1}"
        for micro in range(len(ref["fingerprints"][step])):
            together = sorted(fp for result in ranks for fp in result[name]["fingerprints"][step][micro])
            assert together == sorted(ref["fingerprints"][step][micro]), f"{name}: ranks did not split the global batch"
            per_rank = [set(result[name]["fingerprints"][step][micro]) for result in ranks]
            assert sum(len(s) for s in per_rank) == len(set().union(*per_rank)), f"{name}: ranks overlap"
    # The comparison proves something only if training moved the routing state.
    assert any(abs(x) > 0 for x in ranks[0][name]["qb_bias"].tolist())
    # Router weights: whole on every rank, and trained by the global gradient (summed over the ranks).
    weights = [result[name]["router_weight"] for result in ranks]
    assert all(torch.equal(w, weights[0]) for w in weights), f"{name}: router weights differ between ranks"
    if steps == len(ref["loss"]):  # the reference's weights are those after all its updates
        torch.testing.assert_close(weights[0], ref["router_weight"], rtol=1e-4, atol=1e-6, msg=f"{name}: router weights")
