"""The router's selection (the k largest biased scores of each token, ties to the lowest expert id) and
Quantile Balancing's two histograms (how often each expert was chosen; each expert's margins).

`top_k_rows(x, k)` is the Triton path (CUDA, or the CPU interpreter under TRITON_INTERPRET=1): one pass per
block of tokens with the row in registers, registered as a torch.library custom op with no autograd (the
router selects under torch.no_grad); `reference.top_k_rows_reference` (same arguments) is the ground truth
and the CPU path.

`expert_counts(ids, n)` (int64 [n]) and `expert_margin_histogram(s, bias, alpha, half_range, n_bins)`
(int32 [E, n_bins]) count privately per program and add once (kernels/router/histogram.py), where the
reference's index_add makes one contended global atomic per element; their references are
`expert_counts_reference` and `expert_margin_histogram_reference`, equal counts on the same inputs.
"""

from kernels.router import reference
from kernels.router.ops import expert_counts, expert_margin_histogram, top_k_rows
from kernels.router.reference import expert_counts_reference, expert_margin_histogram_reference, top_k_rows_reference

__all__ = [
    "expert_counts", "expert_counts_reference", "expert_margin_histogram", "expert_margin_histogram_reference",
    "reference", "top_k_rows", "top_k_rows_reference",
]
