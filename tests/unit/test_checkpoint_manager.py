"""CheckpointManager and the on-disk layout, in one process: save/load, async staging,
atomic commit, retention, leftovers, load_step, wrong-shape refusal, model-only loads."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from titan_k3.checkpoint import layout
from titan_k3.checkpoint.manager import CheckpointManager
from titan_k3.checkpoint.resume import check_resumable, load_model_weights
from titan_k3.config import load_job_config
from titan_k3.metrics.events import EventLog
from titan_k3.models.k3.args import get_flavor
from titan_k3.models.k3.impl import resolve_impl
from titan_k3.models.k3.model import K3Model
from titan_k3.optim import LRSchedule, ParamSpec, build_optimizers
from titan_k3.train_state import TrainState


class FakeLoader:
    """The data position's owner; like the loader, it refuses a position that is not a whole batch of this run."""

    def __init__(self, batch: int = 1):
        self.position, self.batch = 0, batch

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        if state["position"] % self.batch:
            raise ValueError(f"position {state['position']}: not a multiple of {self.batch}")
        self.position = state["position"]


def _model(flavor_kw=None, seed=0):
    cfg = load_job_config(["--kernels.kda", "torch", "--kernels.experts", "torch", "--kernels.loss", "torch",
                           "--kernels.attn_res", "torch", "--kernels.attention", "math"])
    args = get_flavor("debug", 512).replace(**(flavor_kw or {}))
    model = K3Model(args, resolve_impl(cfg.kernels, torch.device("cpu")), 1.0)
    model.init_weights(seed=seed)
    return model


class Run:
    """The pieces a trainer hands its CheckpointManager, with a one-call fake update."""

    def __init__(self, folder: Path, seed=0, flavor_kw=None, manager_kw=None, batch=1, optim_kw=None, **cfg_kw):
        self.model = _model(flavor_kw, seed)
        hints = self.model.optim_hints()
        self.optimizers = build_optimizers(self.model.named_parameters(), lambda n, _p: ParamSpec(**hints[n]), lr=1e-2,
                                           **(optim_kw or {}))
        self.schedule = LRSchedule(self.optimizers, base_lr=1e-2, total_steps=20, warmup_steps=2,
                                   decay_type="cosine", decay_ratio=None, min_lr_factor=0.1)
        self.loader = FakeLoader(batch)
        self.state = TrainState(data=self.loader)
        cfg = SimpleNamespace(enable=True, interval=2, folder="checkpoints", keep_latest_k=0, async_mode="disabled",
                              load_step=-1, initial_load_path="")
        for k, v in cfg_kw.items():
            setattr(cfg, k, v)
        folder.mkdir(parents=True, exist_ok=True)
        self.events = EventLog(folder / "events.jsonl")
        self.manager = CheckpointManager(cfg, folder / "checkpoints", model=self.model, optimizers=self.optimizers,
                                         schedule=self.schedule, train_state=self.state,
                                         meta={"model_args": {}}, events=self.events, **(manager_kw or {}))

    @torch.no_grad()
    def update(self, seed: int) -> None:
        """Move every saved quantity as an update would (random values: the optimizers' math is not under test)."""
        gen = torch.Generator().manual_seed(seed)
        for p in self.model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 1e-2)
        for opt in self.optimizers.optimizers.values():
            for state in opt.state.values():
                for key, value in state.items():
                    value.add_(1) if key == "step" else value.copy_(torch.randn(value.shape, generator=gen))
        self.schedule.step()
        for router in self.model.moe_routers().values():
            router.qb_bias.add_(torch.randn(router.qb_bias.shape, generator=gen))
        self.loader.position += 7
        self.state.step += 1
        self.state.tokens_seen += 64

    def snapshot(self) -> dict:
        flat = {f"model.{k}": v.clone() for k, v in self.model.state_dict().items()}
        for key, sd in self.optimizers.state_dict().items():
            for name, s in sd["state"].items():
                for sk, v in s.items():
                    flat[f"optim.{key}.{name}.{sk}"] = v.clone()
        flat["loader"] = self.loader.position
        flat["lr"] = self.optimizers.lr
        flat["train"] = self.state.state_dict()
        flat["rng"] = torch.get_rng_state()
        return flat

    def close(self):
        self.manager.close()


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


