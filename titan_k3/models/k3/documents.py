"""Packed-document bookkeeping shared by every layer of one forward.

A microbatch [B, T] with document boundaries `cu_seqlens` (int64 [N+1] over the
flattened B*T tokens, every row start a boundary) is processed as one packed
row of B*T tokens for KDA and with a document mask for MLA, so no state and no
attention ever crosses a document. MLA reads the mask either dense (for
scaled_dot_product_attention) or as flex_attention's BlockMask, whose empty
blocks (across documents, above the diagonal) are never computed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

from kernels.device import host_to_device


def causal_mask_mod(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def document_causal_mask_mod(doc_BT: torch.Tensor):
    """flex_attention mask_mod: causal and same document, read from doc_BT int64 [B, T]."""

    def mask_mod(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (doc_BT[b, q_idx] == doc_BT[b, kv_idx])

    return mask_mod


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
    _mask: torch.Tensor | None = None
    _block_mask: BlockMask | None = None

    @staticmethod
    def build(batch: int, seq_len: int, cu_seqlens: torch.Tensor | None, device: torch.device) -> "Documents":
        """Validate the boundaries and derive positions and document ids.

        NOTE: pass cu_seqlens on the host (the loader makes it there): reading
        a device tensor here, and in every KDA layer after, would stall the
        host until the GPU finished all earlier work, so it could not queue
        this forward while the previous optimizer step runs.
        """
        n = batch * seq_len
        if cu_seqlens is None:
            pos = torch.arange(seq_len, device=device).expand(batch, seq_len)
            doc = torch.arange(batch, device=device)[:, None].expand(batch, seq_len)
            return Documents(None, pos, doc)
        host = cu_seqlens.to(device="cpu", dtype=torch.int64)
        if host.ndim != 1 or host.numel() < 2 or int(host[0]) != 0 or int(host[-1]) != n:
            raise ValueError(f"cu_seqlens must be int64 [N+1] from 0 to B*T={n}, got {host.tolist()[:8]}...")
        if not torch.isin(torch.arange(0, n, seq_len), host).all():
            raise ValueError("cu_seqlens must contain every row start (a document never spans two rows)")
        cu = host_to_device(host, device)
        idx = torch.arange(n, device=device)
        doc = torch.searchsorted(cu, idx, right=True) - 1
        pos = idx - cu[doc]
        return Documents(cu, pos.view(batch, seq_len), doc.view(batch, seq_len), host)

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
        are whole documents). Built once per forward on the model's device, without reading anything back to the host."""
        if self._block_mask is None:
            B, T = self.doc_BT.shape
            device = self.doc_BT.device
            if self.cu_seqlens is None:
                self._block_mask = create_block_mask(causal_mask_mod, None, None, T, T, device=device)
            else:
                self._block_mask = create_block_mask(document_causal_mask_mod(self.doc_BT), B, None, T, T, device=device)
        return self._block_mask
