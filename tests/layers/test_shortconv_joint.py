"""The ShortConvs of a joint projection as one op (layers/shortconv_joint.py) == each stream's slice convolved by its
own ShortConv (multiply-adds) and the other slices as they are: outputs and the gradients of the joint projection,
the weights and the biases (fp32 1e-5, bf16 RMSE), stream widths that no block size divides, more streams than one
launch takes, unused outputs; the layers take it where it applies and equal the multiply-add layers; registered ops
and torch.compile.

Runs on CUDA when present, else on the CPU through Triton's interpreter (tests/conftest.py)."""

import pytest
import torch

import linattn
from linattn.layers import build_mixer
from linattn.layers.shortconv import ShortConv
from linattn.ops.common.triton_compat import triton_available
from linattn.testing import assert_close, randn

pytestmark = [pytest.mark.triton, pytest.mark.skipif(not triton_available(), reason="triton not installed")]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def reference(y, weight, bias, conv_widths, pass_widths, silu):
    """Each conv stream through ShortConv's multiply-adds, each other stream a slice."""
    outs, first = [], 0
    for width in conv_widths:
        conv = ShortConv(width, kernel_size=weight.shape[1], activation="silu" if silu else None,
                         bias=bias is not None).to(y.device)
        conv.backend = "muladd"
        del conv.weight
        conv.weight = weight[first:first + width, None]  # a view: gradients reach the joint weight
        if bias is not None:
            del conv.bias
            conv.bias = bias[first:first + width]
        outs.append(conv(y[..., first:first + width])[0])
        first += width
    for width in pass_widths:
        outs.append(y[..., first:first + width])
        first += width
    return outs


def run(fn, y, weight, bias, conv_widths, pass_widths, silu, unused=()):
    """(outputs, dy, dweight, dbias) with a fixed random cotangent on every output not in ``unused``."""
    leaves = [t.detach().clone().requires_grad_(True) for t in (y, weight) + (() if bias is None else (bias,))]
    outs = fn(leaves[0], leaves[1], leaves[2] if bias is not None else None, conv_widths, pass_widths, silu)
    gen = torch.Generator().manual_seed(3)
    loss = sum((o.float() * randn(*o.shape, generator=gen).to(DEVICE)).sum()
               for i, o in enumerate(outs) if i not in unused)
    loss.backward()
    return [o.detach() for o in outs], [t.grad for t in leaves]


def joint(y, weight, bias, conv_widths, pass_widths, silu):
    from linattn.layers.shortconv_joint import conv_streams

    return conv_streams(y, weight, bias, conv_widths, pass_widths, silu)


@pytest.mark.parametrize("conv_widths,pass_widths", [([32, 32, 32], [2, 2]), ([24, 40, 8], [3, 5]),
                                                     ([16, 16, 16, 32], []), ([48], [4]), ([20, 16], [1])])
@pytest.mark.parametrize("bias", [False, True])
def test_equals_separate_convs_fp32(conv_widths, pass_widths, bias):
    gen = torch.Generator().manual_seed(sum(conv_widths))
    Dc = sum(conv_widths)
    y = randn(2, 37, Dc + sum(pass_widths), generator=gen).to(DEVICE)
    weight = randn(Dc, 4, generator=gen).to(DEVICE)
    b = randn(Dc, generator=gen).to(DEVICE) if bias else None
    got_outs, got_grads = run(joint, y, weight, b, conv_widths, pass_widths, True)
    want_outs, want_grads = run(reference, y, weight, b, conv_widths, pass_widths, True)
    for i, (a, e) in enumerate(zip(got_outs, want_outs)):
        assert a.shape == e.shape and a.is_contiguous()
        assert_close(a, e, 1e-5, f"output {i}")
    for name, a, e in zip(("dy", "dweight", "dbias"), got_grads, want_grads):
        assert_close(a, e, 1e-5, name)


@pytest.mark.parametrize("T", [1, 3, 70])
def test_short_sequences_no_activation_and_unused_outputs(T):
    gen = torch.Generator().manual_seed(T)
    y = randn(3, T, 48 + 6, generator=gen).to(DEVICE)
    weight = randn(48, 3, generator=gen).to(DEVICE)
    unused = (1, 3)  # the second conv stream and the first small stream get no gradient
    got_outs, got_grads = run(joint, y, weight, None, [16, 32], [4, 2], False, unused)
    want_outs, want_grads = run(reference, y, weight, None, [16, 32], [4, 2], False, unused)
    for a, e in zip(got_outs + got_grads, want_outs + want_grads):
        assert_close(a, e, 1e-5, f"T={T}")


