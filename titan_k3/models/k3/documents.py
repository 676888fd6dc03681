"""Packed-document bookkeeping shared by every layer of one forward.

A microbatch [B, T] with document boundaries `cu_seqlens` (int64 [N+1] over the
flattened B*T tokens, every row start a boundary) is processed as one packed
row of B*T tokens for KDA and with a document mask for MLA, so no state and no
attention ever crosses a document. MLA reads the documents as int32 boundaries
(flash attention's variable-length kernel: each document its own causal
sequence), as a dense mask (for scaled_dot_product_attention) or as
flex_attention's BlockMask, whose empty blocks (across documents, above the
diagonal) are never computed. For a CUDA graph of the step, `build` pads the
boundaries with empty documents to a fixed count, so that no tensor here
changes shape from batch to batch, and `copy_` writes each batch into them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn.attention.flex_attention import BlockMask

from kernels.device import host_to_device
from kernels.kda.common import chunk_layout


FLEX_BLOCK = 128
"""flex_attention's block size (rows and columns of one BlockMask entry)."""


def causal_mask_mod(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def document_causal_mask_mod(doc_BT: torch.Tensor):
    """flex_attention mask_mod: causal and same document, read from doc_BT int64 [B, T]."""

    def mask_mod(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (doc_BT[b, q_idx] == doc_BT[b, kv_idx])

    return mask_mod


class OnHost:
    """A host tensor passed to the model's forward that must reach it on the host.

    FSDP2's root module copies every tensor argument of forward to the GPU
    before running it (a blocking copy from pageable memory), and reading the
    document boundaries back on the host is then a second one, which waits
    for all queued GPU work: two host stalls per micro-batch (benchmarks/host_syncs.py
    found both). FSDP2 passes objects that are not tensors, tuples, lists or
    dicts through untouched, so the boundaries travel inside this one.
    """

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor

    @staticmethod
    def wrap(tensor: torch.Tensor | None) -> "OnHost | None":
        return None if tensor is None else OnHost(tensor)


@dataclass
class Documents:
    cu_seqlens: torch.Tensor | None
    """int64 [N+1] boundaries over the flattened tokens, on the model's device, or None (each row is one document)."""
    pos_BT: torch.Tensor
    """int64 [B, T] position of each token inside its document."""
    doc_BT: torch.Tensor
    """int64 [B, T] document index of each token (global over the microbatch)."""
    cu_seqlens_host: torch.Tensor | None = None
    """The same boundaries on the host: kernels that need the document lengths read them here, not from the device."""
    cu_seqlens_i32: torch.Tensor | None = None
    """The same boundaries as int32 on the model's device (flash attention's variable-length kernel reads these)."""
    kda_chunks: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    """Our KDA kernels' chunk layout on the model's device (kernels.kda.common.chunk_layout): cu_seqlens int32 [N+1],
    chunk_indices int32 [NT, 2], chunk_offsets int32 [N+1]; built once per forward for every KDA layer."""
    _mask: torch.Tensor | None = None
    _block_mask: BlockMask | None = None

    @staticmethod
    def build(batch: int, seq_len: int, cu_seqlens: torch.Tensor | OnHost | "Documents" | None, device: torch.device,
              capacity: int | None = None) -> "Documents":
        """Validate the boundaries and derive positions and document ids (a `Documents` passes through as it is).

        capacity: pad to exactly this many documents with empty ones at the end (at least one; whole-row batches
        become packed ones), so that every tensor here has the same shape whatever the batch: what a CUDA graph
        replays (`copy_` writes a new batch into the captured tensors). Positions and document ids do not change.

        NOTE: pass cu_seqlens on the host (the loader makes it there), through
        an FSDP2 root wrapped in `OnHost`: reading a device tensor here, and in
        every KDA layer after, would stall the host until the GPU finished all
        earlier work, so it could not queue this forward while the previous
        optimizer step runs.
        """
        n = batch * seq_len
        if isinstance(cu_seqlens, Documents):
            if tuple(cu_seqlens.pos_BT.shape) != (batch, seq_len):
                raise ValueError(f"Documents of shape {tuple(cu_seqlens.pos_BT.shape)} passed for a batch of "
                                 f"{(batch, seq_len)}")
            return cu_seqlens
        if isinstance(cu_seqlens, OnHost):
            cu_seqlens = cu_seqlens.tensor
        if cu_seqlens is None and capacity is not None:
            cu_seqlens = torch.arange(0, n + 1, seq_len)
        if cu_seqlens is None:
            pos = torch.arange(seq_len, device=device).expand(batch, seq_len)
            doc = torch.arange(batch, device=device)[:, None].expand(batch, seq_len)
            return Documents(None, pos, doc)
        host = cu_seqlens.to(device="cpu", dtype=torch.int64)
        if host.ndim != 1 or host.numel() < 2 or int(host[0]) != 0 or int(host[-1]) != n:
            raise ValueError(f"cu_seqlens must be int64 [N+1] from 0 to B*T={n}, got {host.tolist()[:8]}...")
        if not torch.isin(torch.arange(0, n, seq_len), host).all():
            raise ValueError("cu_seqlens must contain every row start (a document never spans two rows)")
        # The KDA layout checks the boundaries ascend and pads its chunk table itself (one line if over capacity).
        kda_chunks = chunk_layout(batch, seq_len, host, device, capacity)[:3]
        if capacity is not None:
            host = torch.cat([host, host.new_full((capacity + 1 - host.numel(),), n)])
        cu = host_to_device(host, device)
        cu_i32 = host_to_device(host.to(torch.int32), device)
        # NOTE: the number of documents changes from batch to batch; a compiled sublayer that reads these tensors
        # would otherwise compile once for the first count and again for the second.
        for t in (cu_i32, *kda_chunks):
            torch._dynamo.maybe_mark_dynamic(t, 0)
        idx = torch.arange(n, device=device)
        doc = torch.searchsorted(cu, idx, right=True) - 1
        pos = idx - cu[doc]
        return Documents(cu, pos.view(batch, seq_len), doc.view(batch, seq_len), host, cu_i32, kda_chunks)

    def copy_(self, src: "Documents") -> "Documents":
        """Write `src`'s values into these tensors, which keep their memory (a CUDA graph's inputs); returns self.

        Both must be packed and of one shape (`build` with the same capacity), and self must own its tensors
        (`owned`). The masks derived lazily are dropped: the next forward derives them again from the new values
        (a captured forward: on the device, in the graph).
        """
        if self.cu_seqlens is None or src.cu_seqlens is None or \
                [t.shape for t in self._tensors()] != [t.shape for t in src._tensors()]:
            raise ValueError("Documents.copy_: both must be packed documents of one shape and capacity, got "
                             f"{tuple(src.pos_BT.shape)} with {src.num_slots} slots into {tuple(self.pos_BT.shape)} "
                             f"with {self.num_slots}")
        for dst, new in zip(self._tensors(), src._tensors()):
            dst.copy_(new, non_blocking=True)
        self._mask = self._block_mask = None
        return self

    def owned(self) -> "Documents":
        """A copy of packed documents whose tensors are its own, safe to write into with `copy_` (a graph's inputs).

        NOTE: `build` hands out KDA chunk layouts from a cache shared by every batch of the same documents (and a
        host tensor may be the caller's): writing the next batch into those would corrupt that layout for every
        later batch that has it.
        """
        cu, pos, doc, host, cu_i32, *chunks = (t.clone() for t in self._tensors())
        return Documents(cu, pos, doc, host, cu_i32, tuple(chunks))

    def _tensors(self) -> tuple[torch.Tensor, ...]:
        """Every tensor of packed documents, in the order of the fields."""
        return (self.cu_seqlens, self.pos_BT, self.doc_BT, self.cu_seqlens_host, self.cu_seqlens_i32, *self.kda_chunks)

    @property
    def num_slots(self) -> int:
        """Documents counted by the boundaries, empty padding ones included (0 when rows are whole documents)."""
        return 0 if self.cu_seqlens is None else self.cu_seqlens.shape[0] - 1

    def attention_mask(self) -> torch.Tensor | None:
        """bool [B, 1, T, T]: causal and same document; None when rows are whole documents. Built once per forward."""
        if self.cu_seqlens is None:
            return None
        if self._mask is None:
            same_doc = self.doc_BT[:, :, None] == self.doc_BT[:, None, :]
            T = self.doc_BT.shape[1]
            causal = torch.ones(T, T, dtype=torch.bool, device=self.doc_BT.device).tril()
            self._mask = (same_doc & causal)[:, None]
        return self._mask

    def block_mask(self) -> BlockMask:
        """flex_attention's BlockMask, causal and same document, over [B, 1, T, T] ([1, 1, T, T], causal, when rows
        are whole documents). Built once per forward, on the host from the document boundaries (`document_blocks`)
        and sent with pinned copies: no mask_mod evaluation over T x T and nothing read back from the GPU.

        NOTE: the model builds it before its compiled sublayers run (K3Model.hidden), so they take it as an input;
        built lazily inside a compiled region, it runs eagerly (a graph break).
        """
        if self._block_mask is None:
            self._block_mask = self._build_block_mask()
        return self._block_mask

    @torch.compiler.disable
    def _build_block_mask(self) -> BlockMask:
        B, T = self.doc_BT.shape
        device = self.doc_BT.device
        if self.cu_seqlens_host is None:
            starts, mask_mod = torch.zeros(1, T, dtype=torch.int64), causal_mask_mod
        else:
            cu = self.cu_seqlens_host
            starts = torch.repeat_interleave(cu[:-1], cu.diff()).view(B, T) - torch.arange(B)[:, None] * T
            mask_mod = document_causal_mask_mod(self.doc_BT)
        tables = [host_to_device(t, device) for t in document_blocks(starts, FLEX_BLOCK)]
        return BlockMask.from_kv_blocks(*tables, BLOCK_SIZE=FLEX_BLOCK, mask_mod=mask_mod, seq_lengths=(T, T))


def document_blocks(starts_BT: torch.Tensor, block: int) -> tuple[torch.Tensor, ...]:
    """flex_attention block tables of causal, same-document attention, from each token's document start.

    starts_BT int64 [B, T] (host): the row index at which each token's document starts (0 when rows are whole
    documents). Query block i (rows [i*block, min((i+1)*block, T))) sees key blocks from the one holding its first
    row's document start up to itself. A key block j < i lies whole in the document of the block's last row, and
    is therefore fully visible to every row of it, iff j*block >= s_last (the last row's document start); every
    other visible block, the diagonal included, is partial (the mask_mod decides per element).
    Returns (kv_num_blocks int32 [B, 1, Q], kv_indices int32 [B, 1, Q, Q], full_kv_num_blocks, full_kv_indices),
    Q = ceil(T / block), indices ascending, unused slots 0.
    """
    B, T = starts_BT.shape
    Q = -(-T // block)
    i = torch.arange(Q)
    first = starts_BT[:, i * block] // block  # [B, Q]: first partial block
    last_start = starts_BT[:, torch.clamp((i + 1) * block, max=T) - 1]
    full_from = torch.minimum(-(-last_start // block), i)  # [B, Q]: full blocks are [full_from, i)
    j = torch.arange(Q)
    is_full = (j >= full_from[..., None]) & (j < i[:, None])  # [B, Q, Q]
    is_partial = (j >= first[..., None]) & (j <= i[:, None]) & ~is_full

    def table(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        counts = blocks.sum(-1).to(torch.int32)
        # NOTE: a stable sort puts the selected blocks first, in ascending order.
        indices = torch.sort((~blocks).to(torch.int8), dim=-1, stable=True).indices.to(torch.int32)
        indices = torch.where(j < counts[..., None], indices, 0)
        return counts[:, None], indices[:, None]

    return (*table(is_partial), *table(is_full))
