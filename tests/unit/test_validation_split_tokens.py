"""The validation split's size, read through the dataset's own checked opening."""

import json
import shutil
from pathlib import Path

import pytest

from titan_k3.data.corpus import ensure_embedded_dataset
from titan_k3.eval.validation import validation_split_tokens


def test_the_embedded_validation_split_counts_its_index_tokens():
    index = json.loads((Path(ensure_embedded_dataset()) / "index.json").read_text())
    want = sum(r["n_tokens"] for r in index["splits"]["validation"]["shards"])
    assert want > 0 and validation_split_tokens("embedded") == want


def test_a_damaged_index_is_the_datasets_one_line_not_a_wrong_count(tmp_path):
    # NOTE: it read the index with defaults of its own: a shard record without n_tokens counted 0 tokens, so an
    # evaluation was refused for "no validation split" (or a KeyError when `splits` was a list)
    data = tmp_path / "data"
    shutil.copytree(ensure_embedded_dataset(), data)
    index = json.loads((data / "index.json").read_text())
    del index["splits"]["validation"]["shards"][0]["n_tokens"]
    (data / "index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"index.json key 'splits.validation.shards\[0\].n_tokens' is missing"):
        validation_split_tokens(str(data))


def test_a_dataset_without_a_validation_split_has_zero(tmp_path):
    data = tmp_path / "data"
    shutil.copytree(ensure_embedded_dataset(), data)
    index = json.loads((data / "index.json").read_text())
    del index["splits"]["validation"]
    (data / "index.json").write_text(json.dumps(index))
    assert validation_split_tokens(str(data)) == 0
