"""Composable parallelism on torch's own stack: DeviceMesh, DTensor, FSDP2, all-to-all EP, AC, compile, FP8."""

from titan_k3.parallel.dims import ParallelDims
from titan_k3.parallel.distributed import (
    CompileWatch, Distributed, grad_norm_and_clip_coef, init_weights, setup_distributed,
    sum_replicated_grads,
)
from titan_k3.parallel.parallelize import parallelize, precision_fallbacks, set_microbatch_sync

__all__ = [
    "CompileWatch", "Distributed", "ParallelDims", "grad_norm_and_clip_coef", "init_weights",
    "parallelize", "precision_fallbacks", "set_microbatch_sync", "setup_distributed", "sum_replicated_grads",
]
