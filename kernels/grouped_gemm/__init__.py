"""Grouped expert GEMMs for the LatentMoE: `grouped_mm`, `moe_experts`, `situ_glu`.

`reference` holds the pure-PyTorch versions (the tests' ground truth and the
model's CPU path).
"""

from kernels.grouped_gemm import reference
from kernels.grouped_gemm.reference import situ_glu

__all__ = ["reference", "situ_glu"]
