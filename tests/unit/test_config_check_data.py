"""check_data (`--job.validate_only`, the trainer's start, the service's config check): what the run's loader would
refuse after the model is built is refused before any work, in one line naming the key."""

import json

import pytest

from titan_k3.config import ConfigError, load_job_config
from titan_k3.config.check import check_data
from titan_k3.data.tokenizer import tokenizer_identity
from tests.unit.test_data_loader import lengths
from tests.unit.test_data_loader import make_dataset as make_stub_dataset


def _cfg(path, *extra):
    return load_job_config(["--data.dataset", str(path), "--model.flavor", "debug", *extra])


def make_dataset(path, docs, **index_extra):
    """The loader tests' dataset, recorded as built with the embedded tokenizer (these configs' data.tokenizer)."""
    make_stub_dataset(path, docs, **index_extra)
    index = json.loads((path / "index.json").read_text())
    index["tokenizer"]["name"], index["tokenizer"]["sha256"] = tokenizer_identity("embedded")
    (path / "index.json").write_text(json.dumps(index))


def test_a_dataset_built_with_another_tokenizer_is_refused_naming_both(tmp_path):
    """The trainer's loader refused it after building the model; --job.validate_only and the service said 'ok'."""
    make_stub_dataset(tmp_path, {"web": lengths(20, 10, 90, 1)})
    with pytest.raises(ConfigError, match=rf"^config key 'data.dataset' = '{tmp_path}': dataset .* built with tokenizer "
                                          r"'stub' \(sha256 cccccccccccc\.\.\.\), but the tokenizer given is 'embedded"):
        check_data(_cfg(tmp_path, "--training.seq_len", "64"))


def test_prepare_weights_naming_a_source_without_documents_are_refused_as_the_loader_does(tmp_path):
    docs = {"code": lengths(20, 10, 90, 1), "web": lengths(20, 10, 90, 2)}
    make_dataset(tmp_path, docs, mixture={"code": 0.3, "web": 0.6, "nothing": 0.1})
    with pytest.raises(ConfigError, match=rf"^config key 'data.dataset' = '{tmp_path}': dataset .* was prepared with "
                                          r"weights for source\(s\) 'nothing' \(weight 0.1\) that have no documents"):
        check_data(_cfg(tmp_path, "--training.seq_len", "64"))
    check_data(_cfg(tmp_path, "--training.seq_len", "64", "--data.mixture", "code:1,web:3"))  # the way out


def test_a_sequence_longer_than_the_training_split_is_refused_naming_its_key(tmp_path):
    """A row needs seq_len + 1 tokens; a split shorter than that cannot fill one (the run was killed for memory)."""
    docs = {"web": [60, 40, 28]}  # 128 tokens
    make_dataset(tmp_path, docs)
    check_data(_cfg(tmp_path, "--training.seq_len", "64"))
    with pytest.raises(ConfigError, match=rf"^config key 'training.seq_len' = 128: a row of 129 tokens is longer than "
                                          rf"the training split of data.dataset = '{tmp_path}' \(128 tokens\)$"):
        check_data(_cfg(tmp_path, "--training.seq_len", "128"))
    with pytest.raises(ConfigError, match=r"^config key 'training.context_stages' = '5:192': a row of 193 tokens"):
        check_data(_cfg(tmp_path, "--training.seq_len", "64", "--training.context_stages", "5:192"))


def test_a_weighted_source_without_training_documents_is_refused_naming_the_mixture(tmp_path):
    make_dataset(tmp_path, {"web": lengths(20, 10, 90, 1)})
    index = json.loads((tmp_path / "index.json").read_text())
    index["sources"].append({"name": "code", "n_docs": 0, "n_tokens": 0})  # documents in no split of training
    (tmp_path / "index.json").write_text(json.dumps(index))
    with pytest.raises(ConfigError, match=r"^config key 'data.mixture' = 'web:1,code:1': source\(s\) \['code'\] "
                                          r"weighted above 0 have no documents in the training split; it has \['web'\]$"):
        check_data(_cfg(tmp_path, "--training.seq_len", "64", "--data.mixture", "web:1,code:1"))
    check_data(_cfg(tmp_path, "--training.seq_len", "64", "--data.mixture", "web:1,code:0"))