def _events(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "events.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("mode", ["disabled", "async"])
def test_save_then_load_restores_everything(tmp_path, mode):
    run = Run(tmp_path, async_mode=mode)
    for i in range(1, 5):
        run.update(i)
        run.manager.after_step(run.state.step, last=False)
        if i == 4:
            expected = run.snapshot()
            # Training continues while an async save writes; the checkpoint must hold step 4's values.
            for p in run.model.parameters():
                p.data.add_(1.0)
    run.close()
    assert layout.read_latest(tmp_path / "checkpoints") == "step-4"
    assert sorted(layout.complete_steps(tmp_path / "checkpoints")) == [2, 4]

    fresh = Run(tmp_path, seed=1)
    torch.manual_seed(123)  # a different RNG state, which the load must replace
    assert fresh.manager.load() == 4
    _assert_same(expected, fresh.snapshot())
    assert [e["step"] for e in _events(tmp_path) if e["kind"] == "resumed"] == [4]
    fresh.close()


def test_the_data_position_is_saved_in_the_train_state_alone(tmp_path):
    run = Run(tmp_path)
    run.update(1)
    run.manager.save(1)
    run.close()
    step1 = tmp_path / "checkpoints" / "step-1"
    assert json.loads((step1 / "meta.json").read_text())["train"]["data"] == {"position": 7}
    assert "loader" not in torch.load(step1 / "rank-0.pt", weights_only=False)


def _as_before_the_data_position_was_in_the_train_state(step_dir: Path) -> None:
    """Rewrite a step dir as meta.json version 2 wrote it: the loader's position in rank-R.pt, not in meta.json."""
    meta = json.loads((step_dir / "meta.json").read_text())
    rank = torch.load(step_dir / "rank-0.pt", weights_only=False)
    torch.save({**rank, "loader": meta["train"].pop("data")}, step_dir / "rank-0.pt")
    (step_dir / "meta.json").write_text(json.dumps({**meta, "version": 2}))


def test_a_checkpoint_with_the_position_in_its_rank_files_still_resumes(tmp_path):
    run = Run(tmp_path)
    run.update(1)
    run.update(2)
    run.manager.save(2)
    expected = run.snapshot()
    run.close()
    step2 = tmp_path / "checkpoints" / "step-2"
    _as_before_the_data_position_was_in_the_train_state(step2)
    fresh = Run(tmp_path, seed=1)
    assert fresh.manager.load_from(step2) == 2  # load_from: the doctored files no longer match their checksums
    _assert_same(expected, fresh.snapshot())
    fresh.close()


def test_a_run_that_restarts_its_data_resumes_everything_else(tmp_path):
    run = Run(tmp_path)
    run.update(1)
    run.update(2)
    run.manager.save(2)
    run.close()
    fixed = Run(tmp_path, seed=1, manager_kw={"restore_data": False})
    assert fixed.manager.load() == 2
    assert fixed.state.step == 2 and fixed.loader.position == 0
    fixed.close()


def test_a_data_position_that_does_not_fit_stops_with_one_line(tmp_path):
    run = Run(tmp_path)
    run.update(1)
    run.manager.save(1)
    run.close()
    other = Run(tmp_path, seed=1, batch=2)
    with pytest.raises(ValueError, match=r"^checkpoint \S*step-1: data loader position does not fit this run: "
                                         r"position 7: not a multiple of 2$"):
        other.manager.load()
    assert other.state.step == 0 and other.loader.position == 0
    other.close()


def test_retention_keeps_the_newest_complete_and_load_step_picks_one(tmp_path):
    run = Run(tmp_path, keep_latest_k=2, interval=1)
    for i in range(1, 6):
        run.update(i)
        run.manager.after_step(run.state.step, last=False)
        if i == 3:
            at3 = run.snapshot()
    run.close()
    folder = tmp_path / "checkpoints"
    assert sorted(layout.complete_steps(folder)) == [4, 5]
    again = Run(tmp_path, seed=1, load_step=4)
    assert again.manager.load() == 4
    again.close()
    with pytest.raises(ValueError, match=r"checkpoint.load_step' = 3: no complete checkpoint .*complete steps: 4, 5"):
        Run(tmp_path, load_step=3).manager.load()
    assert at3["train"]["step"] == 3


def test_interrupted_save_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    run = Run(tmp_path)
    run.update(1)
    run.update(2)
    run.manager.save(2)
    at2 = run.snapshot()
    run.update(3)
    run.update(4)

    def killed(tmp, step):
        raise KeyboardInterrupt("killed between writing and renaming")

    monkeypatch.setattr(layout, "commit", killed)
    with pytest.raises(KeyboardInterrupt):
        run.manager.save(4)
    monkeypatch.undo()
    folder = tmp_path / "checkpoints"
    assert layout.read_latest(folder) == "step-2"
    leftovers = [p.name for p in folder.iterdir() if ".tmp-" in p.name]
    assert len(leftovers) == 1 and leftovers[0].startswith("step-4.tmp-")
    # A tmp dir is never a retention candidate, and never resolves as a checkpoint.
    assert layout.apply_retention(folder, 1) == []
    assert layout.resolve(folder, -1)[0].name == "step-2"

    fresh = Run(tmp_path, seed=1)
    assert fresh.manager.load() == 2
    _assert_same({k: v for k, v in at2.items() if k != "rng"}, {k: v for k, v in fresh.snapshot().items() if k != "rng"})
    discarded = [e for e in _events(tmp_path) if e["kind"] == "checkpoint_discarded"]
    assert discarded and discarded[-1]["removed"] == leftovers
    assert not [p for p in folder.iterdir() if ".tmp-" in p.name]


def test_latest_pointing_at_a_missing_dir_falls_back_to_newest_complete(tmp_path):
    run = Run(tmp_path, interval=1)
    for i in range(1, 4):
        run.update(i)
        run.manager.after_step(run.state.step, last=False)
    run.close()
    folder = tmp_path / "checkpoints"
    layout.write_latest(folder, "step-9")
    path, note = layout.resolve(folder, -1)
    assert path.name == "step-3" and "step-9" in note
    fresh = Run(tmp_path, seed=1)
    assert fresh.manager.load() == 3
    assert any(e["kind"] == "checkpoint_fallback" for e in _events(tmp_path))


def test_resave_of_an_existing_step_replaces_it_whole(tmp_path):
    folder = tmp_path / "checkpoints"
    run = Run(tmp_path)
    run.update(1)
    run.manager.save(1)
    first = (folder / "step-1" / "meta.json").read_text()
    run.manager._last_saved_step = None
    run.state.tokens_seen = 999
    run.manager.save(1)
    assert (folder / "step-1" / "meta.json").read_text() != first
    assert sorted(p.name for p in folder.iterdir()) == ["latest", "step-1"]


def test_another_model_shape_is_refused_with_the_mismatched_keys(tmp_path):
    run = Run(tmp_path)
    run.update(1)
    run.manager.save(1)
    run.close()
    other = Run(tmp_path, flavor_kw={"dim": 96})
    with pytest.raises(ValueError) as e:
        other.manager.load()
    message = str(e.value)
    assert "\n" not in message
    assert "does not match" in message and "tok_embeddings.weight: checkpoint [512, 64] vs this run [512, 96]" in message
    assert "more)" in message
    # Nothing was loaded: the model keeps its own initialisation.
    assert other.state.step == 0


def test_check_resumable_refuses_on_metadata_alone(tmp_path):
    run = Run(tmp_path)
    run.update(1)
    run.manager.save(1)
    run.close()
    ckpt = SimpleNamespace(enable=True, folder="checkpoints", load_step=-1, initial_load_path="")
    cfg = SimpleNamespace(checkpoint=ckpt, data=SimpleNamespace(tokenizer="embedded"))
    check_resumable(cfg, tmp_path, run.model, run.optimizers)
    other = Run(tmp_path / "other", flavor_kw={"dim": 96})
    with pytest.raises(ValueError, match="tok_embeddings.weight: checkpoint \\[512, 64\\] vs this run \\[512, 96\\]"):
        check_resumable(cfg, tmp_path, other.model, other.optimizers)
    ckpt.load_step = 7
    with pytest.raises(ValueError, match="'checkpoint.load_step' = 7"):
        check_resumable(cfg, tmp_path, run.model, run.optimizers)
    ckpt.enable, ckpt.initial_load_path = False, str(tmp_path / "checkpoints")
    with pytest.raises(ValueError, match="does not match"):
        check_resumable(cfg, tmp_path / "other", other.model, other.optimizers)
    ckpt.initial_load_path = str(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="initial_load_path' = '.*nowhere': no checkpoint there"):
        check_resumable(cfg, tmp_path / "other", other.model, other.optimizers)


def test_model_only_initial_load(tmp_path):
    src = Run(tmp_path / "a")
    src.update(1)
    src.manager.save(1)
    src.close()
    dst = Run(tmp_path / "b", seed=5, initial_load_path=str(tmp_path / "a" / "checkpoints"))
    assert dst.manager.load() is None
    for (k, a), b in zip(src.model.state_dict().items(), dst.model.state_dict().values()):
        assert torch.equal(a, b), k
    assert dst.state.step == 0 and dst.schedule.steps_done == 0
    with pytest.raises(ValueError, match="does not match"):
        load_model_weights(_model({"dim": 96}), tmp_path / "a" / "checkpoints" / "step-1")


def test_leftovers_and_retention_only_touch_what_they_should(tmp_path):
    folder = tmp_path
    for name in ("step-1", "step-2", "step-3"):
        (folder / name).mkdir()
        (folder / name / layout.DCP_METADATA).write_text("x")
    (folder / "step-4").mkdir()                      # no .metadata: not complete
    (folder / "step-5.tmp-abcd").mkdir()
    (folder / "step-3.old-0123").mkdir()
    (folder / "latest.tmp-9999").write_text("step-2")
    layout.write_latest(folder, "step-1")
    assert layout.apply_retention(folder, 1) == [2]  # step-1 is what latest names: kept
    assert sorted(layout.remove_leftovers(folder)) == ["latest.tmp-9999", "step-3.old-0123", "step-5.tmp-abcd"]
    assert sorted(p.name for p in folder.iterdir()) == ["latest", "step-1", "step-3", "step-4"]


def _momenta(run: Run) -> dict[str, torch.Tensor]:
    return {name: s["momentum_buffer"].clone() for name, s in run.optimizers.state_dict()["muon"]["state"].items()}


@pytest.mark.parametrize("saved, resumed", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16),
                                            (torch.bfloat16, torch.float32)])
def test_a_resume_keeps_the_runs_momentum_dtype(tmp_path, saved, resumed):
    """optimizer.momentum_dtype: a checkpoint of either buffer dtype resumes in the resuming run's, with the saved
    values (rounded once when bf16 takes float32's); torch's loader alone would cast every buffer to float32."""
    run = Run(tmp_path, optim_kw={"momentum_dtype": saved})
    run.update(1)
    momenta = _momenta(run)
    assert momenta and all(b.dtype == saved for b in momenta.values())
    run.manager.save(1)
    run.close()
    fresh = Run(tmp_path, seed=1, optim_kw={"momentum_dtype": resumed})
    assert fresh.manager.load() == 1
    loaded = _momenta(fresh)
    assert loaded.keys() == momenta.keys()
    for name, buf in loaded.items():
        assert buf.dtype == resumed, name
        assert torch.equal(buf, momenta[name].to(resumed)), name
    fresh.close()
