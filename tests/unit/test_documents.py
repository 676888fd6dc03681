"""Packed-document bookkeeping: positions, document ids, validation, and boundaries kept on the host."""

import pytest
import torch

from titan_k3.models.k3.documents import Documents


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


@pytest.mark.parametrize("cu, message", [
    ([0, 5, 11], "from 0 to B\\*T=12"),
    ([0, 4, 12], "every row start"),
])
def test_bad_boundaries_stop_with_one_line(cu, message):
    with pytest.raises(ValueError, match=message):
        Documents.build(2, 6, torch.tensor(cu), torch.device("cpu"))
