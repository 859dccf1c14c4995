"""How `linattn bench ops` turns an op's example inputs into FLA's arguments (FLA itself is not needed)."""

import torch

from linattn.bench.ops import FLA_ARGUMENTS, MESA_CG_STEPS, OP_KWARGS
from linattn.ops import get_op


def test_path_attn_gives_fla_float32_w_beta_and_g():
    x = get_op("path_attn").example_inputs(1, 8, 2, 16, 16, dtype=torch.bfloat16)
    args = FLA_ARGUMENTS["path_attn"](x)
    assert {n: args[n].dtype for n in ("w", "beta", "g")} == dict.fromkeys(("w", "beta", "g"), torch.float32)
    assert args["q"].dtype == torch.bfloat16 and torch.equal(args["w"], x["w"].float())


def test_mesa_net_runs_the_same_cg_steps_on_both_sides():
    x = get_op("mesa_net").example_inputs(1, 8, 2, 16, 16)
    assert FLA_ARGUMENTS["mesa_net"](x)["max_CG_iteration"] == MESA_CG_STEPS
    assert OP_KWARGS["mesa_net"] == {"solver": "cg", "cg_steps": MESA_CG_STEPS}
    assert "max_CG_iteration" not in x  # the op's own inputs are left alone
