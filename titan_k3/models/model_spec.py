"""What a model family hands the trainer: a `ModelSpec` and the `StepHooks` it attaches to a built model.

The pattern is TorchTitan's train spec: the trainer knows a model only through
this bundle (its flavors, how to build it, which kernels it runs, how to count
it, what it needs done around each update), so adding a family touches its own
folder, its shapes in titan_k3/spec.py and one `register_model` call
(titan_k3/models/registry.py). Torch-free: annotations only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol

if TYPE_CHECKING:
    import torch
    from torch import nn


class StepHooks(Protocol):
    """A built model's own work around each update, in the order the trainer calls it."""

    qk_clip_max_logits: dict[int, "torch.Tensor"]
    """Layer -> per-head max logit of the last update, identical on every data-parallel rank (the invariant
    checks compare it); empty for a model without QK-Clip."""

    def bind_optimizers(self, optimizers) -> None:
        """Once, when the optimizers (titan_k3/optim/builder.py:Optimizers) are built, before any update."""

    def before_forward(self) -> None:
        """Before each update's first forward (and the invariants' probe), and before each evaluation."""

    def after_backward(self) -> None:
        """After each micro-batch's backward, before the next micro-batch's forward."""

    def after_step(self, skip: "torch.Tensor") -> None:
        """After the optimizer step; `skip` (bool, on the device) says the update was skipped."""


@dataclass(frozen=True)
class ModelSpec:
    name: str
    """The `model.name` that selects it."""
    flavors: Mapping[str, Any]
    """Flavor name -> the family's argument object (its shapes are data in titan_k3/spec.py)."""
    card_flavor: str
    """The published shape, counted beside the run's own at start-up."""
    args: Callable[[str, int], Any]
    """(flavor, vocab_size; 0 keeps the flavor's) -> argument object."""
    resolve_kernels: Callable[[Any, "torch.device", Any, "torch.dtype"], Any]
    """(the [kernels] section, device, args, the dtype the layers compute in on a GPU,
    titan_k3/eval/runner.py:training_dtype) -> the implementation of each fast path, with `.choices` (every
    KernelChoice, for the kernel report) and `.fallbacks`."""
    build: Callable[[Any, Any, Any], "nn.Module"]
    """(args, kernels, the [model] section) -> the model, on the current default device (the meta device first)."""
    count_params: Callable[[Any], Any]
    """args -> a count with `.total` and `.active` parameters."""
    flops_per_token: Callable[[Any, int], float]
    """(args, seq_len) -> training FLOPs per token (MFU's numerator per token)."""
    routed_experts: Callable[[Any], int]
    """args -> routed experts per MoE layer (what expert parallelism splits)."""
    batch_inputs: Callable[[Any, "torch.device"], tuple]
    """(a loader batch, device) -> the positional arguments of the model's training forward."""
    step_hooks: Callable[..., StepHooks]
    """(model, cfg, device, dp_group) -> the hooks of this built model; also sets it up for training."""
    graph_inputs: Callable[..., tuple] | None = None
    """(a loader batch, device, max_documents, into) -> the same arguments as `batch_inputs` in tensors whose shapes
    do not depend on the batch (document metadata sized for max_documents), which a CUDA graph of the step reads:
    newly made when `into` is None, else the batch's values written into `into` (an earlier result), which is
    returned. Raises ValueError when the batch has more than max_documents documents. None: the family has no
    fixed-shape inputs and its steps are not captured."""
