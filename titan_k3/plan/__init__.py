"""Planning a run before buying it: per-rank memory, collectives and update time for a config on a cluster.

Torch-free, so the control service can plan a run it has not launched. `python -m titan_k3.tools.plan`
is the command line; docs/scaling-k3.md is its answer for the full K3 flavor.
"""

from titan_k3.plan.cluster import Cluster
from titan_k3.plan.costs import CostTable
from titan_k3.plan.estimate import Estimate, Layout, estimate
from titan_k3.plan.search import Verdict, plan, smallest_cluster

__all__ = ["Cluster", "CostTable", "Estimate", "Layout", "Verdict", "estimate", "plan", "smallest_cluster"]
