"""The Triton backends are ops registered with torch.library inside autograd Functions: torch.compile traces them
without graph breaks (fullgraph=True), forward and backward, and gives the eager numbers."""

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


def test_one_tensor_at_two_inputs_compiles():
    """q = k: Dynamo does not trace an autograd Function given one tensor twice; the call passes a view instead."""
    torch._dynamo.reset()
    spec = get_op("gated_delta_rule")
    inputs = spec.example_inputs(1, 24, 2, 16, 16, device=DEVICE)
    x = inputs.pop("q").detach().clone().requires_grad_(True)
    inputs.pop("k")

    def loss(x):
        o, _ = spec.fn(x, x, **inputs, backend="triton", chunk_size=16)
        return o.float().square().sum()

    want = torch.autograd.grad(loss(x), x)[0]
    got = torch.autograd.grad(torch.compile(loss, fullgraph=True, backend="aot_eager")(x), x)[0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_registered_ops_have_no_autograd_kernel_to_run():
    """What a compiled graph calls pays the dispatcher alone: autograd falls through the registered ops (their
    autograd Function differentiates them), and no torch.library.custom_op wrapper runs Python around them."""
    import linattn.layers.norms_triton  # noqa: F401
    import linattn.layers.shortconv_joint  # noqa: F401
    import linattn.layers.shortconv_triton  # noqa: F401

    for name in ("gated_delta_rule_triton_fwd", "gated_delta_rule_triton_bwd", "gla_triton_fwd", "short_conv_fwd",
                 "rms_norm_gated_bwd", "l2norm_fwd", "l2norm_pair_fwd", "short_conv_streams_fwd"):
        assert torch._C._dispatch_kernel_for_dispatch_key_is_fallthrough(f"linattn::{name}",
                                                                          torch._C.DispatchKey.Autograd), name


@pytest.mark.parametrize("with_cache", [False, True])
def test_short_conv_compiled_equals_eager(with_cache):
    """Eagerly ShortConv's Function calls the kernels' implementations, compiled the registered ops: same numbers."""
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
