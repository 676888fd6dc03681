"""Runtime checks for silent distributed bugs: data, replicas, gradient scale (see checks.py)."""

from titan_k3.invariants.checks import CHECKS, Violation
from titan_k3.invariants.runner import InvariantRunner, InvariantViolationError, replicated_state

__all__ = ["CHECKS", "InvariantRunner", "InvariantViolationError", "Violation", "replicated_state"]
