"""One evaluation of a model: validation loss plus the multiple-choice tasks, as flat metrics.

The metric names, shared by metrics.jsonl, `python -m titan_k3.eval` and its
tables:

    val_loss              mean next-token loss over the validation batches (nats)
    val_tokens            valid targets it averaged over
    eval/<task>/acc       accuracy by summed log-likelihood
    eval/<task>/acc_norm  accuracy by log-likelihood per character of the choice

<task> is the task file's name without `.jsonl`.

In training they go into the metrics.jsonl record of the step evaluated (an
evaluation step is always a log step), so every reader keeps one record per
step with the usual keys; records of other steps carry no evaluation keys.
"""

from __future__ import annotations

import torch

from titan_k3.config import ConfigError, JobConfig
from titan_k3.eval.multiple_choice import load_task, model_loglikelihood, score_task
from titan_k3.eval.tasks import Example, task_name
from titan_k3.eval.validation import validation_batches, validation_loss, validation_split_tokens
from titan_k3.models.registry import get_model_spec
from titan_k3.spec import KDA_CHUNK


def training_autocast(cfg: JobConfig, device: torch.device):
    """The autocast context the trainer's forward runs under (bf16 on CUDA when asked), reusable."""
    return torch.autocast("cuda", dtype=torch.bfloat16,
                          enabled=device.type == "cuda" and cfg.training.compute_dtype == "bfloat16")


def training_dtype(cfg: JobConfig) -> torch.dtype:
    """The dtype the trainer's layers compute in on a GPU (training.compute_dtype): bf16 under `training_autocast`
    and as FSDP2's parameter dtype (titan_k3/parallel/parallelize.py), float32 otherwise; the kernel choice checks
    KDA's heads against it."""
    return torch.bfloat16 if cfg.training.compute_dtype == "bfloat16" else torch.float32


def load_tasks(spec: str) -> dict[str, list[Example]]:
    """'a.jsonl,b.jsonl' -> {task name: examples}; a bad file or a repeated name stops here."""
    tasks: dict[str, list[Example]] = {}
    for path in (p.strip() for p in spec.split(",")):
        if not path:
            continue
        name = task_name(path)
        if name in tasks:
            raise ValueError(f"task files {spec!r}: two files named {name!r} (metric names must differ)")
        tasks[name] = load_task(path)
    return tasks


class Evaluator:
    """Evaluates every `eval.interval` updates and after the last one (`eval.interval` = 0: never).

    Every data-parallel rank calls `run` at the same steps: validation batches
    are split over the ranks and all-reduced; the tasks are scored on every
    rank alike (a sharded model needs all ranks in each forward).
    """

    def __init__(self, cfg: JobConfig, tokenizer, device: torch.device, *, dp_rank: int = 0, dp_world: int = 1,
                 dp_group=None, val_steps: int | None = None, tasks: str | None = None, offline: bool = False):
        e = cfg.eval
        if val_steps is not None and val_steps < 0:
            raise ValueError(f"val_steps={val_steps}: must be >= 0")
        evaluates = offline or e.interval > 0
        # NOTE: only the validation batches are split over the ranks; with evaluation off (eval.interval = 0) the
        # default batch of 8 refused a world of 3, which never evaluates
        if evaluates and (e.steps if val_steps is None else val_steps) and e.batch_size % dp_world:
            raise ConfigError(f"config key 'eval.batch_size' = {e.batch_size}: must be a multiple of the "
                              f"{dp_world} data-parallel ranks")
        self.cfg, self.tokenizer, self.device = cfg, tokenizer, device
        self.dp_rank, self.dp_world, self.dp_group = dp_rank, dp_world, dp_group
        self.val_steps = e.steps if val_steps is None else val_steps
        self.tasks = load_tasks(e.tasks if tasks is None else tasks)
        self.autocast = training_autocast(cfg, device)
        self.batch_inputs = get_model_spec(cfg.model.name).batch_inputs
        # NOTE: the Triton KDA kernels take whole chunks; the reference takes any length.
        self.pad_to = 1 if cfg.kernels.kda == "torch" else KDA_CHUNK
        if self.val_steps and evaluates:
            self._check_split(dp_rank == 0)

    def _check_split(self, loud: bool) -> None:
        """No validation split stops here (before the run starts); a small one is said once."""
        have = validation_split_tokens(self.cfg.data.dataset)
        if have == 0:
            raise ConfigError(f"config key 'eval.steps' = {self.val_steps}: dataset {self.cfg.data.dataset!r} has no "
                              "validation split (prepare one, or set eval.steps = 0 for the tasks only)")
        read = self.val_steps * self.cfg.eval.batch_size * self.cfg.training.seq_len
        if loud and read > have:
            print(f"note: validation reads {read:,} tokens per evaluation but the validation split holds {have:,}: "
                  "its sequences repeat (the value stays deterministic)", flush=True)

    def due(self, step: int, last: bool) -> bool:
        return self.cfg.eval.interval > 0 and (step % self.cfg.eval.interval == 0 or last)

    def run(self, model) -> dict[str, float]:
        t, e = self.cfg.training, self.cfg.eval
        metrics: dict[str, float] = {}
        if self.val_steps:
            batches = validation_batches(self.cfg.data.dataset, self.tokenizer, t.seq_len, e.batch_size, self.val_steps,
                                         self.dp_rank, self.dp_world, t.seed)
            metrics.update(validation_loss(model, self.batch_inputs, batches, self.device, self.dp_group,
                                           self.autocast))
        if self.tasks:
            loglikelihood = model_loglikelihood(model, self.device, t.seq_len, self.pad_to, self.autocast)
            for name, examples in self.tasks.items():
                scores = score_task(examples, self.tokenizer.encode, loglikelihood)
                metrics[f"eval/{name}/acc"] = scores["acc"]
                metrics[f"eval/{name}/acc_norm"] = scores["acc_norm"]
        return metrics


def format_metrics(metrics: dict[str, float]) -> str:
    """One console line: 'val_loss 3.2100 | hellaswag acc 0.312 norm 0.330'."""
    parts = []
    if "val_loss" in metrics:
        parts.append(f"val_loss {metrics['val_loss']:.4f} ({int(metrics['val_tokens']):,} tokens)")
    for key in sorted(k for k in metrics if k.endswith("/acc")):
        name = key.split("/")[1]
        parts.append(f"{name} acc {metrics[key]:.3f} norm {metrics[f'eval/{name}/acc_norm']:.3f}")
    return " | ".join(parts) or "nothing evaluated"


def task_names(metrics: dict[str, float]) -> list[str]:
    return sorted(k.split("/")[1] for k in metrics if k.startswith("eval/") and k.endswith("/acc"))

