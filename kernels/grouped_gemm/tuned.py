"""Known autotune winners: a key measured before compiles its winning config alone.

On a fresh machine `triton.autotune` compiles and times every candidate of each new key: k3-mini's six expert
GEMM keys cost 18 compiles (3 candidates each) before the first update. For keys measured on a GPU
architecture, `prune_to_tuned` hands Triton the winner alone; any other key, dtype or GPU autotunes as before.
"""

from __future__ import annotations

import torch

# (kernel, compute capability, dtype of the first operand, key values) -> index into that kernel's candidates.
# Winners of the H200 (sm_90) autotune at k3-mini's expert shapes (Triton 3.6, bf16): the timings behind each
# pick are in benchmarks/results/moe.md (session 14's sweep of 10-12 candidates per kernel).
TUNED: dict[tuple, int] = {
    ("mm", (9, 0), torch.bfloat16, (544, 256, 176, False, False)): 3,  # the w2 GEMM
    # the GLU backward's dh GEMM, dy rows gathered (2026-12-03 autotune: 0.227 ms against 0.292 / 0.297 / 0.306)
    ("mm", (9, 0), torch.bfloat16, (256, 544, 176, True, False)): 0,
    ("mm_dual", (9, 0), torch.bfloat16, (544, 256, 176, False, True)): 3,
    # the w2 weight gradient, dy rows gathered (2026-12-03 autotune: 0.191 ms against 0.200 / 0.207 / 0.245)
    ("wgrad", (9, 0), torch.bfloat16, (544, 256, 176, False, False, True)): 0,
    ("wgrad_dual", (9, 0), torch.bfloat16, (256, 544, 176, True, True, False)): 3,
    ("glu_up", (9, 0), torch.bfloat16, (256, 544, 176, True)): 2,
}


def prune_to_tuned(kernel: str, key: list[str]):
    """An `early_config_prune` for triton.autotune: [the known winner] for a measured key, else every candidate."""

    def prune(configs, named_args, **kwargs):
        args = {**named_args, **kwargs}
        first = next(iter(named_args.values()))
        device = getattr(first, "device", None)
        if device is None or device.type != "cuda":
            return configs
        entry = (kernel, torch.cuda.get_device_capability(device), first.dtype, tuple(args[k] for k in key))
        index = TUNED.get(entry)
        return configs if index is None or index >= len(configs) else [configs[index]]

    return prune
