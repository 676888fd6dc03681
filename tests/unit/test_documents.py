"""Packed-document bookkeeping: positions, document ids, validation, boundaries kept on the host, and the masks."""

import pytest
import torch
from torch.nn.attention.flex_attention import create_mask

from titan_k3.models.k3.documents import Documents, OnHost


def test_positions_and_documents_of_packed_rows():
    docs = Documents.build(2, 6, torch.tensor([0, 2, 6, 9, 12]), torch.device("cpu"))
    assert docs.pos_BT.tolist() == [[0, 1, 0, 1, 2, 3], [0, 1, 2, 0, 1, 2]]
    assert docs.doc_BT.tolist() == [[0, 0, 1, 1, 1, 1], [2, 2, 2, 3, 3, 3]]
    mask = docs.attention_mask()
    assert mask.shape == (2, 1, 6, 6) and not mask[0, 0, 2, 1] and mask[0, 0, 3, 2] and not mask[0, 0, 2, 3]


def test_boundaries_stay_on_the_host_whatever_the_model_device():
    """Kernels read document lengths from cu_seqlens_host: reading them from the device would stall the host."""
    docs = Documents.build(2, 6, torch.tensor([0, 2, 6, 9, 12]), torch.device("meta"))
    assert docs.cu_seqlens.device.type == "meta" and docs.pos_BT.device.type == "meta"
    assert docs.cu_seqlens_host.device.type == "cpu" and docs.cu_seqlens_host.tolist() == [0, 2, 6, 9, 12]


def test_boundaries_pass_fsdp2s_input_move_on_the_host_inside_on_host():
    """FSDP2's root copies every tensor argument of forward to its device (torch.distributed.utils._to_kwargs, the
    call its pre-forward makes): cu_seqlens would reach the model on the GPU, and reading it back stalls the host."""
    from torch.distributed.utils import _to_kwargs

    cu = torch.tensor([0, 2, 6, 9, 12])
    (moved,), _ = _to_kwargs((cu, OnHost(cu)), {}, torch.device("meta"), False)
    assert moved[0].device.type == "meta", "the input move no longer copies tensors: this test shows nothing"
    assert isinstance(moved[1], OnHost) and moved[1].tensor is cu
    docs = Documents.build(2, 6, moved[1], torch.device("meta"))
    assert docs.cu_seqlens_host.device.type == "cpu" and docs.cu_seqlens_host.tolist() == cu.tolist()
    assert OnHost.wrap(None) is None


@pytest.mark.parametrize("cu, message", [
    ([0, 5, 11], "from 0 to B\\*T=12"),
    ([0, 4, 12], "every row start"),
])
def test_bad_boundaries_stop_with_one_line(cu, message):
    with pytest.raises(ValueError, match=message):
        Documents.build(2, 6, torch.tensor(cu), torch.device("cpu"))


def test_block_mask_skips_blocks_across_documents():
    """Row 0: two documents of 128 tokens (one block each); row 1: one of 256. Blocks are 128 x 128."""
    docs = Documents.build(2, 256, torch.tensor([0, 128, 256, 512]), torch.device("cpu"))
    bm = docs.block_mask()
    assert bm is docs.block_mask()  # built once per forward
    assert bm.to_dense()[:, 0].tolist() == [[[1, 0], [0, 1]], [[1, 0], [1, 1]]]
    assert bm.full_kv_num_blocks[1, 0].tolist() == [0, 1]  # row 1's block (1, 0) is computed without the mask
    assert torch.equal(create_mask(bm.mask_mod, 2, 1, 256, 256, device="cpu"), docs.attention_mask())


def test_block_mask_of_whole_row_documents_is_causal():
    bm = Documents.build(2, 200, None, torch.device("cpu")).block_mask()
    causal = torch.ones(200, 200, dtype=torch.bool).tril()
    assert torch.equal(create_mask(bm.mask_mod, 1, 1, 200, 200, device="cpu")[0, 0], causal)


