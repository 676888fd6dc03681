"""Export to the published K3 layout and import back: names, config.json, shards, exact round trips."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from titan_k3.checkpoint.export import INDEX_FILE, export_checkpoint, import_state_dict, main
from titan_k3.checkpoint.hf import args_from_hf_config, from_hf, hf_config, to_hf
from titan_k3.checkpoint.manager import CheckpointManager
from titan_k3.checkpoint.resume import load_model_weights
from titan_k3.config import load_job_config
from titan_k3.metrics.events import EventLog
from titan_k3.models.k3.args import FLAVORS, get_flavor
from titan_k3.models.k3.impl import resolve_impl
from titan_k3.models.k3.model import K3Model
from titan_k3.optim import LRSchedule, ParamSpec, build_optimizers
from titan_k3.train_state import TrainState
from dataclasses import asdict


def _impl():
    cfg = load_job_config(["--kernels.kda", "torch", "--kernels.experts", "torch", "--kernels.loss", "torch",
                           "--kernels.attn_res", "torch", "--kernels.attention", "math"])
    return resolve_impl(cfg.kernels, torch.device("cpu"))


def _trained_like_model(seed: int = 0) -> K3Model:
    model = K3Model(get_flavor("debug", 512), _impl(), 1.0)
    model.init_weights(seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for router in model.moe_routers().values():
            router.qb_bias.copy_(torch.randn(router.qb_bias.shape, generator=gen))
        for p in model.parameters():  # break the init's structure (zeros, ones) so every mapping is seen
            p.add_(torch.randn(p.shape, generator=gen) * 0.02)
    return model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A real step dir written by the CheckpointManager from a debug model."""
    root = tmp_path_factory.mktemp("export")
    model = _trained_like_model()
    hints = model.optim_hints()
    opts = build_optimizers(model.named_parameters(), lambda n, _p: ParamSpec(**hints[n]), lr=1e-3)
    sched = LRSchedule(opts, base_lr=1e-3, total_steps=4, warmup_steps=1, decay_type="cosine",
                       decay_ratio=None, min_lr_factor=0.1)
    cfg = SimpleNamespace(enable=True, interval=1, folder="checkpoints", keep_latest_k=0, async_mode="disabled",
                          load_step=-1, initial_load_path="")
    state = TrainState(step=3)
    manager = CheckpointManager(cfg, root / "checkpoints", model=model, optimizers=opts, schedule=sched,
                                train_state=state, meta={"model_args": asdict(model.args), "qb_eta": 1.0},
                                events=EventLog(None))
    manager.save(3)
    manager.close()
    return root / "checkpoints" / "step-3", model


def _logits(model: K3Model) -> torch.Tensor:
    ids = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        return model.eval()(ids, cu_seqlens=torch.tensor([0, 40, 64, 128]))


@pytest.mark.parametrize("flavor", ["debug", "tiny", "k3-mini"])
def test_every_tensor_has_a_published_name_and_maps_back(flavor):
    with torch.device("meta"):
        model = K3Model(get_flavor(flavor, 1024), _impl(), 1.0)
    state = model.state_dict()
    exported = {}
    for name, t in state.items():
        for hf_name, ht, _ in to_hf(name, t):
            assert hf_name not in exported, hf_name
            exported[hf_name] = ht
    assert all(k.startswith(("model.", "lm_head.")) for k in exported)
    assert "model.layers.1.mlp.experts.0.gate_proj.weight" in exported
    back = from_hf(exported, set(model.args.mla_layers))
    assert back.keys() == state.keys()
    assert all(back[k].shape == state[k].shape for k in state)


@pytest.mark.parametrize("flavor", sorted(FLAVORS))
def test_config_json_describes_the_args_exactly(flavor):
    args = get_flavor(flavor)
    config = json.loads(json.dumps(hf_config(args)))
    assert config["model_type"] == "kimi_k3"
    assert args_from_hf_config(config) == args
    lin = config["linear_attn_config"]
    assert sorted(lin["kda_layers"] + lin["full_attn_layers"]) == list(range(1, args.n_layers + 1))
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "n_routed_experts",
                "num_experts_per_tok", "moe_intermediate_size", "n_shared_experts", "first_k_dense_replace",
                "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        assert key in config


def test_float32_export_round_trips_every_tensor_and_the_outputs(checkpoint, tmp_path):
    step_dir, model = checkpoint
    index = export_checkpoint(step_dir, tmp_path, dtype="float32", max_shard_bytes=200_000)
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and all((tmp_path / f).is_file() for f in files)
    assert files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    args, state = import_state_dict(tmp_path)
    assert args == model.args
    original = model.state_dict()
    assert state.keys() == original.keys()
    for k in original:
        assert torch.equal(state[k], original[k]), k
    fresh = K3Model(args, _impl(), 1.0)
    fresh.load_state_dict(state)
    assert torch.equal(_logits(fresh), _logits(model))


