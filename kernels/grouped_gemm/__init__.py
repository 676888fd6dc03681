"""Grouped expert GEMMs for the LatentMoE: `grouped_mm`, `moe_experts`, `situ_glu`.

`grouped_mm` and `moe_experts` are the Triton versions (CUDA, or the CPU
interpreter under TRITON_INTERPRET=1), registered as torch.library custom ops;
`reference` holds the pure-PyTorch versions (the tests' ground truth and the
model's CPU path).
"""

from kernels.grouped_gemm import reference
from kernels.grouped_gemm.ops import grouped_mm, moe_experts
from kernels.grouped_gemm.reference import route_permutation, situ_glu

__all__ = ["grouped_mm", "moe_experts", "reference", "route_permutation", "situ_glu"]
