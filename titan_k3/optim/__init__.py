"""Optimizers of a titan_k3 run: Per-Head Muon + AdamW, LR schedules, QK-Clip (docs/k3.md §6, §7)."""

from titan_k3.optim.builder import Optimizers, build_optimizers
from titan_k3.optim.lr_schedule import LRSchedule, lr_factor
from titan_k3.optim.muon import PerHeadMuon, muon_update
from titan_k3.optim.orthogonalise import newton_schulz
from titan_k3.optim.qk_clip import qk_clip_
from titan_k3.optim.spec import ParamSpec

__all__ = [
    "LRSchedule",
    "Optimizers",
    "ParamSpec",
    "PerHeadMuon",
    "build_optimizers",
    "lr_factor",
    "muon_update",
    "newton_schulz",
    "qk_clip_",
]
