"""A GPU test's check that some work lets the host queue ahead: it runs under CUDA's sync-debug "error" mode."""

import torch


def run_without_host_sync(step):
    """step() once (compilation and allocator warm-up may sync), then again under sync-debug "error", where any
    host wait for the GPU (a .item(), a pageable copy, a bincount) raises. Returns the second call's result,
    after the GPU has finished it."""
    step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        result = step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return result
