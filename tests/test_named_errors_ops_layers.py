"""Named errors of the ops: log decays g > 0 (or NaN) refused by every op and step that takes one."""

from __future__ import annotations

import inspect
import math

import pytest
import torch

from linattn.ops import get_op
from linattn.ops.common.values import value_checks

B, T, H, K, V = 1, 3, 2, 4, 4
# every op taking a log decay g (documented g <= 0); path_attn's is optional
LOG_DECAY_OPS = ["simple_gla", "gla", "gated_delta_rule", "comba", "gated_delta_product", "mesa_net",
                 "forgetting_attn", "path_attn"]
G_ERROR = r"must have values in \[-inf, 0\]"


def _step_inputs(name: str) -> dict[str, torch.Tensor]:
    """The step's tensors by parameter name: ``x_t`` is token 0 of the op's ``x`` from a one-token input (so
    gated_delta_product's sub-step inputs [B, n, ...] keep their n); others (mesa_net's lamb) pass whole."""
    x = get_op(name).example_inputs(B, 1, H, K, V)
    out = {}
    for p in inspect.signature(get_op(name).step).parameters:
        base = p[:-2] if p.endswith("_t") else p
        if p != "state" and base in x:
            out[p] = x[base][:, 0] if p.endswith("_t") and x[base].shape[1] == 1 else x[base]
    return out


# --- log decays must be <= 0 -------------------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [1.0, math.nan])
@pytest.mark.parametrize("name", LOG_DECAY_OPS)
def test_op_refuses_positive_log_decay(name: str, bad: float) -> None:
    x = get_op(name).example_inputs(B, T, H, K, V)
    x["g"] = torch.full_like(x["g"], bad)
    with pytest.raises(ValueError, match="^g " + G_ERROR):
        get_op(name).fn(**x)


@pytest.mark.parametrize("name", LOG_DECAY_OPS)
def test_step_refuses_positive_log_decay(name: str) -> None:
    x = _step_inputs(name)
    x["g_t"] = torch.ones_like(x["g_t"])
    with pytest.raises(ValueError, match="^g_t " + G_ERROR):
        get_op(name).step(**x)


@pytest.mark.parametrize("name", LOG_DECAY_OPS)
def test_zero_log_decay_and_off_mode_still_run(name: str) -> None:
    x = get_op(name).example_inputs(B, T, H, K, V)
    x["g"] = torch.full_like(x["g"], -0.0)  # a layer's -exp()*softplus can round to -0.0 or 0.0
    get_op(name).fn(**x)
    x["g"] = torch.zeros_like(x["g"])
    get_op(name).fn(**x)
    x["g"] = torch.full_like(x["g"], 0.5)
    with value_checks("off"):  # the caller vouches for the range: not read
        get_op(name).fn(**x)