@pytest.mark.parametrize("seed, T", [(0, 512), (1, 300), (2, 1000), (3, 129)])
def test_block_tables_match_an_evaluation_of_the_mask_over_every_element(seed, T):
    """The BlockMask built on the host from the boundaries visits exactly the blocks that hold an allowed (causal,
    same-document) element, as torch's create_block_mask finds by evaluating the mask_mod everywhere; a block it
    marks full (run without the mask_mod) is allowed in every element; ragged last blocks included."""
    from torch.nn.attention.flex_attention import create_block_mask

    from titan_k3.models.k3.documents import FLEX_BLOCK, document_causal_mask_mod

    gen = torch.Generator().manual_seed(seed)
    B, ends = 3, [0]
    for b in range(B):
        while ends[-1] < (b + 1) * T:
            ends.append(min((b + 1) * T, ends[-1] + int(torch.randint(1, 260, (1,), generator=gen))))
    docs = Documents.build(B, T, torch.tensor(ends), torch.device("cpu"))
    ours = docs.block_mask()
    theirs = create_block_mask(document_causal_mask_mod(docs.doc_BT), B, None, T, T, device="cpu")
    assert torch.equal(ours.to_dense(), theirs.to_dense())
    allowed = docs.attention_mask()[:, 0]  # [B, T, T]
    for b in range(B):
        for i in range(ours.kv_num_blocks.shape[-1]):
            rows = slice(i * FLEX_BLOCK, (i + 1) * FLEX_BLOCK)
            n = int(ours.full_kv_num_blocks[b, 0, i])
            for j in ours.full_kv_indices[b, 0, i, :n].tolist():
                assert allowed[b, rows, j * FLEX_BLOCK:(j + 1) * FLEX_BLOCK].all(), (b, i, j)
    # away from the ragged edge, torch finds the same full blocks
    whole = T // FLEX_BLOCK
    assert torch.equal(ours.full_kv_num_blocks[..., :whole], theirs.full_kv_num_blocks[..., :whole].to(torch.int32))


def test_a_capacity_pads_with_empty_documents_and_keeps_positions_and_ids():
    """A CUDA graph's inputs: the boundaries padded to a fixed count, every per-token tensor as without padding."""
    cpu = torch.device("cpu")
    plain = Documents.build(2, 6, torch.tensor([0, 2, 6, 9, 12]), cpu)
    padded = Documents.build(2, 6, torch.tensor([0, 2, 6, 9, 12]), cpu, capacity=7)
    assert padded.cu_seqlens.tolist() == [0, 2, 6, 9, 12, 12, 12, 12] and padded.num_slots == 7
    assert padded.cu_seqlens_host.tolist() == padded.cu_seqlens.tolist() == padded.cu_seqlens_i32.tolist()
    assert torch.equal(padded.pos_BT, plain.pos_BT) and torch.equal(padded.doc_BT, plain.doc_BT)
    assert torch.equal(padded.attention_mask(), plain.attention_mask())
    cu, chunks, offsets = padded.kda_chunks
    assert cu.tolist() == padded.cu_seqlens.tolist() and offsets.shape == (8,)
    # Whole-row batches become packed ones (one document per row) of the same fixed shape.
    rows = Documents.build(2, 6, None, cpu, capacity=7)
    assert rows.cu_seqlens.tolist() == [0, 6, 12, 12, 12, 12, 12, 12] and rows.kda_chunks[1].shape == chunks.shape


def test_copy_writes_a_new_batch_into_the_same_tensors():
    cpu = torch.device("cpu")
    static = Documents.build(2, 6, torch.tensor([0, 2, 6, 9, 12]), cpu, capacity=5)
    before = [static.cu_seqlens, static.pos_BT, static.doc_BT, static.cu_seqlens_i32, *static.kda_chunks]
    static.attention_mask()
    new = Documents.build(2, 6, torch.tensor([0, 6, 7, 8, 12]), cpu, capacity=5)
    assert static.copy_(new) is static
    after = [static.cu_seqlens, static.pos_BT, static.doc_BT, static.cu_seqlens_i32, *static.kda_chunks]
    assert all(a is b for a, b in zip(before, after))  # the memory a graph reads
    assert all(torch.equal(a, b) for a, b in zip(after, [new.cu_seqlens, new.pos_BT, new.doc_BT, new.cu_seqlens_i32,
                                                        *new.kda_chunks]))
    assert torch.equal(static.attention_mask(), new.attention_mask())  # derived again, not the old batch's
    with pytest.raises(ValueError, match="one shape and capacity"):
        static.copy_(Documents.build(2, 6, torch.tensor([0, 6, 12]), cpu, capacity=4))
    assert Documents.build(2, 6, static, cpu) is static
    with pytest.raises(ValueError, match="passed for a batch of"):
        Documents.build(3, 4, static, cpu)


def test_a_batch_over_the_capacity_stops_with_one_line():
    with pytest.raises(ValueError, match="capacity"):
        Documents.build(2, 6, torch.tensor([0, 2, 6, 9, 12]), torch.device("cpu"), capacity=4)
