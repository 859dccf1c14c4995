"""Every op with a Triton backend equals its chunk backend (mesa_net: the recurrence), the output and every input's
gradient, in float32 and within bf16's tolerances in bf16, at a shape where its kernels run several key and value
blocks over several batch-heads and chunks, with a partial last block and chunk (B 2, T 37, H 2, K = V = 80). A
block's index, or where a per-block partial result lies, taken from the wrong grid axis shows only at such shapes:
with one block or one batch-head the wrong offset equals the right one.

Runs on CUDA when present, else on the CPU through Triton's interpreter (tests/conftest.py)."""

import pytest
import torch

from linattn.ops import get_op, list_ops
from linattn.ops.common.triton_compat import triton_available
from linattn.testing import assert_close

pytestmark = [pytest.mark.triton, pytest.mark.skipif(not triton_available(), reason="triton not installed")]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SHAPE = dict(B=2, T=37, H=2, K=80, V=80)
# mesa_net's Triton kernels are its CG solver's (solver "exact" runs the chunk backend's code): CG with K steps, exact
# in exact arithmetic, against the recurrence's Cholesky solve
TRITON_KWARGS = {"mesa_net": {"solver": "cg", "cg_steps": SHAPE["K"]}}
REFERENCE = {"mesa_net": "recurrent"}


def _output_and_grads(op: str, inputs: dict, backend: str, dtype: torch.dtype = torch.float32, **kwargs
                      ) -> tuple[torch.Tensor, dict]:
    """The output and every floating input's gradient (float32), q, k, v and p given in ``dtype``."""
    leaves = {n: x.detach().clone().to(DEVICE, dtype if n in ("q", "k", "v", "p") else x.dtype).requires_grad_(True)
              for n, x in inputs.items() if isinstance(x, torch.Tensor) and x.is_floating_point()}
    args = {n: leaves.get(n, x.to(DEVICE) if isinstance(x, torch.Tensor) else x) for n, x in inputs.items()}
    o = get_op(op).fn(**args, backend=backend, **kwargs)[0]
    cotangent = torch.randn(o.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    grads = torch.autograd.grad((o.float() * cotangent).sum(), list(leaves.values()), allow_unused=True)
    return o.detach().float(), {n: None if g is None else g.float() for n, g in zip(leaves, grads)}


@pytest.mark.parametrize("op", [n for n in list_ops() if "triton" in get_op(n).backends])
def test_triton_equals_chunk_over_several_blocks_and_batch_heads(op):
    torch.manual_seed(0)
    inputs = get_op(op).example_inputs(**SHAPE, dtype=torch.float32)
    want_o, want = _output_and_grads(op, inputs, REFERENCE.get(op, "chunk"))
    got_o, got = _output_and_grads(op, inputs, "triton", **TRITON_KWARGS.get(op, {}))
    assert_close(got_o.cpu(), want_o.cpu(), 1e-5, f"{op}: output")
    for name, expected in want.items():
        assert (got[name] is None) == (expected is None), f"{op}: gradient of {name}"
        if expected is not None:
            assert_close(got[name].cpu(), expected.cpu(), 1e-5, f"{op}: gradient of {name}")


@pytest.mark.parametrize("op", [n for n in list_ops() if "triton" in get_op(n).backends])
def test_triton_in_bf16_over_several_blocks_and_batch_heads(op):
    """bf16 inputs take their own launch settings (block sizes, warps): against float32 on the same rounded inputs,
    the project's bf16 tolerances (relative RMS error 5e-3 for the output, 1e-2 for gradients)."""
    torch.manual_seed(0)
    inputs = {n: x.to(torch.bfloat16).float() if n in ("q", "k", "v", "p") else x
              for n, x in get_op(op).example_inputs(**SHAPE, dtype=torch.float32).items()}
    want_o, want = _output_and_grads(op, inputs, REFERENCE.get(op, "chunk"))
    got_o, got = _output_and_grads(op, inputs, "triton", torch.bfloat16, **TRITON_KWARGS.get(op, {}))
    assert_close(got_o.cpu(), want_o.cpu(), 5e-3, f"{op}: output", "rmse")
    for name, expected in want.items():
        if expected is not None:
            assert_close(got[name].cpu(), expected.cpu(), 1e-2, f"{op}: gradient of {name}", "rmse")
