"""Metric pieces on their own: FLOP formula, grad-norm groups, expert load and the collapse alarm, sinks."""

import json
import subprocess
import sys

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from titan_k3.config import ConfigError, load_job_config
from titan_k3.metrics.clocks import TwoClocks
from titan_k3.metrics.events import EventLog
from titan_k3.metrics.grad_norms import GROUPS, grad_norms_by_group, param_group
from titan_k3.metrics.moe_stats import CollapseAlarm, expert_load_stats
from titan_k3.metrics.reporter import MetricsReporter
from titan_k3.models.k3.args import count_params, flops_per_token, get_flavor
from titan_k3.models.k3.impl import reference_impl
from titan_k3.models.k3.model import K3Model


@pytest.fixture(scope="module")
def debug_model():
    torch.manual_seed(0)
    model = K3Model(get_flavor("debug"), reference_impl())
    model.init_weights(seed=0)
    return model


def test_process_start_time_counts_from_the_process_start():
    """A process that slept 1 s before asking is at least 1 s old (and at most ~1 s more: boot time is whole s)."""
    code = ("import time; time.sleep(1.0); from titan_k3.metrics.clocks import process_start_time; "
            "print(time.time() - process_start_time())")
    age = float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    assert 1.0 <= age < 1.0 + 1.0 + 10.0  # + the boot time's rounding + interpreter start on a slow machine


def test_flop_formula_matches_torch_flop_counter(debug_model):
    """Forward + backward of the reference implementation, counted by torch, within 5% of the formula."""
    args, T = debug_model.args, 128
    ids = torch.randint(0, args.vocab_size, (1, T))
    with FlopCounterMode(display=False) as counter:
        debug_model(ids, ids).loss_sum.backward()
    debug_model.zero_grad(set_to_none=True)
    counted = counter.get_total_flops() / T
    formula = flops_per_token(args, T)
    assert formula == pytest.approx(counted, rel=0.05)
    # The dense term alone is well below the total: the attention and KDA terms are not negligible here.
    assert 6 * count_params(args).active < 0.8 * counted


def test_flops_grow_with_context_only_through_mla():
    a = get_flavor("k3-mini")
    per_key = len(a.mla_layers) * 3 * 2 * a.mla_heads * (a.qk_nope_dim + a.qk_rope_dim + a.v_head_dim) / 2
    assert flops_per_token(a, 8192) - flops_per_token(a, 4096) == pytest.approx(per_key * 4096)


def test_param_groups_cover_the_model(debug_model):
    seen = {param_group(n) for n, _ in debug_model.named_parameters()}
    assert seen == set(GROUPS)
    assert param_group("layers.1.ffn.w1") == "experts"
    assert param_group("layers.1.ffn.router.weight") == "router"
    assert param_group("layers.0.ffn.w1.weight") == "other"  # the dense FFN of layer 0
    assert param_group("layers.3.attn.wq_b.weight") == "attention"
    assert param_group("output.weight") == "head" and param_group("tok_embeddings.weight") == "embedding"


def test_group_norms_compose_to_the_global_norm():
    torch.manual_seed(1)
    params = {n: torch.nn.Parameter(torch.randn(3, 4)) for n in ("tok_embeddings.weight", "layers.1.ffn.w2", "output.weight")}
    grads = {n: torch.randn(3, 4) for n in params}
    for n, p in params.items():
        p.grad = grads[n]
    params["layers.0.attn.q_proj.weight"] = torch.nn.Parameter(torch.randn(2))  # no grad: ignored
    norms = grad_norms_by_group(params.items())
    assert norms["embedding"] == pytest.approx(grads["tok_embeddings.weight"].norm().item())
    assert norms["experts"] == pytest.approx(grads["layers.1.ffn.w2"].norm().item())
    assert norms["attention"] == 0.0
    assert norms["global"] == pytest.approx(torch.cat([g.flatten() for g in grads.values()]).norm().item())


def test_expert_load_stats_on_a_collapsed_layer():
    counts = torch.tensor([90.0, 10.0, 0.0, 0.0], dtype=torch.float64)
    s = expert_load_stats(counts, torch.tensor([0.5, 0.0, -0.25, -0.25]))
    assert s["load"] == [0.9, 0.1, 0.0, 0.0]
    assert s["dead_fraction"] == 0.5  # 0.1 is 40% of the uniform share 0.25: alive
    assert s["maxvio"] == pytest.approx(90 / 25 - 1)
    assert s["qb_range"] == pytest.approx(0.75)
    assert 0 < s["entropy"] < 0.5


def test_collapse_alarm_fires_once_after_patience_and_rearms():
    alarm = CollapseAlarm(threshold=0.5, patience=3)
    fired = [alarm.update(7, f) for f in (0.6, 0.7, 0.9, 0.9, 0.1, 0.6, 0.6, 0.6)]
    assert fired == [False, False, True, False, False, False, False, True]
    with pytest.raises(ValueError, match="patience=0"):
        CollapseAlarm(0.5, 0)


class _Router:
    def __init__(self, counts):
        self.load_counts = torch.tensor(counts, dtype=torch.float64)
        self.qb_bias = torch.zeros(len(counts))


