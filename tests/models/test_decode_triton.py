"""The Triton kernels of static decoding: the fused op steps writing the state they read (inplace=True) ==
the PyTorch steps, the ShortConv step kernel (in place and into a new cache) == the multiply-adds, and a
model's static steps with both kernels == its cached PyTorch steps.

Runs on CUDA when present, else on the CPU through Triton's interpreter (tests/conftest.py)."""

import pytest
import torch

from linattn.layers.shortconv import ShortConv, set_shortconv_backend
from linattn.models import CausalLM, ModelConfig
from linattn.ops.common.triton_compat import triton_available
from linattn.ops.common.triton_step import set_step_backend
from linattn.ops.delta_rule import delta_rule_step
from linattn.ops.gated_delta_rule import gated_delta_rule_step
from linattn.ops.gla import gla_step
from linattn.ops.linear_attn import linear_attn_step
from linattn.ops.retention import retention_step
from linattn.ops.simple_gla import simple_gla_step
from linattn.testing import assert_close, l2norm, log_gate, randn

pytestmark = [pytest.mark.triton, pytest.mark.skipif(not triton_available(), reason="triton not installed"),
              pytest.mark.usefixtures("one_thread")]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
B, H, K, V = 2, 2, 16, 24


@pytest.fixture
def step_backend():
    """Run a test with the step backend set by ``step_backend(name)``; restored afterwards."""
    previous = set_step_backend("auto")
    yield set_step_backend
    set_step_backend(previous)


def token(name, gen):
    """One token's arguments of op ``name`` ([B, H, *]) and a state [B, H, K, V (+1)]."""
    q, k, v = randn(B, H, K, generator=gen), randn(B, H, K, generator=gen), randn(B, H, V, generator=gen)
    beta = torch.rand(B, H, generator=gen)
    args = {"simple_gla": (q, k, v, log_gate(B, H, generator=gen)),
            "gla": (q, k, v, log_gate(B, H, K, generator=gen)),
            "gated_delta_rule": (q, l2norm(k), v, log_gate(B, H, generator=gen), beta),
            "delta_rule": (q, l2norm(k), v, beta),
            "retention": (q, k, v), "linear_attn": (q, k, v)}[name]
    state = randn(B, H, K, V + (name == "linear_attn"), generator=gen)
    return [a.to(DEVICE) for a in args], state.to(DEVICE)


STEPS = {"simple_gla": simple_gla_step, "gla": gla_step, "gated_delta_rule": gated_delta_rule_step,
         "delta_rule": delta_rule_step, "retention": retention_step, "linear_attn": linear_attn_step}
KWARGS = {"linear_attn": {"feature_map": "elu", "normalize": True}}


@pytest.mark.parametrize("name", list(STEPS))
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_op_steps_write_the_state_they_read(name, backend, step_backend):
    """Four steps with inplace=True: the state buffer keeps its address and holds what the PyTorch steps give."""
    gen = torch.Generator().manual_seed(0)
    step, kw = STEPS[name], KWARGS.get(name, {})
    tokens, s0 = zip(*(token(name, gen) for _ in range(4)))
    step_backend("torch")
    S_ref, outs_ref = s0[0], []
    with torch.no_grad():
        for args in tokens:
            o, S_ref = step(*args, state=S_ref, **kw)
            outs_ref.append(o)
        step_backend(backend)
        buf = s0[0].clone()
        address = buf.data_ptr()
        for t, args in enumerate(tokens):
            o, S = step(*args, state=buf, inplace=True, **kw)
            assert S is buf and buf.data_ptr() == address, f"{name}: the state was not written in place"
            assert_close(o, outs_ref[t], 1e-5, f"{name} ({backend}): o_t at step {t}")
    assert_close(buf, S_ref, 1e-5, f"{name} ({backend}): state after 4 in-place steps")


def test_inplace_argument_checks():
    (q, k, v, g), _ = token("simple_gla", torch.Generator().manual_seed(1))
    with pytest.raises(ValueError, match="inplace=True needs the state tensor"):
        simple_gla_step(q, k, v, g, inplace=True)
    with pytest.raises(TypeError, match="inplace must be a bool"):
        simple_gla_step(q, k, v, g, state=torch.zeros(B, H, K, V, device=DEVICE), inplace=1)


def test_fused_step_in_place_on_a_strided_state_copies_back():
    from linattn.ops.common.triton_step_kernel import fused_step
    from linattn.ops.simple_gla.reference import simple_gla_step_reference

    (q, k, v, g), s0 = token("simple_gla", torch.Generator().manual_seed(2))
    wide = torch.zeros(B, H, K, 2 * V, device=DEVICE)
    state = wide[..., :V]  # not contiguous: the kernel works on a copy, then writes it back
    state.copy_(s0)
    o_ref, S_ref = simple_gla_step_reference(q, k, v, g, s0, scale=0.3)
    o, S = fused_step(q, k, v, state, scale=0.3, gate="scalar", g_t=g, inplace=True)
    assert S is state
    assert_close(o, o_ref, 1e-5, "strided in place: o_t")
    assert_close(state, S_ref, 1e-5, "strided in place: state")
    assert not wide[..., V:].any()


