"""`linattn bench ops` rows for the softmax family's Triton backends (forgetting_attn, path_attn, deltaformer), SDPA
and FLA's parallel kernels: rows are made at a tiny shape (under Triton's interpreter without a GPU), FLA's
single-tensor output is taken as the output."""

import pytest
import torch

from linattn.bench.ops import FLA_FUNCTIONS, fla_output, run_ops_bench
from linattn.ops.common.triton_compat import triton_available


def test_fla_output_is_the_tensor_or_the_first_element():
    o = torch.ones(2)
    assert fla_output(o) is o
    assert fla_output((o, None)) is o
    assert FLA_FUNCTIONS["forgetting_attn"][1] == "parallel_forgetting_attn"
    assert FLA_FUNCTIONS["path_attn"][1] == "parallel_path_attn"


@pytest.mark.triton
@pytest.mark.skipif(not triton_available(), reason="triton not installed")
@pytest.mark.parametrize("op", ["forgetting_attn", "path_attn", "deltaformer"])
def test_triton_rows(op):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = run_ops_bench([op], [24], ["triton", "sdpa"], B=1, H=2, K=16, V=16, dtype=torch.float32,
                         device=device, repeats=1, memory=False, progress=False)
    by_impl = {r.impl: r for r in rows}
    assert set(by_impl) == {"triton", "sdpa"}
    assert by_impl["triton"].note == "" and by_impl["triton"].fwdbwd_ms > 0
