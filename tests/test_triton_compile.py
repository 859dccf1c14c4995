"""The Triton backends are torch.library custom ops: torch.compile traces them without graph breaks
(fullgraph=True), forward and backward, and gives the eager numbers."""

import pytest
import torch

from linattn.ops import get_op
from linattn.ops.common.triton_compat import triton_available

pytestmark = [pytest.mark.triton, pytest.mark.skipif(not triton_available(), reason="triton not installed")]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("op", ["simple_gla", "gla", "delta_rule", "gated_delta_rule", "comba", "gated_delta_product"])
def test_compiles_without_graph_breaks(op):
    spec = get_op(op)
    inputs = spec.example_inputs(1, 40, 2, 16, 16, device=DEVICE)
    names = list(inputs)
    leaves = [x.detach().clone().requires_grad_(True) for x in inputs.values()]

    def loss(*xs):
        o, _ = spec.fn(**dict(zip(names, xs)), backend="triton", chunk_size=16)
        return o.float().square().sum()

    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    eager_grads = torch.autograd.grad(loss(*leaves), leaves)
    value = compiled(*leaves)
    compiled_grads = torch.autograd.grad(value, leaves)
    assert torch.allclose(value, loss(*leaves), rtol=1e-6)
    for a, b in zip(compiled_grads, eager_grads):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)