def test_reporter_raises_the_collapse_alarm_as_an_event(tmp_path, capsys):
    cfg = load_job_config(["--metrics.collapse_dead_fraction", "0.4", "--metrics.collapse_patience", "2"])
    reporter = MetricsReporter(cfg, rank=0, device=torch.device("cpu"), flops_per_token=1.0)
    events = EventLog(tmp_path / "events.jsonl")
    reporter.start(tmp_path, events)
    clocks = TwoClocks(now=lambda: 10.0, start=0.0)
    for step in (1, 2, 3):
        router = _Router([100.0, 0.0, 0.0, 1.0])  # 2 of 4 experts dead, every report
        reporter.log(step=step, loss=1.0, grad_norm=1.0, lr=1e-3, tokens_seen=10 * step, skipped_updates=0,
                     clocks=clocks, window={"tokens": 10, "training_seconds": 1.0, "data_wait": 0.25}, routers={5: router})
        assert router.load_counts.sum() == 0  # the window's counts are consumed
    kinds = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()]
    collapse = [e for e in kinds if e["kind"] == "expert_collapse"]
    assert len(collapse) == 1 and collapse[0]["step"] == 2 and collapse[0]["layer"] == 5
    assert "EXPERT COLLAPSE in layer 5" in capsys.readouterr().out
    record = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert record["data_wait_fraction"] == 0.25 and record["tokens_per_second_training"] == 10.0
    assert record["mfu"] == pytest.approx(10.0 / 989e12)


def test_the_kernel_report_prints_each_op_once_and_records_each_fallback(tmp_path, capsys):
    from titan_k3.models.k3.impl import KernelChoice

    reporter = MetricsReporter(load_job_config([]), rank=0, device=torch.device("cpu"), flops_per_token=1.0)
    reporter.start(tmp_path, EventLog(tmp_path / "events.jsonl"))
    capsys.readouterr()
    reporter.report_kernels([KernelChoice("kda", "auto", "torch", True, "no CUDA device"),
                             KernelChoice("pre_norms", "in_sublayer", "in_sublayer", False)])
    out = capsys.readouterr().out.splitlines()
    assert [line for line in out if "kernel kda:" in line] == [
        "[fallback] step 0: kernel kda: torch (FALLBACK from 'auto': no CUDA device)"]
    assert [line for line in out if "kernel pre_norms:" in line] == ["kernel pre_norms: in_sublayer"]
    events = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [(e["kind"], e.get("op")) for e in events] == [("fallback", "kda"), ("kernel_report", None)]


def test_tensorboard_enabled_but_missing_is_a_config_error(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_tensorboard(name, *a, **kw):
        if name.startswith("torch.utils.tensorboard") or name == "tensorboard":
            raise ImportError("No module named 'tensorboard'")
        return real_import(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_tensorboard)
    cfg = load_job_config(["--metrics.enable_tensorboard", "true"])
    with pytest.raises(ConfigError, match="metrics.enable_tensorboard"):
        MetricsReporter(cfg, rank=0, device=torch.device("cpu"), flops_per_token=1.0)


def test_tensorboard_enabled_but_missing_fails_the_config_check(monkeypatch):
    """`--job.validate_only true` and the service's check say so before the run (they said 'config ok')."""
    import importlib.util

    from titan_k3.config.check import config_error

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard"
                        else real_find_spec(name, *a))
    error = config_error(["--metrics.enable_tensorboard", "true"])
    assert error is not None and error.startswith("config key 'metrics.enable_tensorboard' = true") \
        and "not installed" in error
    assert config_error(["--metrics.enable_tensorboard", "false"]) is None


def test_a_busy_prometheus_port_is_a_config_error():
    import socket

    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        s.listen()
        cfg = load_job_config(["--metrics.prometheus_port", str(s.getsockname()[1])])
        with pytest.raises(ConfigError, match="metrics.prometheus_port"):
            MetricsReporter(cfg, rank=0, device=torch.device("cpu"), flops_per_token=1.0)


def test_mfu_reads_against_the_devices_own_peak(monkeypatch):
    """MFU against another device's peak is a wrong number that looks right: an A100 read against the H100's 989
    TFLOP/s showed a third of its utilisation. 0 (the default) takes the device's datasheet figure."""
    from titan_k3.metrics import peaks

    names = {"NVIDIA A100-SXM4-80GB": 312.0, "NVIDIA H100 80GB HBM3": 989.0, "NVIDIA H100 PCIe": 756.0,
             "NVIDIA H100 NVL": 835.0, "NVIDIA H200": 989.0, "NVIDIA L40S": 362.0, "NVIDIA L4": 121.0}
    for name, tflops in names.items():
        monkeypatch.setattr(peaks.torch.cuda, "get_device_name", lambda _device, name=name: name)
        got, source = peaks.device_peak(0.0, torch.device("cuda", 0))
        assert got == tflops and source == f"the {name}'s dense bf16 datasheet peak", name
    monkeypatch.setattr(peaks.torch.cuda, "get_device_name", lambda _device: "NVIDIA Future GPU")
    got, source = peaks.device_peak(0.0, torch.device("cuda", 0))
    assert got == 989.0 and "not in titan_k3/metrics/peaks.py's table" in source and "metrics.peak_tflops" in source
    assert peaks.device_peak(500.0, torch.device("cuda", 0)) == (500.0, "metrics.peak_tflops")
    got, source = peaks.device_peak(0.0, torch.device("cpu"))
    assert got == 989.0 and source.startswith("a cpu has no datasheet bf16 peak")
    reporter = MetricsReporter(load_job_config(["--metrics.peak_tflops", "100"]), rank=0, device=torch.device("cpu"),
                               flops_per_token=1.0)
    assert reporter.peak_tflops == 100.0
