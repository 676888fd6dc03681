"""What a run reads: a dataset's content hash and tokens per source, the run's tokens and epochs, the warning."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from titan_k3.data.budget import content_sha256, describe_run_data, epochs_per_source, report_lines, run_tokens
from titan_k3.data.loader import build_dataloader
from titan_k3.data.shards import open_dataset, token_dtype, write_index, write_shard
from titan_k3.data.tokenizer import load_tokenizer


def test_run_tokens_follow_the_context_curriculum():
    kw = dict(local_batch_size=2, grad_accum=3, dp_world=2)
    assert run_tokens(steps=10, seq_len=64, context_stages="", **kw) == 10 * 12 * 64
    # updates 1-2 at 64, 3-4 at 128, 5 at 256
    assert run_tokens(steps=5, seq_len=64, context_stages="3:128,5:256", **kw) == 12 * (2 * 64 + 2 * 128 + 256)


def test_a_resumed_run_counts_the_tokens_it_has_done_and_the_rest_at_its_new_rate():
    # 4 updates done at 1 row per update (256 tokens), 6 to go at 2 ranks' rate: 2 x 64 each.
    kw = dict(seq_len=64, context_stages="", local_batch_size=1, grad_accum=1)
    assert run_tokens(steps=10, dp_world=2, done_steps=4, done_tokens=256, **kw) == 256 + 6 * 128
    # The curriculum still applies to the updates to come (5-6 at 64, 7-10 at 128), not to those done.
    assert run_tokens(steps=10, seq_len=64, context_stages="3:32,7:128", local_batch_size=1, grad_accum=1,
                      dp_world=2, done_steps=4, done_tokens=192) == 192 + 2 * (2 * 32 + 4 * 128)
    # At or past training.steps nothing is left to train.
    assert run_tokens(steps=4, dp_world=2, done_steps=6, done_tokens=300, **kw) == 300


def test_epochs_split_by_the_mixture():
    assert epochs_per_source({"a": 100, "b": 1000}, {"a": 0.5, "b": 0.5}, 400) == {"a": 2.0, "b": 0.2}
    assert epochs_per_source({"a": 100, "b": 1000}, {"a": 0.0, "b": 1.0}, 400) == {"b": 0.4}  # a excluded


def _dataset(epochs_tokens: int, **extra) -> dict:
    data = {"dataset": "d", "sha256": "ab" * 32, "tokens": 1100, "tokens_per_source": {"a": 100, "b": 1000},
            "weights": {"a": 0.5, "b": 0.5}, **extra}
    return describe_run_data(data, total_tokens=epochs_tokens, fixed_batch=False)


def test_one_epoch_or_less_is_said_and_more_warns():
    line, warning = report_lines(_dataset(100))
    assert warning is None and "the run trains on 100 tokens = 0.50 epochs (a 0.50, b 0.05 by the mixture)" in line
    data = _dataset(400)
    assert data["epochs"] == 2.0 and data["epochs_per_source"] == {"a": 2.0, "b": 0.2}
    line, warning = report_lines(data)
    assert warning.startswith("WARNING: the run reads 2.0 epochs of dataset d (400 tokens of 1,100; a 2.0x)")
    assert "python -m titan_k3.data.prepare" in warning and "\n" not in warning


def test_a_probe_reads_its_small_share_of_an_epoch():
    """A probe of 2,560 tokens of the embedded corpus's 1.09M said '= 0.00 epochs'."""
    line, _ = report_lines(describe_run_data({"dataset": "d", "sha256": "0" * 64, "tokens": 1_086_904,
                                              "tokens_per_source": {"a": 1_086_904}, "weights": {"a": 1.0}},
                                             total_tokens=2560, fixed_batch=False))
    assert line.endswith("the run trains on 2,560 tokens = 0.0024 epochs"), line


def test_the_line_says_when_the_mixture_is_the_datasets_prepare_weights():
    line, _ = report_lines(_dataset(100, mixture_from="prepared"))
    assert line.endswith("| mixture: the dataset's prepare weights (a 0.5, b 0.5; data.mixture overrides them)")
    assert "mixture:" not in report_lines(_dataset(100, mixture_from="natural"))[0]


def test_a_fixed_batch_has_no_epochs():
    data = describe_run_data({"dataset": "d", "sha256": "0" * 64, "tokens": 10, "tokens_per_source": {"a": 10},
                              "weights": {"a": 1.0}}, total_tokens=10**6, fixed_batch=True)
    line, warning = report_lines(data)
    assert data["epochs"] is None and warning is None and "one repeated batch" in line


def test_the_loader_describes_a_prepared_dataset_and_its_hash_follows_the_content(tmp_path):
    tok = load_tokenizer("embedded")
    dtype = token_dtype(tok.vocab_size)
    docs = {"web": [[5, 6, 7, tok.eos_id]] * 30, "code": [[8, 9, tok.eos_id]] * 10}
    records = {"train": [write_shard(tmp_path, f"train-{name}-00000", [np.asarray(d, dtype) for d in ds],
                                     source=name, dtype=dtype) for name, ds in docs.items()]}
    write_index(tmp_path, tok, records)
    info = build_dataloader(str(tmp_path), tok, 8, 1, 0, 1, seed=0, prefetch=0).describe()
    assert info["dataset"] == str(tmp_path) and info["split"] == "train"
    assert info["tokens_per_source"] == {"code": 30, "web": 120} and info["tokens"] == 150
    assert info["weights"] == pytest.approx({"code": 0.2, "web": 0.8})
    index = open_dataset(tmp_path).index
    assert info["sha256"] == content_sha256(index)
    changed = copy.deepcopy(index)
    changed["splits"]["train"]["shards"][0]["sha256"] = "0" * 64  # another shard content
    assert content_sha256(changed) != info["sha256"]
