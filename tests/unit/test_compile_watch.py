"""Compile reporting: graph breaks reach the event log, and dynamo never silently runs a block eager."""

import json
import os

import torch
import torch._dynamo
import torch._dynamo.config as dynamo_config

from titan_k3.metrics.events import EventLog
from titan_k3.parallel.distributed import CompileWatch
from titan_k3.parallel.parallelize import apply_compile


def test_graph_breaks_and_compiled_frames_are_reported_once_per_change(tmp_path):
    torch._dynamo.reset()
    events = EventLog(tmp_path / "events.jsonl")
    watch = CompileWatch(events)

    @torch.compile(backend="eager")
    def with_break(x):
        x = x + 1
        torch._dynamo.graph_break()
        return x * 2

    with_break(torch.ones(3))
    watch.check(step=1)
    watch.check(step=2)  # nothing changed: no second event
    reports = [e for e in map(json.loads, (tmp_path / "events.jsonl").read_text().splitlines())
               if e["kind"] == "compile"]
    assert len(reports) == 1
    assert reports[0]["graph_breaks"] >= 1 and reports[0]["frames_compiled"] >= 2  # the code after the break is a frame too
    assert "graph breaks" in reports[0]["message"]


def _restoring_limits(**values):
    """dynamo_config.patch over the keys apply_compile sets (restored on exit; monkeypatch would delete them)."""
    keys = ("recompile_limit", "accumulated_recompile_limit", "fail_on_recompile_limit_hit")
    return dynamo_config.patch(**{k: values.get(k, getattr(dynamo_config, k)) for k in keys})


def test_compile_covers_every_block_and_refuses_a_silent_eager_fallback():
    import dataclasses

    from titan_k3.models.k3.args import get_flavor
    from titan_k3.models.k3.impl import reference_impl
    from titan_k3.models.k3.model import K3Model

    with _restoring_limits(recompile_limit=8, accumulated_recompile_limit=256, fail_on_recompile_limit_hit=False):
        with torch.device("meta"):
            model = K3Model(dataclasses.replace(get_flavor("debug", 64), n_layers=40), reference_impl())
        apply_compile(model, "eager")
        # room for each sublayer's variants (train/eval, static/dynamic, recompute), over the whole model too
        assert dynamo_config.recompile_limit >= 8 * 40 and dynamo_config.accumulated_recompile_limit >= 16 * 40
        assert dynamo_config.fail_on_recompile_limit_hit
        mixes = [model.final_mix]
        for block in model.layers.values():
            assert all(hasattr(getattr(block, name), "_torchdynamo_orig_callable") for name in ("attn_sublayer", "ffn_sublayer"))
            mixes += [block.attn_mix, block.ffn_mix]
        assert all(hasattr(mix.mix_several, "_torchdynamo_orig_callable") for mix in mixes)


def test_every_residual_mix_runs_compiled():
    """No mix runs eager: dynamo skips a frame that traces no op for good (a lone source returns before it)."""
    from titan_k3.models.k3.args import get_flavor
    from titan_k3.models.k3.impl import reference_impl
    from titan_k3.models.k3.model import K3Model

    torch._dynamo.reset()
    model = K3Model(get_flavor("debug", 64), reference_impl())
    model.init_weights(seed=0)
    with _restoring_limits():
        apply_compile(model, "aot_eager")
        ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
        model(ids, ids).loss_sum.backward()  # the first call compiles
        with torch.profiler.profile() as prof:
            model(ids, ids).loss_sum.backward()

    def compiled(event) -> bool:
        while event is not None:
            if event.name.startswith(("Torch-Compiled Region", "CompiledFunction")):
                return True
            event = event.cpu_parent
        return False

    # every softmax of the forward (the mixes' and MLA's) and every RMSNorm without a weight runs in a compiled region
    softmaxes = [e for e in prof.events() if e.name == "aten::_softmax"]
    assert len(softmaxes) >= 2 * len(model.layers) and all(compiled(e) for e in softmaxes), \
        sum(not compiled(e) for e in softmaxes)


def test_compiled_blocks_take_train_eval_and_new_shapes_without_hitting_the_limit():
    """Every block compiled, run in training and evaluation at two lengths: same numbers as eager, no limit raised."""
    from titan_k3.config import load_job_config
    from titan_k3.models.k3.args import get_flavor
    from titan_k3.models.k3.impl import resolve_impl
    from titan_k3.models.k3.model import K3Model

    torch._dynamo.reset()
    cfg = load_job_config(["--model.flavor", "debug"])
    impl = resolve_impl(cfg.kernels, torch.device("cpu"))
    eager, compiled = (K3Model(get_flavor("debug", 64), impl) for _ in range(2))
    eager.init_weights(seed=0)
    compiled.load_state_dict(eager.state_dict())
    for router in (*eager.moe_routers().values(), *compiled.moe_routers().values()):
        router.update_enabled = False
    gen = torch.Generator().manual_seed(0)
    with _restoring_limits():
        apply_compile(compiled, "eager")
        for T in (16, 24):
            ids = torch.randint(0, 64, (2, T), generator=gen)
            for model in (eager, compiled):
                model.train()
            torch.testing.assert_close(compiled(ids, ids).loss_sum, eager(ids, ids).loss_sum)
            with torch.no_grad():
                for model in (eager, compiled):
                    model.eval()
                torch.testing.assert_close(compiled(ids), eager(ids))


def test_compile_cache_dir_points_inductor_and_triton_at_shared_storage(tmp_path, monkeypatch):
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    from titan_k3.parallel.parallelize import use_compile_cache

    for var in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        monkeypatch.delenv(var, raising=False)  # restored after the test
    root = use_compile_cache(str(tmp_path / "shared" / "cache"))
    assert cache_dir() == str(root / "inductor") and (root / "inductor").is_dir()
    assert os.environ["TRITON_CACHE_DIR"] == str(root / "triton") and (root / "triton").is_dir()
    import triton

    assert triton.knobs.cache.dir == str(root / "triton")  # read when a kernel is compiled, not at import
