"""Where Triton kernels run, and moving small host tensors to the GPU without stalling the host.

Shared by the kernels and the trainer.
"""

import os
import re

import torch


def triton_runs_on(device: torch.device | str) -> bool:
    """Triton kernels run on CUDA devices, and on the CPU only in Triton's interpreter (TRITON_INTERPRET=1)."""
    if torch.device(device).type == "cuda":
        return True
    if os.environ.get("TRITON_INTERPRET") != "1":
        return False
    # NOTE: imported here: the interpreter's own dependencies, needed only where it runs.
    import numpy
    import triton

    check_interpreter(triton.__version__, numpy.__version__)
    return True


def _major_minor(version: str) -> tuple[int, int]:
    """(major, minor) of a version string; the minor's leading digits only ('6rc1' is 6)."""
    major, minor = version.split(".")[:2]
    return int(major), int(re.match(r"\d*", minor).group() or 0)


def check_interpreter(triton_version: str, numpy_version: str) -> None:
    """Raise RuntimeError (one line) where Triton's interpreter cannot run a kernel of ours.

    NOTE: numpy 2.4 refuses int() of a one-element array, which the interpreter of Triton before 3.7 calls for
    every scalar used as an index or a loop bound: each kernel then stops deep inside Triton with "only
    0-dimensional arrays can be converted to Python scalars" (fixed in Triton 3.7).
    """
    if _major_minor(triton_version) < (3, 7) and _major_minor(numpy_version) >= (2, 4):
        raise RuntimeError(
            f"Triton {triton_version}'s interpreter (TRITON_INTERPRET=1) cannot run with numpy {numpy_version}: "
            "numpy 2.4 refuses the one-element arrays it converts to ints (fixed in Triton 3.7); install "
            "'numpy<2.4' or triton>=3.7")


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
