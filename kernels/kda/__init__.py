"""Kimi Delta Attention: chunked Triton kernels and their pure-PyTorch references."""

from kernels.kda.ops import chunk_kda
from kernels.kda.reference import chunk_kda_reference, kda_gate, l2norm, recurrent_kda

__all__ = ["chunk_kda", "chunk_kda_reference", "kda_gate", "l2norm", "recurrent_kda"]
