"""The global gradient norm summed beside the backward, block by block (`training.grad_norm_overlap`).

The clip needs the norm of every gradient before any optimizer reads one, and summed after the backward it is a pass
over all of them with the GPU doing nothing else (k3-mini: 4.1 GB of float32 gradients, ~1.5 ms of an H100 update).
But a block's gradients are final as soon as the backward has left that block. Here each parameter's
post-accumulate-grad hook counts in; when the last parameter of a block has its gradient, that block's sums of
squares are launched on a second CUDA stream, so they run beside the backward of the blocks before it, and the
trainer reads one [N] vector of squares at the end.

Blocks are runs of `model.named_parameters()` under one top-level child (`tok_embeddings`, `layers.3`, `norm`,
`output`): the backward finishes them one after another. Only the last micro-batch's backward counts (earlier
ones are still adding up). A parameter that gets no gradient never counts in, so its block is summed at `join`,
on the current stream, from the gradients that exist. On CPU there is no second stream: each block is summed as the
backward leaves it, in order; the numbers are the same.

Every slot of the squares is written in every update (zero for a parameter without a gradient), and the invariant
check gradient_scale.grad_norm_audit recomputes the norm from the gradients on its updates.
One process only: sharded gradients (FSDP2, expert parallelism) need their reductions (`grad_norm_and_clip_coef`).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from titan_k3.config import ConfigError
from titan_k3.models.k3.impl import KernelChoice
from titan_k3.parallel.distributed import clip_coefficient, squares_each


def grad_norm_overlap_choice(cfg, world_size: int) -> KernelChoice | None:
    """The kernel report's `grad_norm` line for training.grad_norm_overlap = true; job.strict refuses its fallback."""
    if not cfg.training.grad_norm_overlap:
        return None
    if world_size == 1:
        return KernelChoice("grad_norm", "overlap", "overlap", False, "each block's squares summed beside the backward")
    off = f"one process only; this run has {world_size} (sharded gradients need their reductions)"
    if cfg.job.strict:
        raise ConfigError(f"job.strict = true and training.grad_norm_overlap falls back to 'after backward': {off}")
    return KernelChoice("grad_norm", "overlap", "after backward", True, off)


def block_of(name: str) -> str:
    """The top-level block of a parameter name: 'layers.3.ffn.w1' -> 'layers.3', 'output.weight' -> 'output'."""
    parts = name.split(".")
    return ".".join(parts[:2]) if len(parts) > 2 and parts[1].isdigit() else parts[0]


class OverlappedGradNorm:
    """Sums of squares of `model`'s gradients, each block's launched as the backward finishes it.

    Per update: `arm()` before the last micro-batch's backward, `join()` after it (both inside the step's CUDA
    graph when there is one: the hooks' side-stream work is captured with it), then `norm_and_clip_coef(max_norm)`.
    """

    def __init__(self, model: nn.Module, device: torch.device):
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.params = [p for _, p in named]
        self.squares = torch.zeros(len(named), device=device, dtype=torch.float32)
        """[N] float32: each parameter's squared gradient norm, in `params` order (zero: no gradient)."""
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.blocks: list[tuple[int, int]] = []
        """(start, end) of each block in `params`."""
        for i, (name, _) in enumerate(named):
            if not self.blocks or block_of(name) != block_of(named[self.blocks[-1][0]][0]):
                self.blocks.append((i, i + 1))
            else:
                self.blocks[-1] = (self.blocks[-1][0], i + 1)
        self._left: list[int] = []
        self._armed = False
        self._handles = []
        for b, (start, end) in enumerate(self.blocks):
            for p in self.params[start:end]:
                self._handles.append(p.register_post_accumulate_grad_hook(lambda _p, b=b: self._arrived(b)))

    def arm(self) -> None:
        """The next backward is the update's last: its gradients are final as each block finishes."""
        self._left = [end - start for start, end in self.blocks]
        self._armed = True

    def _arrived(self, block: int) -> None:
        if not self._armed:
            return
        self._left[block] -= 1
        if self._left[block] == 0:
            self._sum(block, self.stream)

    def _sum(self, block: int, stream: torch.cuda.Stream | None) -> None:
        start, end = self.blocks[block]
        grads = [p.grad for p in self.params[start:end]]
        have = [i for i, g in enumerate(grads) if g is not None]
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(stream.device))  # the gradients the backward just wrote
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            squares = self.squares[start:end]
            if len(have) == len(grads):
                squares.copy_(squares_each(grads))
                return
            # NOTE: slot by slot (no index tensor: a host-to-device copy cannot be captured); only a block some
            # parameter of which got no gradient comes here, at join.
            squares.zero_()
            for i, square in zip(have, squares_each([grads[i] for i in have]) if have else []):
                squares[i].copy_(square)

    def join(self) -> None:
        """After the last backward: sum the blocks some parameter of which got no gradient, and wait for the stream."""
        assert self._armed, "join() without arm(): no backward was counted"
        for block, left in enumerate(self._left):
            if left > 0:
                self._sum(block, None)
        if self.stream is not None:
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)
        self._armed = False

    def norm_and_clip_coef(self, max_norm: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(global gradient norm, clip coefficient), float32 scalars on the device, as `grad_norm_and_clip_coef`."""
        norm = self.squares.sum().sqrt()
        return norm, clip_coefficient(norm, max_norm)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
