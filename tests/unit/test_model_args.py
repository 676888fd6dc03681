"""K3Args refuses, when it is built, every shape the model cannot be built or run with: one line naming the field and
its value (a 0 built a model whose sublayer adds nothing, or stopped its first forward on a division by zero, an
empty reshape or the router's top_k + 1)."""

from __future__ import annotations

import math

import pytest

from titan_k3.models.k3.args import FLAVORS, KDA_MAX_HEAD_DIM, K3Args

DEBUG = FLAVORS["debug"]  # 4 layers, 8 experts, top_k 2

SIZES = ("dim", "n_layers", "vocab_size", "kda_heads", "kda_head_dim", "kda_conv_size", "mla_heads", "q_lora_rank",
         "kv_lora_rank", "v_head_dim", "dense_hidden", "n_experts", "top_k", "latent_dim", "expert_hidden",
         "attn_res_block_size")


@pytest.mark.parametrize("field", SIZES)
@pytest.mark.parametrize("value", [0, -1, 2.0, True, "4"])
def test_sizes_are_integers_of_at_least_one(field, value):
    with pytest.raises(ValueError) as e:
        DEBUG.replace(**{field: value})
    assert str(e.value) == f"{field}={value!r}: must be an integer >= 1"


@pytest.mark.parametrize("field", ["qk_nope_dim", "qk_rope_dim", "n_shared_experts", "n_dense_layers"])
def test_counts_are_integers_of_at_least_zero(field):
    assert getattr(DEBUG.replace(**{field: 0}), field) == 0
    with pytest.raises(ValueError) as e:
        DEBUG.replace(**{field: -1})
    assert str(e.value) == f"{field}=-1: must be an integer >= 0"


@pytest.mark.parametrize("changes, line", [
    (dict(top_k=8), "top_k=8: must be in 1..7, below n_experts=8 (routing ranks the top_k + 1 largest scores)"),
    (dict(top_k=9), "top_k=9: must be in 1..7, below n_experts=8 (routing ranks the top_k + 1 largest scores)"),
    (dict(n_experts=1, top_k=1), "n_experts=1: must be >= 2 (the top_k experts of a token leave one out)"),
    (dict(kda_head_dim=KDA_MAX_HEAD_DIM + 1), f"kda_head_dim={KDA_MAX_HEAD_DIM + 1}: the KDA kernels take head widths "
                                              f"1..{KDA_MAX_HEAD_DIM}"),
    (dict(qk_nope_dim=0, qk_rope_dim=0), "qk_nope_dim=0, qk_rope_dim=0: an MLA query-key head needs a width (their "
                                         "sum) of at least 1"),
    (dict(n_dense_layers=5), "n_dense_layers=5: must be at most n_layers=4"),
    (dict(norm_eps=0.0), "norm_eps=0.0: must be a finite number > 0 (RMSNorm divides by sqrt(mean(x^2) + eps))"),
    (dict(norm_eps=math.nan), "norm_eps=nan: must be a finite number > 0 (RMSNorm divides by sqrt(mean(x^2) + eps))"),
    (dict(kda_gate_lower_bound=0.0), "kda_gate_lower_bound=0.0: must be None (the softplus gate) or a finite number "
                                     "< 0 (the safe gate's log decay lies in [bound, 0))"),
    (dict(kda_gate_lower_bound=-math.inf), "kda_gate_lower_bound=-inf: must be None (the softplus gate) or a finite "
                                           "number < 0 (the safe gate's log decay lies in [bound, 0))"),
    (dict(full_attention_layers=(4,)), "full_attention_layers=(4,): must be a tuple of distinct layer indices in 0..3 "
                                       "(an index past the layers made no layer MLA and was counted as one)"),
    (dict(full_attention_layers=(-1,)), "full_attention_layers=(-1,): must be a tuple of distinct layer indices in "
                                        "0..3 (an index past the layers made no layer MLA and was counted as one)"),
    (dict(full_attention_layers=(1, 1)), "full_attention_layers=(1, 1): must be a tuple of distinct layer indices in "
                                         "0..3 (an index past the layers made no layer MLA and was counted as one)"),
])
def test_shapes_the_model_cannot_run_are_refused_in_one_line(changes, line):
    with pytest.raises(ValueError) as e:
        DEBUG.replace(**changes)
    assert str(e.value) == line


def test_the_edges_that_build_are_accepted():
    """Every value on the accepted side of each refusal builds (top_k = n_experts - 1, no shared expert, no dense
    layer, all dense layers, no MLA layer, the softplus gate, a shared key width or a nope width of 0)."""
    for changes in (dict(top_k=7), dict(n_experts=2, top_k=1), dict(n_shared_experts=0), dict(n_dense_layers=0),
                    dict(n_dense_layers=4), dict(full_attention_layers=()), dict(full_attention_layers=(3, 0)),
                    dict(kda_gate_lower_bound=None), dict(qk_rope_dim=0), dict(qk_nope_dim=0),
                    dict(kda_head_dim=KDA_MAX_HEAD_DIM), dict(norm_eps=1)):
        assert isinstance(DEBUG.replace(**changes), K3Args)
    assert all(isinstance(a, K3Args) for a in FLAVORS.values())
