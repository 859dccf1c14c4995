"""The Triton backends are torch.library custom ops: torch.compile traces them without graph breaks
(fullgraph=True), forward and backward, and gives the eager numbers."""

import pytest
import torch

from linattn.ops import get_op
from linattn.ops.common.triton_compat import triton_available

pytestmark = [pytest.mark.triton, pytest.mark.skipif(not triton_available(), reason="triton not installed")]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("op", ["simple_gla", "gla", "delta_rule", "gated_delta_rule", "comba", "gated_delta_product",
                                "forgetting_attn", "deltaformer", "path_attn", "titans"])
def test_compiles_without_graph_breaks(op):
    torch._dynamo.reset()  # each op traces its own loss: without a reset, the ops share dynamo's recompile limit
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


@pytest.mark.parametrize("with_cache", [False, True])
def test_short_conv_compiled_equals_eager(with_cache):
    """Eagerly ShortConv's kernels run through an autograd Function, compiled through the custom ops: same numbers."""
    from linattn.layers.shortconv_triton import causal_conv_triton

    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(2, 37, 24, generator=gen), torch.randn(24, 4, generator=gen)
    b, cache = torch.randn(24, generator=gen), torch.randn(2, 3, 24, generator=gen) if with_cache else None
    leaves = [t.to(DEVICE).requires_grad_(True) for t in (x, w, b) + ((cache,) if with_cache else ())]

    def loss(*ts):
        return causal_conv_triton(ts[0], ts[3] if with_cache else None, ts[1], ts[2], True).square().sum()

    eager = loss(*leaves)
    eager_grads = torch.autograd.grad(eager, leaves)
    value = torch.compile(loss, fullgraph=True, backend="aot_eager")(*leaves)
    for a, b_ in zip(torch.autograd.grad(value, leaves), eager_grads):
        assert torch.allclose(a, b_, rtol=1e-5, atol=1e-6)
    assert torch.allclose(value, eager, rtol=1e-6)
