"""Checkpoints: DCP manager (atomic, async, reshardable resume) and export to the K3 release layout."""

from titan_k3.checkpoint.manager import CheckpointManager, CheckpointSaveError, build_checkpointer
from titan_k3.checkpoint.resume import check_compatible, check_resumable, load_model_weights, plan_resume

__all__ = ["CheckpointManager", "CheckpointSaveError", "build_checkpointer", "check_compatible", "check_resumable",
           "load_model_weights", "plan_resume"]