def test_bf16_against_float32():
    gen = torch.Generator().manual_seed(9)
    y = randn(2, 45, 3 * 64 + 4, generator=gen).to(DEVICE).bfloat16()
    weight, bias = randn(192, 4, generator=gen).to(DEVICE), randn(192, generator=gen).to(DEVICE)
    got_outs, got_grads = run(joint, y, weight, bias, [64, 64, 64], [2, 2], True)
    want_outs, want_grads = run(reference, y.float(), weight, bias, [64, 64, 64], [2, 2], True)
    for a, e in zip(got_outs, want_outs):
        assert a.dtype == torch.bfloat16
        assert_close(a.float(), e, 5e-3, "bf16 output", "rmse")
    for name, a, e in zip(("dy", "dweight", "dbias"), got_grads, want_grads):
        assert_close(a.float(), e, 1e-2, f"bf16 {name}", "rmse")


@pytest.mark.parametrize("mixer,expected", [("gated_delta_rule", ["q", "k", "v", "b", "a"]),
                                            ("mamba2", ["q", "k", "v", "a"]), ("delta_rule", ["q", "k", "v", "b"])])
def test_layers_convolve_jointly_and_equal_multiply_adds(mixer, expected):
    torch.manual_seed(0)
    layer = build_mixer(mixer, 64, 2, backend="chunk").to(DEVICE)
    x = torch.randn(2, 21, 64, device=DEVICE)
    cotangent = torch.randn(2, 21, 64, device=DEVICE)
    results = {}
    for backend in ("muladd", "triton"):
        with linattn.settings(shortconv_backend=backend):
            assert layer.joint_conv_streams(layer.projected_streams(x), None) == (
                expected if backend == "triton" else [])
            leaf = x.clone().requires_grad_(True)
            layer.zero_grad()
            y, cache = layer(leaf)
            (y * cotangent).sum().backward()
            results[backend] = {"y": y, "dx": leaf.grad, **cache.conv,
                                **{name: p.grad for name, p in layer.named_parameters()}}
    for name, e in results["muladd"].items():
        # Mamba2's D gets the sum over every token and channel of v ⊙ dy, which cancels to about 1% of the sum of
        # its terms' sizes: float32 summation order alone moves it by ~1e-5 relative (conv1d against muladd too)
        assert_close(results["triton"][name], e, 1e-3 if name == "D" else 1e-5, f"{mixer}: {name}")


@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
def test_training_forward_makes_no_conv_caches(packed, monkeypatch):
    """A forward that returns no cache (use_cache=False, packed calls) and its backward's recompute build no ShortConv
    caches; a forward that returns one still does."""
    from linattn.layers import base

    torch.manual_seed(2)
    layer = build_mixer("gated_delta_rule", 64, 2, backend="chunk").to(DEVICE)
    x = torch.randn(1, 21, 64, device=DEVICE, requires_grad=True)
    cu = torch.tensor([0, 5, 21], dtype=torch.int32) if packed else None

    def refuse(*args, **kwargs):
        raise AssertionError("a ShortConv cache was built for a call that returns none")

    with linattn.settings(shortconv_backend="triton"):
        with monkeypatch.context() as m:
            m.setattr(base, "last_inputs", refuse)
            m.setattr(base, "packed_last_inputs", refuse)
            y, cache = layer(x, use_cache=False, cu_seqlens=cu)
            y.sum().backward()
        assert cache is None and x.grad is not None
        if not packed:
            _, cache = layer(x.detach())
            assert set(cache.conv) == {"q", "k", "v"}


def test_layers_keep_separate_convs_with_a_cache_or_mixed_convs():
    torch.manual_seed(1)
    layer = build_mixer("gated_delta_rule", 64, 2, backend="chunk").to(DEVICE)
    x = torch.randn(1, 9, 64, device=DEVICE)
    with linattn.settings(shortconv_backend="triton"):
        pre = layer.projected_streams(x)
        _, cache = layer(x)
        assert layer.joint_conv_streams(pre, cache) == []
        layer.convs["k"].backend = "muladd"
        assert layer.joint_conv_streams(pre, None) == []
    one = build_mixer("gated_delta_rule", 64, 2, short_conv="k", backend="chunk").to(DEVICE)
    with linattn.settings(shortconv_backend="triton"):  # q and v have matmuls of their own: k leads the joint one
        assert one.joint_conv_streams(one.projected_streams(x), None) == ["k", "b", "a"]


