"""flash-linear-attention's own KDA test cases (benchmarks/kda_precision.py: FLA_CASES, fla's tolerances),
the small ones, on Triton's CPU interpreter in float32 against the float64 recurrence.

The full list runs on a GPU in bfloat16 and float16: tests/gpu/test_kda_fla_gpu.py.
"""

import warnings

import pytest
import torch

from benchmarks.kda_precision import FLA_CASES, FLA_DA_WARN, fla_errors

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The cases of at most 64 tokens x heads: seconds in the interpreter (the others take minutes there).
SMALL = [case for case in FLA_CASES if case.B * case.T * case.H <= 64]


def test_the_small_cases_cover_both_lists_and_the_fused_gate():
    assert {case.kind for case in SMALL} == {"chunk", "varlen"}
    assert any(case.gate_in_kernel and case.mask_p > 0 for case in SMALL)  # softplus gate, hard resets, packed


@pytest.mark.parametrize("case", SMALL, ids=lambda case: case.name)
def test_fla_case_float32(case):
    errors = fla_errors(case, torch.float32, DEVICE)
    for name, tol in case.tolerances.items():
        assert errors[name] < tol, (name, errors[name], tol)
    if "dA" in errors and errors["dA"] > FLA_DA_WARN[case.kind]:
        warnings.warn(f"{case.name}: dA {errors['dA']:.2e} above fla's warning level {FLA_DA_WARN[case.kind]}")
