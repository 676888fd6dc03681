"""The training step's forward, backward and optimizer never wait for the GPU (CUDA sync debug mode).

The trainer reads the loss and grad norm back asynchronously and skips a
non-finite update on the device, so nothing in a step between window ends may
stop the host from queueing ahead: a device read-back (bincount, .item(), a
pageable host-to-device copy) in any of it raises here.
"""

import pytest
import torch
from host_sync import run_without_host_sync

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_forward_backward_and_optimizer_step_do_not_sync():
    from kernels.device import host_to_device
    from titan_k3.config import load_job_config
    from titan_k3.models.k3.args import get_flavor
    from titan_k3.models.k3.impl import resolve_impl
    from titan_k3.models.k3.model import K3Model
    from titan_k3.optim import ParamSpec, build_optimizers

    device = torch.device("cuda")
    cfg = load_job_config(["--model.flavor", "tiny"])
    impl = resolve_impl(cfg.kernels, device)
    assert not impl.fallbacks, impl.fallbacks
    model = K3Model(get_flavor("tiny", 8192), impl).to(device)
    model.init_weights(seed=0)
    hints = model.optim_hints()
    opt = build_optimizers(model.named_parameters(), lambda name, _p: ParamSpec(**hints[name]), lr=1e-3)
    B, T = 2, 256
    ids = torch.randint(0, 8192, (B, T))
    cu = torch.tensor([0, 100, 256, 300, 512])  # packed documents, on the host as the loader makes them

    def step():
        before = model.output.weight.detach().clone()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(host_to_device(ids, device), host_to_device(ids, device), cu)
        (out.loss_sum / 512).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return out.loss_sum.detach(), before

    loss_sum, before = run_without_host_sync(step)
    assert torch.isfinite(loss_sum) and loss_sum > 0
    assert not torch.equal(model.output.weight, before), "the optimizer step ran"


def test_trainer_step_between_window_ends_does_not_sync(tmp_path):
    """Trainer.train_step as a run calls it: batch, forward, backward, clip, device-side skip, update, QK-Clip."""
    from titan_k3.config import load_job_config
    from titan_k3.train import Trainer

    cfg = load_job_config(["--model.flavor", "tiny", "--training.seq_len", "256", "--training.device", "cuda",
                           "--metrics.log_freq", "1000", "--invariants.enable", "false",
                           "--job.dump_folder", str(tmp_path)])
    trainer = Trainer(cfg)
    try:
        result = run_without_host_sync(trainer.train_step)
        assert result.n_tokens > 0 and result.loss > 0 and not result.skipped
    finally:
        trainer.close()