def test_registered_ops():
    import linattn.layers.shortconv_joint  # noqa: F401  (registers linattn::short_conv_streams_fwd / _bwd)

    gen = torch.Generator().manual_seed(12)
    y, w, b = (randn(*s, generator=gen).to(DEVICE) for s in ((2, 9, 36), (32, 4), (32,)))
    grads = [randn(2, 9, 16, generator=gen).to(DEVICE), None, randn(2, 9, 4, generator=gen).to(DEVICE)]
    checks = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")
    result = torch.library.opcheck(torch.ops.linattn.short_conv_streams_fwd.default, (y, w, b, [16, 16], [4], True),
                                   test_utils=checks)
    result |= torch.library.opcheck(torch.ops.linattn.short_conv_streams_bwd.default,
                                    (y, w, b, [16, 16], [4], True, grads), test_utils=checks)
    assert all(v == "SUCCESS" for v in result.values()), result


def test_registered_ops_read_a_padded_projection_in_place():
    """The ops take y with a row stride wider than its columns (inductor pads a matmul output's rows on CUDA, and
    the ops accept any strides) and give the contiguous call's outputs and gradients, contiguous as their fakes."""
    import linattn.layers.shortconv_joint  # noqa: F401

    gen = torch.Generator().manual_seed(13)
    y, w, b = (randn(*s, generator=gen).to(DEVICE) for s in ((2, 9, 36), (32, 4), (32,)))
    padded = torch.zeros(2, 9, 48, device=DEVICE)[..., :36]
    padded.copy_(y)
    grads = [randn(2, 9, 16, generator=gen).to(DEVICE), None, randn(2, 9, 4, generator=gen).to(DEVICE)]
    ops = torch.ops.linattn
    assert torch.Tag.flexible_layout in ops.short_conv_streams_fwd.default.tags
    assert torch.Tag.flexible_layout in ops.short_conv_streams_bwd.default.tags
    for got, want in zip(ops.short_conv_streams_fwd(padded, w, b, [16, 16], [4], True),
                         ops.short_conv_streams_fwd(y, w, b, [16, 16], [4], True)):
        assert got.is_contiguous() and torch.equal(got, want)
    for got, want in zip(ops.short_conv_streams_bwd(padded, w, b, [16, 16], [4], True, grads),
                         ops.short_conv_streams_bwd(y, w, b, [16, 16], [4], True, grads)):
        assert got.is_contiguous() and torch.equal(got, want)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="inductor pads matmul outputs on CUDA only")
def test_inductor_leaves_a_padded_projection_in_place():
    """Inductor on CUDA pads the joint projection's rows (1,544 columns: not a multiple of 128 bytes); the compiled
    layer copies nothing before the conv ops (no kernel named after them) and gives the eager numbers."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    torch.manual_seed(4)
    layer = build_mixer("gated_delta_rule", 512, 4).to(DEVICE)
    x = torch.randn(2, 64, 512, device=DEVICE, requires_grad=True)

    def loss(x):
        y, _ = layer(x, use_cache=False)
        return y.square().sum()

    compiled_loss = torch.compile(loss, fullgraph=True)
    with linattn.settings(shortconv_backend="triton"):
        eager = torch.autograd.grad(loss(x), [x, *layer.parameters()])
        compiled, code = run_and_get_code(
            lambda: torch.autograd.grad(compiled_loss(x), [x, *layer.parameters()]))  # forward and backward graphs
    assert not [line for line in "\n".join(code).splitlines() if "def triton" in line and "short_conv" in line]
    for a, e in zip(compiled, eager):
        assert_close(a, e, 1e-5, "gradient")  # the project's float32 tolerance


def test_compiled_layer_equals_eager():
    """A layer with Triton ShortConvs compiles without graph breaks and gives the eager numbers."""
    torch._dynamo.reset()
    torch.manual_seed(2)
    layer = build_mixer("gated_delta_rule", 64, 2, backend="chunk").to(DEVICE)
    x = torch.randn(2, 19, 64, device=DEVICE, requires_grad=True)

    def loss(x):
        y, _ = layer(x, use_cache=False)
        return y.square().sum()

    with linattn.settings(shortconv_backend="triton"):
        eager = torch.autograd.grad(loss(x), [x, *layer.parameters()])
        value = torch.compile(loss, fullgraph=True, backend="aot_eager")(x)
        compiled = torch.autograd.grad(value, [x, *layer.parameters()])
    for a, e in zip(compiled, eager):
        assert torch.allclose(a, e, rtol=1e-5, atol=1e-6)
