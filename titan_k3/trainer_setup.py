"""What the Trainer is built from, each checked before any work: the device, the CUDA allocator's settings, the
tokenizer and vocabulary, the evaluator, the kernels, the data loader, and the training state a resumed run starts
from. `python -m titan_k3.train --job.validate_only` runs the same functions, so it refuses what a run would.
"""

from __future__ import annotations

import dataclasses
import json
import os

import torch

from titan_k3.checkpoint.layout import META_FILE
from titan_k3.checkpoint.verify import ResumePlan
from titan_k3.config import ConfigError, JobConfig
from titan_k3.config.check import load_data_tokenizer
from titan_k3.config.errors import toml_value
from titan_k3.config.validate import parse_mixture
from titan_k3.eval.runner import Evaluator, training_dtype
from titan_k3.models.k3.impl import KernelChoice
from titan_k3.train_state import TrainState


def pick_device(cfg: JobConfig) -> torch.device:
    """training.device: the CPU, or this process's GPU (LOCAL_RANK under torchrun); 'auto' takes a GPU if one is
    visible."""
    want = cfg.training.device
    if want == "cuda" and not torch.cuda.is_available():
        raise ConfigError("config key 'training.device' = 'cuda': no CUDA device is visible")
    if want == "cpu" or (want == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))


EXPANDABLE = "expandable_segments:True"


def expandable_segments_to_set(cfg: JobConfig, device: torch.device) -> bool:
    """Whether training.expandable_segments is left for the trainer to set (on CUDA, PYTORCH_CUDA_ALLOC_CONF silent on
    it); ConfigError where that variable sets it otherwise."""
    if not cfg.training.expandable_segments or device.type != "cuda":
        return False
    current = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    if "expandable_segments" in current and EXPANDABLE not in current:
        raise ConfigError(f"config key 'training.expandable_segments' = true: PYTORCH_CUDA_ALLOC_CONF={current!r} "
                          "in the environment sets it otherwise; drop one of the two")
    return "expandable_segments" not in current


def set_allocator(cfg: JobConfig, device: torch.device) -> None:
    """training.expandable_segments: have CUDA's caching allocator grow one mapping per stream (before it starts)."""
    if not expandable_segments_to_set(cfg, device):
        return
    current = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    if torch.cuda.is_initialized():
        # NOTE: CUDA started before the trainer (an embedding process): the setting still applies to every
        # segment the allocator creates from here on.
        torch.cuda.memory._set_allocator_settings(EXPANDABLE)
    else:
        # The allocator reads this when CUDA starts; child processes (compile workers) inherit it.
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = ",".join(filter(None, (current, EXPANDABLE)))


def tokenizer_and_vocab(cfg: JobConfig):
    """(data.tokenizer loaded, the model's vocabulary: model.vocab_size, or 0's the tokenizer's rounded up to 64)."""
    tokenizer = load_data_tokenizer(cfg)
    vocab = cfg.model.vocab_size or -(-tokenizer.vocab_size // 64) * 64
    if vocab < tokenizer.vocab_size:
        raise ConfigError(f"config key 'model.vocab_size' = {vocab}: below the tokenizer's vocabulary of "
                          f"{tokenizer.vocab_size}")
    return tokenizer, vocab


def build_evaluator(cfg: JobConfig, tokenizer, device: torch.device, dp_rank: int = 0, dp_world: int = 1,
                    dp_group=None) -> Evaluator:
    """The run's Evaluator, which refuses eval.batch_size against the data-parallel ranks, a missing validation split
    and (as a ConfigError naming eval.tasks) a task file that does not parse."""
    try:
        return Evaluator(cfg, tokenizer, device, dp_rank=dp_rank, dp_world=dp_world, dp_group=dp_group)
    except ConfigError:
        raise
    except ValueError as e:
        raise ConfigError(f"config key 'eval.tasks' = {toml_value(cfg.eval.tasks)}: {e}") from None


def resolve_kernels(cfg: JobConfig, spec, device: torch.device, args, world_size: int | None = None):
    """The model's kernel choices on `device` for the run's compute dtype and `world_size` processes (None: WORLD_SIZE,
    1 outside torchrun); job.strict refuses the first fallback among them."""
    world = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else world_size
    kernels, shadows_off = cfg.kernels, None
    if kernels.expert_weight_shadows and world > 1:
        # NOTE: one process only: FSDP2 and expert parallelism shard the experts and gather them in bf16 already,
        # and the sharded Muon step writes no shadows (titan_k3/models/k3/expert_shadows.py).
        kernels = dataclasses.replace(kernels, expert_weight_shadows=False)
        shadows_off = (f"one process only; this run has {world} (its all-gather casts the experts, and the sharded "
                       "update pass writes no shadows)")
    impl = spec.resolve_kernels(kernels, device, args, training_dtype(cfg))
    if shadows_off is not None:
        impl.choices = [KernelChoice(c.op, "shadows", c.chosen, True, shadows_off) if c.op == "expert_weights" else c
                        for c in impl.choices]
    if cfg.job.strict and impl.fallbacks:
        first = impl.fallbacks[0]
        raise ConfigError(f"job.strict = true and {first.op} falls back to '{first.chosen}' (asked "
                          f"'{first.requested}'): {first.reason}")
    return impl


def build_loader(cfg: JobConfig, tokenizer, dp_rank: int, dp_world: int, prefetch: int):
    """The run's data loader for data-parallel rank `dp_rank` of `dp_world`."""
    from titan_k3.data.loader import build_dataloader

    t = cfg.training
    return build_dataloader(cfg.data.dataset, tokenizer, t.seq_len, t.local_batch_size, dp_rank, dp_world, t.seed,
                            mixture=parse_mixture(cfg.data.mixture), prefetch=prefetch)


def saved_train_state(cfg: JobConfig, resume: ResumePlan, loader) -> dict | None:
    """The TrainState.state_dict() the checkpoint the run resumes from recorded; None for a fresh start or initial
    weights (checkpoint.initial_load_path: the run's own count starts at 0).

    Its data position must fit this run's `loader`, which takes it (the checkpointer loads it again): one that does
    not (another seed or dataset, a batch that does not divide it) stops the run before its directory's config and
    manifest are rewritten, and --job.validate_only with the same line.
    """
    if resume.path is None or resume.initial:
        return None
    saved = json.loads((resume.path / META_FILE).read_text())["train"]
    if not cfg.training.fixed_batch:
        try:
            TrainState(data=loader).load_state_dict(saved)
        except ValueError as e:
            raise ValueError(f"checkpoint {resume.path}: {e}") from None
    return saved