def test_bf16_export_is_exact_in_bf16_and_keeps_the_routing_bias_in_float32(checkpoint, tmp_path):
    step_dir, model = checkpoint
    assert main(["--checkpoint", str(step_dir), "--out", str(tmp_path)]) == 0
    config = json.loads((tmp_path / "config.json").read_text())
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    assert config["torch_dtype"] == "bfloat16"
    from safetensors import safe_open

    dtypes = {}
    for file in set(index["weight_map"].values()):
        with safe_open(str(tmp_path / file), "pt") as f:
            dtypes.update({k: f.get_slice(k).get_dtype() for k in f.keys()})
    bias = [k for k in dtypes if k.endswith("e_score_correction_bias")]
    assert bias and all(dtypes[k] == "F32" for k in bias)
    assert all(dtypes[k] == "BF16" for k in dtypes if k not in bias)
    _, state = import_state_dict(tmp_path)
    for k, v in model.state_dict().items():
        want = v if k.endswith("qb_bias") else v.to(torch.bfloat16).float()
        assert torch.equal(state[k], want), k
    # An export directory is a valid model-only initial load.
    fresh = K3Model(model.args, _impl(), 1.0)
    load_model_weights(fresh, tmp_path)
    assert torch.equal(fresh.layers["1"].ffn.w2, state["layers.1.ffn.w2"])


def test_export_refuses_a_dir_that_is_not_a_checkpoint(tmp_path, capsys):
    assert main(["--checkpoint", str(tmp_path), "--out", str(tmp_path / "out")]) == 2
    assert "not a titan_k3 checkpoint dir" in capsys.readouterr().err


