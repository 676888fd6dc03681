"""Known autotune winners: a key measured before compiles its winning config alone.

On a fresh machine `triton.autotune` compiles and times every candidate of each new key: k3-mini's six expert
GEMM keys cost 18 compiles (3 candidates each) before the first update. For keys measured on a GPU
architecture, `prune_to_tuned` hands Triton the winner alone; any other key, dtype or GPU autotunes as before.
"""

from __future__ import annotations

import torch

# (kernel, compute capability, dtype of the first operand, key values) -> index into that kernel's candidates.
# Winners of the H200 (sm_90) autotune at k3-mini's expert shapes (Triton 3.6, bf16, 2026-11-30): the timings
# behind each pick are in benchmarks/results/grouped_gemm.md (session 8).
TUNED: dict[tuple, int] = {
    ("mm", (9, 0), torch.bfloat16, (544, 256, 176, False, False)): 0,  # 0.165 ms; 0.208 / 0.183
    ("mm_dual", (9, 0), torch.bfloat16, (544, 256, 176, False, True)): 1,  # 0.356 ms; 0.393 / 0.415
    ("wgrad", (9, 0), torch.bfloat16, (544, 256, 176, False, False)): 0,  # 0.160 ms; 0.171 / 0.196
    ("wgrad_dual", (9, 0), torch.bfloat16, (256, 544, 176, True, True)): 0,  # 0.359 ms; 0.405 / 0.374
    ("glu_up", (9, 0), torch.bfloat16, (256, 544, 176, True)): 0,  # 0.627 ms; 0.956 / 0.636
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
