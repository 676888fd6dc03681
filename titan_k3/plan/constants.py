"""The planner's calibrated constants: each one fitted to named measurements, or an assumption said out loud.

tests/unit/test_plan.py refits the fitted ones from the measurements in titan_k3/plan/calibration.py and
fails if a value here drifts from its fit, then checks predictions at points the fit did not use.
"""

# Fitted (calibration.FIT_POINTS):
COMPUTE_EFFICIENCY = 0.270
"""Share of the 790 TFLOP/s matmul rate a sublayer without a measured cost reaches (its analytic FLOPs /
time), the residual mixes, norms and routing the FLOP count does not see included; fitted with the next
constant to k3-mini's one-H200 updates of 2 x B8 and 2 x B16 at T4096 (332.3 and 617.9 ms)."""
MICROBATCH_OVERHEAD_S_PER_LAYER = 0.834e-3
"""Seconds per micro-batch and layer that do not grow with its tokens (launches, host work, small
kernels): why larger micro-batches run faster per token (the same fit)."""
ACTIVATION_FACTOR = 1.357
"""Measured activation memory / the saved tensors counted from the layer code (shapes.kind_saved); fitted to
k3-mini's one-H200 peak at B8 T4096 (39.1 GiB). Above 1: autograd keeps inputs and intermediates the count
treats as shared or recomputed, and the caching allocator rounds blocks up."""
ALL_GATHER_EFFICIENCY = 0.387
"""NCCL all-gather bytes / (link rate x time): the bf16 all-gather of k3-mini's parameters on two NVLinked
H200s took 5.8 ms for 1.01 GB per rank at 450 GB/s."""
REDUCE_SCATTER_EFFICIENCY = 0.632
"""The same for reduce-scatter: k3-mini's float32 gradients, 7.1 ms for 2.02 GB per rank."""
COLLECTIVE_LATENCY_S = 0.09e-3
"""Seconds of a small collective inside a node (a small all-reduce on two NVLinked H200s: ~0.09 ms)."""

# Measured once on the profiled step (benchmarks/results/profiles/profile-scaling-1gpu-b16-rank0-f11eedc.txt):
NEWTON_SCHULZ_EFFICIENCY = 0.35
"""Per-Head Muon's Newton-Schulz reached 5.44 TFLOP in 19.6 ms of GPU time on k3-mini (0.35 of 790)."""

# Assumptions (not measured):
INTER_NODE_LATENCY_S = 0.02e-3 + COLLECTIVE_LATENCY_S
"""A collective that crosses nodes: the NVLink latency plus ~20 us of network (not measured)."""
OPTIMIZER_BYTES_PER_PARAM = {"muon": 24, "adamw": 32, "norm": 4}
"""Memory traffic of the optimizers' elementwise passes per parameter (read gradient and state, write state
and parameter, in float32), and of the gradient-norm pass."""
GLU_BYTES_PER_SLOT_PER_F = 16
"""The all-gather EP dispatch runs the GLU kernels over every slot of the group (other ranks' slots read
and write empty tiles): ~16 bytes per slot and unit of expert hidden width, forward + backward."""
HOST_BOUND_TOKENS = 65536
"""Below this many tokens per micro-batch and GPU, sharded ranks were host-bound on H200s (two GPUs at
32K tokens: 0.77-0.88 of twice one GPU; at 64K: 1.00); the planner does not model host time and warns."""
