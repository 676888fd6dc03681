"""The training step's forward, backward and optimizer never wait for the GPU (CUDA sync debug mode).

The step's one intended sync (loss and grad norm, before the skip decision)
lives in the trainer; everything this test runs must let the host queue
work ahead: a device read-back (bincount, .item(), a pageable host-to-device
copy) in any of it raises here.
"""

import pytest
import torch

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
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(host_to_device(ids, device), host_to_device(ids, device), cu)
        (out.loss_sum / 512).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # first call: kernel compilation and allocator warm-up may sync
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def test_trainer_step_between_window_ends_does_not_sync(tmp_path):
    """Trainer.train_step as a run calls it: batch, forward, backward, clip, device-side skip, update, QK-Clip."""
    from titan_k3.config import load_job_config
    from titan_k3.train import Trainer

    cfg = load_job_config(["--model.flavor", "tiny", "--training.seq_len", "256", "--training.device", "cuda",
                           "--metrics.log_freq", "1000", "--invariants.enable", "false",
                           "--job.dump_folder", str(tmp_path)])
    trainer = Trainer(cfg)
    try:
        trainer.train_step()  # first call: kernel compilation and allocator warm-up may sync
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            result = trainer.train_step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert result.n_tokens > 0 and result.loss > 0 and not result.skipped
    finally:
        trainer.close()
