"""Validation loss on the held-out split, distributed, outside the training clock.

The evaluated set is the first `n_batches` global batches of a freshly built
validation loader, so every evaluation sees the same sequences; each data-
parallel rank takes its share, and the summed loss and the valid-target count
are all-reduced in float64, so the result does not depend on the number of
ranks beyond summation order.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist


def validation_split_tokens(dataset: str) -> int:
    """Tokens in the dataset's validation split (0 when it has none); a dataset that does not open (its index
    damaged, a shard missing) is the loader's one line."""
    from titan_k3.data.shards import open_dataset

    if dataset == "embedded":
        from titan_k3.data.corpus import ensure_embedded_dataset

        dataset = str(ensure_embedded_dataset())
    opened = open_dataset(dataset, verify="size")
    return sum(len(s.tokens) for s in opened.shards.get("validation", []))


def validation_batches(dataset: str, tokenizer, seq_len: int, global_batch: int, n_batches: int,
                       dp_rank: int, dp_world: int, seed: int) -> Iterator:
    """This rank's share of the first `n_batches` global batches of `global_batch` validation sequences.

    The loader is built afresh on every call, so the same seed always yields the
    same sequences; it gives global sequence i of a batch to one rank only, and
    the ranks' shares together are exactly the single-rank batch. The mixture is
    the validation split's natural token proportions, whatever the training mixture.
    """
    if global_batch % dp_world:
        raise ValueError(f"eval batch of {global_batch} sequences: must be a multiple of the {dp_world} data-parallel ranks")
    from titan_k3.data.loader import build_dataloader

    loader = build_dataloader(dataset, tokenizer, seq_len, global_batch // dp_world, dp_rank, dp_world, seed,
                              split="validation", prefetch=0, prepared_weights=False)
    return _take(loader, n_batches)


def _take(loader, n: int) -> Iterator:
    try:
        for _ in range(n):
            yield next(loader)
    finally:
        loader.close()


@torch.no_grad()
def validation_loss(model, batch_inputs, batches: Iterable, device: torch.device, dp_group=None,
                    autocast=None) -> dict[str, float]:
    """Mean next-token loss over `batches` (of all ranks in `dp_group`) -> {"val_loss", "val_tokens"}.

    batch_inputs: the model family's `ModelSpec.batch_inputs`, (loader batch, device) -> the forward's
    positional arguments, as the trainer feeds them.
    """
    was_training = model.training
    model.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=device)
    try:
        for b in batches:
            ctx = autocast if autocast is not None else torch.autocast(device.type, enabled=False)
            with ctx:
                out = model(*batch_inputs(b, device))
            totals[0] += out.loss_sum.double()
            totals[1] += out.n_valid.double()
    finally:
        model.train(was_training)
    if dp_group is not None:
        dist.all_reduce(totals, group=dp_group)
    loss_sum, n_valid = totals.tolist()
    return {"val_loss": loss_sum / max(n_valid, 1.0), "val_tokens": n_valid}
