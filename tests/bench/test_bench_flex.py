"""FlexAttention rows of `linattn bench ops`: the FoX form (bias -G_s: the row term drops out of the softmax) equals
the recurrence; rows are offered only where they can be timed (CUDA, ops with a FlexAttention form)."""

import warnings

import pytest
import torch

from linattn.bench.flex import _flex_api, flex_call, forgetting_attn_flex
from linattn.bench.ops import bench_op
from linattn.ops import get_op
from linattn.testing import assert_close

pytestmark = pytest.mark.skipif(_flex_api() is None, reason="this torch has no FlexAttention")


@pytest.mark.parametrize("T", [1, 37, 130])
def test_forgetting_attn_form_equals_the_recurrence(T):
    spec = get_op("forgetting_attn")
    x = spec.example_inputs(2, T, 3, 16, 8, seed=T)
    x["g"] = x["g"] * 4  # strong gates: a bias written with the wrong sign or the row's term would show
    with warnings.catch_warnings():  # uncompiled FlexAttention warns that it is slow
        warnings.simplefilter("ignore")
        o = forgetting_attn_flex()(x)
    assert_close(o, spec.fn(**x, backend="recurrent")[0], 1e-5, f"flex form vs recurrent at T = {T}")


def test_rows_only_where_they_can_be_timed():
    assert flex_call("forgetting_attn", torch.device("cpu")) is None  # no FlexAttention backward on the CPU
    assert flex_call("gated_delta_rule", torch.device("cuda")) is None  # no FlexAttention form
    assert bench_op("forgetting_attn", 16, "flex", B=1, H=2, K=8, V=8, dtype=torch.float32,
                    device=torch.device("cpu"), repeats=1, memory=False) is None