@pytest.mark.parametrize("W,activation,bias", [(4, "silu", False), (4, None, True), (2, "silu", True),
                                               (1, "silu", False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv_step_kernel_equals_muladd(W, activation, bias, dtype):
    """Three single-token steps: y and the cache == the multiply-adds, in place (static_step) and into a new
    cache (forward, which leaves the caller's cache as it was)."""
    torch.manual_seed(3)
    D = 300  # two channel blocks, the second partly masked
    conv = ShortConv(D, kernel_size=W, activation=activation, bias=bias).to(DEVICE)
    if bias:
        torch.nn.init.normal_(conv.bias)
    gen = torch.Generator().manual_seed(4)
    xs = [randn(B, 1, D, generator=gen).to(DEVICE, dtype) for _ in range(3)]
    cache0 = randn(B, W - 1, D, generator=gen).to(DEVICE, dtype)
    tol, metric = (1e-5, "rel") if dtype == torch.float32 else (1e-2, "rmse")
    with torch.no_grad():
        conv.backend = "muladd"
        ref_cache, ref = cache0, []
        for x in xs:
            y, ref_cache = conv(x, ref_cache)
            ref.append(y)
        conv.backend = "triton"
        buf, new = cache0.clone(), cache0.clone()
        for t, x in enumerate(xs):
            before = new.clone()
            y_new, new_next = conv(x, new)
            assert torch.equal(new, before), "forward changed the caller's cache"
            new = new_next
            y_in = conv.static_step(x, buf)
            assert_close(y_in, ref[t], tol, f"W={W} {dtype}: y in place, step {t}", metric)
            assert_close(y_new, ref[t], tol, f"W={W} {dtype}: y into a new cache, step {t}", metric)
    assert torch.equal(buf, ref_cache) and torch.equal(new, ref_cache)  # the cache holds inputs: exact


@pytest.mark.skipif(DEVICE != "cpu", reason="the error is for CPU tensors without the interpreter")
def test_conv_step_kernel_on_the_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    conv = ShortConv(8)
    conv.backend = "triton"
    with torch.no_grad(), pytest.raises(ValueError, match="ShortConv backend 'triton' needs CUDA tensors"):
        conv.static_step(torch.randn(1, 1, 8), torch.zeros(1, 3, 8))


@pytest.mark.parametrize("mixer", ["gated_delta_rule", "delta_rule", "gla", "mamba2", "retention", "linear_attn"])
def test_model_static_steps_on_the_kernels(mixer, step_backend, monkeypatch):
    """ShortConvs on q, k, v; fused op steps and conv steps (triton) on static buffers == cached PyTorch steps."""
    from linattn.layers import shortconv_step
    from linattn.ops.common import triton_step_kernel

    calls = {"op": 0, "conv": 0}

    def counting(kind, fn):
        def run(*args, **kwargs):
            calls[kind] += 1
            return fn(*args, **kwargs)
        return run

    for family, fn in list(triton_step_kernel.STEP_KERNELS.items()):
        monkeypatch.setitem(triton_step_kernel.STEP_KERNELS, family, counting("op", fn))
    monkeypatch.setattr(shortconv_step, "conv_step_triton", counting("conv", shortconv_step.conv_step_triton))
    torch.manual_seed(5)
    cfg = ModelConfig(mixer=mixer, d_model=32, n_layers=2, n_heads=2, vocab_size=40,
                      mixer_kwargs={"short_conv": "qkv"})
    model = CausalLM(cfg).to(DEVICE).eval()
    ids = torch.randint(0, 40, (2, 8), generator=torch.Generator().manual_seed(6)).to(DEVICE)
    with torch.no_grad():
        step_backend("torch")
        set_shortconv_backend(model, "muladd")
        logits, cache = model(ids[:, :5])
        static = model.allocate_static_cache(2, 8)
        static.load(model, cache, torch.arange(2, device=DEVICE), 5)
        expected = []
        for t in range(5, 8):
            out, cache = model(ids[:, t:t + 1], cache)
            expected.append(out[:, 0])
        step_backend("triton")
        set_shortconv_backend(model, "triton")
        for t in range(5, 8):
            got = model.static_step(ids[:, t], static)
            assert_close(got, expected[t - 5], 1e-5, f"{mixer}: fused static step at position {t}")
    assert calls == {"op": 3 * 2, "conv": 3 * 2 * 3}  # 3 steps x 2 layers (x 3 ShortConvs)
