"""Where Triton kernels run, and moving small host tensors to the GPU without stalling the host.

Shared by the kernels and the trainer.
"""

import os

import torch


def triton_runs_on(device: torch.device | str) -> bool:
    """Triton kernels run on CUDA devices, and on the CPU only in Triton's interpreter (TRITON_INTERPRET=1)."""
    return torch.device(device).type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def host_to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor on `device` without stalling the host: on CUDA, an asynchronous copy from pinned memory.

    NOTE: a plain host-to-CUDA copy (pageable memory, non_blocking=False)
    synchronises the stream, waiting for every kernel already queued, so the
    host could never queue work ahead of the GPU. The pinned buffer is not
    reused before the copy has run (torch's caching host allocator records it).
    """
    device = torch.device(device)
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def check_same_device(op: str, first: str, tensors: dict[str, torch.Tensor | None]) -> None:
    """Raise ValueError (one line naming the op and the tensor) unless every tensor given is on the device of
    `tensors[first]`; None entries are skipped.

    NOTE: a Triton kernel reads every pointer as one device's memory: a tensor elsewhere is an illegal address on
    a GPU, and garbage read without a word in the CPU interpreter.
    """
    device = tensors[first].device
    for name, t in tensors.items():
        if t is not None and t.device != device:
            raise ValueError(f"{op}: {name} is on {t.device}, {first} on {device}; all must be on one device")