def test_export_refuses_a_damaged_checkpoint(checkpoint, tmp_path, capsys):
    """A data file changed since the save is named and nothing is written (it exported the damaged weights)."""
    import shutil

    step_dir, _ = checkpoint
    copy = tmp_path / "step-3"
    shutil.copytree(step_dir, copy)
    data = next(copy.glob("*.distcp"))
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    assert main(["--checkpoint", str(copy), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "damaged, not exported" in err and data.name in err and "changed since the save" in err
    assert not (tmp_path / "out").exists()


def test_export_shards_are_as_readable_as_its_config(checkpoint, tmp_path):
    """safetensors left each shard 0600 while config.json and the index followed the umask (0644)."""
    import os

    step_dir, _ = checkpoint
    old = os.umask(0o022)
    try:
        index = export_checkpoint(step_dir, tmp_path / "out")
    finally:
        os.umask(old)
    for name in set(index["weight_map"].values()):
        assert (tmp_path / "out" / name).stat().st_mode & 0o777 == 0o644, name
    assert (tmp_path / "out" / "config.json").stat().st_mode & 0o777 == 0o644


def test_a_truncated_or_missing_shard_is_one_error_naming_it(checkpoint, tmp_path):
    """initial_load_path on a damaged export stopped with a SafetensorError traceback."""
    from titan_k3.checkpoint.export import export_shapes

    step_dir, _ = checkpoint
    index = export_checkpoint(step_dir, tmp_path / "out", max_shard_bytes=2**20)
    first, *rest = sorted(set(index["weight_map"].values()))
    shard = tmp_path / "out" / first
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    for read in (export_shapes, import_state_dict):
        with pytest.raises(ValueError, match=f"{first}: not a readable safetensors shard"):
            read(tmp_path / "out")
    shard.unlink()
    with pytest.raises(ValueError, match=f"{first}: not a readable safetensors shard"):
        export_shapes(tmp_path / "out")
    (tmp_path / "out" / INDEX_FILE).write_text("{")
    with pytest.raises(ValueError, match=f"{INDEX_FILE}: not a readable export file"):
        export_shapes(tmp_path / "out")


def test_a_second_export_into_the_same_dir_leaves_only_its_own_shards(checkpoint, tmp_path):
    """Re-exporting with another shard count left the first export's shards beside the new index."""
    step_dir, _ = checkpoint
    out = tmp_path / "out"
    first = export_checkpoint(step_dir, out, max_shard_bytes=2**16)
    (out / "notes.txt").write_text("mine")
    second = export_checkpoint(step_dir, out)
    assert len(set(first["weight_map"].values())) > 1
    assert {p.name for p in out.glob("*.safetensors")} == set(second["weight_map"].values())
    assert (out / "notes.txt").read_text() == "mine"


def test_an_output_path_that_is_a_file_is_one_line(checkpoint, tmp_path, capsys):
    step_dir, _ = checkpoint
    (tmp_path / "afile").write_text("")
    assert main(["--checkpoint", str(step_dir), "--out", str(tmp_path / "afile")]) == 2
    assert "afile" in capsys.readouterr().err


def test_an_export_stopped_midway_over_an_earlier_one_is_no_export(checkpoint, tmp_path, monkeypatch):
    """Re-exporting into a directory and failing after the first shard left the earlier index and config beside
    a mix of new and old shards, which imported as one model without a word."""
    import safetensors.torch

    step_dir, _ = checkpoint
    out = tmp_path / "out"
    export_checkpoint(step_dir, out, max_shard_bytes=2**16)
    real, calls = safetensors.torch.save_file, []

    def fail_on_second(tensors, path, metadata=None):
        calls.append(path)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        real(tensors, path, metadata=metadata)

    monkeypatch.setattr(safetensors.torch, "save_file", fail_on_second)
    with pytest.raises(OSError):
        export_checkpoint(step_dir, out, dtype="float32", max_shard_bytes=2**16)
    with pytest.raises(ValueError, match=r"config.json: not a readable export file"):
        import_state_dict(out)
    monkeypatch.setattr(safetensors.torch, "save_file", real)
    export_checkpoint(step_dir, out, dtype="float32", max_shard_bytes=2**16)
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "float32"
    import_state_dict(out)


def test_an_export_into_its_own_checkpoint_is_refused(checkpoint, capsys):
    """Shards and config.json written into the step dir made the checkpoint fail its checksums at the next start."""
    step_dir, _ = checkpoint
    before = sorted(p.name for p in step_dir.iterdir())
    for out in (step_dir, step_dir / "hf"):
        assert main(["--checkpoint", str(step_dir), "--out", str(out)]) == 2
        assert "is inside the checkpoint" in capsys.readouterr().err
    assert sorted(p.name for p in step_dir.iterdir()) == before


def test_bad_export_arguments_are_one_line_before_the_checkpoint_is_read(checkpoint, tmp_path, capsys, monkeypatch):
    """--max-shard-mb 0 named the Python argument max_shard_bytes; a step-N.tmp-* dir (a save a crash cut short)
    was called damaged, and one whose checksums.json was written before the kill was exported; an --out holding
    another project's config.json lost it; --out checks came after hashing the whole checkpoint."""
    import shutil

    from titan_k3.checkpoint import export

    step_dir, _ = checkpoint
    tmp_save = tmp_path / "checkpoints" / "step-4.tmp-0a1b2c3d"
    shutil.copytree(step_dir, tmp_save)
    foreign = tmp_path / "project"
    foreign.mkdir()
    (foreign / "config.json").write_text('{"model_type": "llama"}')
    (tmp_path / "afile").write_text("")

    def hashed(*args, **kwargs):
        raise AssertionError("the checkpoint was hashed before the arguments were checked")

    monkeypatch.setattr(export, "verify", hashed)
    cases = [
        (["--checkpoint", str(step_dir), "--out", str(tmp_path / "o"), "--max-shard-mb", "0"],
         "--max-shard-mb 0: must be >= 1"),
        (["--checkpoint", str(tmp_save), "--out", str(tmp_path / "o")], "step-4.tmp-0a1b2c3d: not a titan_k3 checkpoint"),
        (["--checkpoint", str(step_dir), "--out", str(foreign)], "holds a config.json that is not a K3 export's"),
        (["--checkpoint", str(step_dir), "--out", str(tmp_path / "afile")], "afile': a file, not a directory"),
    ]
    for argv, expected in cases:
        assert main(argv) == 2
        captured = capsys.readouterr()
        assert captured.out == "" and captured.err.count("\n") == 1 and expected in captured.err, (argv, captured)
    assert (foreign / "config.json").read_text() == '{"model_type": "llama"}' and not (tmp_path / "o").exists()


@pytest.mark.parametrize("existing", [False, True])
def test_an_export_stopped_by_ctrl_c_leaves_nothing_half_written(checkpoint, tmp_path, capsys, monkeypatch, existing):
    """Ctrl-C in the middle of an export left its shards (and .tmp files) behind: a directory that read as an
    incomplete export. Now a directory the export made goes whole, and in one that was there only its files go."""
    import safetensors.torch

    step_dir, _ = checkpoint
    out = tmp_path / "out"
    if existing:
        out.mkdir()
        (out / "notes.txt").write_text("mine")
    real, calls = safetensors.torch.save_file, []

    def interrupt_after_writing(tensors, path, metadata=None):
        calls.append(path)
        real(tensors, path, metadata=metadata)
        Path(path + ".tmp").write_text("")  # as a temporary file of the next write would be
        raise KeyboardInterrupt

    monkeypatch.setattr(safetensors.torch, "save_file", interrupt_after_writing)
    assert main(["--checkpoint", str(step_dir), "--out", str(out)]) == 130
    err = capsys.readouterr().err
    assert err.startswith("interrupted: nothing exported") and str(out) in err
    assert len(calls) == 1
    if existing:
        assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    else:
        assert not out.exists()


def test_a_failure_after_config_json_keeps_the_whole_export(checkpoint, tmp_path, monkeypatch):
    """config.json is written last and marks a whole export: a failure past it (the shards' chmod) removes nothing."""
    import os as os_module

    step_dir, _ = checkpoint
    out = tmp_path / "out"

    def fail(*args, **kwargs):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os_module, "chmod", fail)
    with pytest.raises(PermissionError):
        export_checkpoint(step_dir, out, dtype="float32")
    monkeypatch.undo()
    import_state_dict(out)
