"""The dense bf16 peak that MFU divides by: the device's datasheet figure, or the run's metrics.peak_tflops.

MFU read against another device's peak is a wrong number that looks right (an A100 against an H100's 989 TFLOP/s
reads a third of its true utilisation), so the peak follows the device: from the table below by the CUDA device's
name, or the configured value. A device the table does not know, and a CPU, read MFU against the H100/H200 figure,
and the run's start-up line says so and names the key to set.
"""

from __future__ import annotations

import torch

FALLBACK_TFLOPS = 989.0
"""H100 SXM and H200: dense bf16 with float32 accumulation (the figure MFU conventionally uses)."""

DATASHEET_TFLOPS = (
    # (a piece of torch.cuda.get_device_name(), dense bf16 TFLOP/s); the first piece found wins
    ("H200", 989.0),
    ("H100 NVL", 835.0),
    ("H100 PCIe", 756.0),
    ("H100", 989.0),  # SXM: "NVIDIA H100 80GB HBM3"
    ("A100", 312.0),
    ("L40S", 362.0),
    ("L4", 121.0),
)


def device_peak(configured: float, device: torch.device) -> tuple[float, str]:
    """(TFLOP/s per device, where the figure comes from, in words) for `configured` (metrics.peak_tflops; 0: the
    device's) on `device`."""
    if configured > 0:
        return configured, "metrics.peak_tflops"
    if device.type != "cuda":
        return FALLBACK_TFLOPS, (f"a {device.type} has no datasheet bf16 peak: MFU reads against the H100/H200 "
                                 "figure; set metrics.peak_tflops for another")
    name = torch.cuda.get_device_name(device)
    for piece, tflops in DATASHEET_TFLOPS:
        if piece in name:
            return tflops, f"the {name}'s dense bf16 datasheet peak"
    return FALLBACK_TFLOPS, (f"the {name} is not in titan_k3/metrics/peaks.py's table: MFU reads against the "
                             "H100/H200 figure; set metrics.peak_tflops to this device's dense bf16 peak")
