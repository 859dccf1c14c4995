"""Fused Triton decoding steps == the PyTorch steps (fp32 1e-5, bf16 RMSE), K != V, strong gates, in place,
strided inputs; many steps through the public step functions == the recurrent op; the dispatch rules.

Runs on CUDA when present, else on the CPU through Triton's interpreter (tests/conftest.py)."""

import pytest
import torch

from linattn.ops.common.triton_compat import triton_available
from linattn.ops.common.triton_step import get_step_backend, select_step, set_step_backend
from linattn.ops.delta_rule import delta_rule, delta_rule_step
from linattn.ops.gated_delta_rule import gated_delta_rule, gated_delta_rule_step
from linattn.ops.gated_delta_rule.reference import gated_delta_step_reference
from linattn.ops.gla import gla, gla_step
from linattn.ops.gla.reference import gla_step_reference
from linattn.ops.simple_gla import simple_gla, simple_gla_step
from linattn.ops.simple_gla.reference import simple_gla_step_reference
from linattn.testing import assert_close, l2norm, log_gate, randn

pytestmark = [pytest.mark.triton, pytest.mark.skipif(not triton_available(), reason="triton not installed")]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FAMILIES = ["simple_gla", "gla", "gated_delta_rule", "delta_rule"]


@pytest.fixture
def fused_backend(monkeypatch):
    """Force the fused kernel (under the interpreter on CPU) and count its calls by family; restore afterwards."""
    from linattn.ops.common import triton_step_kernel

    calls = dict.fromkeys(triton_step_kernel.STEP_KERNELS, 0)

    def counting(family, fn):
        def run(*args, **kwargs):
            calls[family] += 1
            return fn(*args, **kwargs)
        return run

    for family, fn in list(triton_step_kernel.STEP_KERNELS.items()):
        monkeypatch.setitem(triton_step_kernel.STEP_KERNELS, family, counting(family, fn))
    previous = set_step_backend("triton")
    yield calls
    set_step_backend(previous)


def kernels():
    from linattn.ops.common.triton_step_kernel import gated_delta_step_triton, gla_step_triton, simple_gla_step_triton

    return simple_gla_step_triton, gla_step_triton, gated_delta_step_triton


def step_inputs(family, B, T, H, K, V, seed=0, low=-0.5):
    """q, k, v [B, T, H, *], gate (or None), beta (or None), initial state; keys L2-normalised for delta rules."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v = randn(B, T, H, K, generator=gen), randn(B, T, H, K, generator=gen), randn(B, T, H, V, generator=gen)
    gate_shape = (B, T, H, K) if family == "gla" else (B, T, H)
    g = None if family == "delta_rule" else log_gate(*gate_shape, generator=gen, low=low)
    beta = torch.rand(B, T, H, generator=gen) if "delta" in family else None
    if beta is not None:
        k = l2norm(k)
    s0 = randn(B, H, K, V, generator=gen)
    return [None if x is None else x.to(DEVICE) for x in (q, k, v, g, beta, s0)]


def one_step(family, fused, q, k, v, g, beta, state, scale=0.4):
    """One token through the fused kernel or the PyTorch reference step (inputs [B, H, *])."""
    sgla, gla_k, delta = kernels() if fused else (simple_gla_step_reference, gla_step_reference,
                                                 gated_delta_step_reference)
    if family == "simple_gla":
        return sgla(q, k, v, g, state, scale=scale)
    if family == "gla":
        return gla_k(q, k, v, g, state, scale=scale)
    return delta(q, k, v, g, beta, state, scale=scale)


def first_token(family, B, H, K, V, **kw):
    """q, k, v, g, beta of one token ([B, H, *]) and a state [B, H, K, V]."""
    *xs, s0 = step_inputs(family, B, 1, H, K, V, **kw)
    return [None if x is None else x[:, 0] for x in xs] + [s0]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("K,V", [(20, 36), (32, 16)])
@pytest.mark.parametrize("with_state", [False, True])
def test_kernel_matches_torch_step_fp32(family, K, V, with_state):
    q, k, v, g, beta, s0 = first_token(family, 2, 3, K, V)
    s0 = s0 if with_state else None
    o, S = one_step(family, True, q, k, v, g, beta, s0)
    o_ref, S_ref = one_step(family, False, q, k, v, g, beta, s0)
    assert o.dtype == q.dtype and S.dtype == torch.float32 and S.shape == S_ref.shape
    assert_close(o, o_ref, 1e-5, f"{family}: o_t")
    assert_close(S, S_ref, 1e-5, f"{family}: state")


@pytest.mark.parametrize("family", FAMILIES)
def test_kernel_bf16(family):
    q, k, v, g, beta, s0 = first_token(family, 2, 2, 16, 48, seed=1)
    qb, kb, vb = (x.bfloat16() for x in (q, k, v))
    gb = None if g is None else g.bfloat16()
    o, S = one_step(family, True, qb, kb, vb, gb, beta, s0)
    # float32 reference on the same bf16-rounded inputs
    o_ref, S_ref = one_step(family, False, qb.float(), kb.float(), vb.float(), None if gb is None else gb.float(),
                            beta, s0)
    assert o.dtype == torch.bfloat16 and S.dtype == torch.float32
    assert_close(o, o_ref, 5e-3, f"{family} bf16: o_t", metric="rmse")
    assert_close(S, S_ref, 1e-5, f"{family} bf16: state (float32 math)")


@pytest.mark.parametrize("family", ["simple_gla", "gla", "gated_delta_rule"])
def test_kernel_strong_gate(family):
    q, k, v, g, beta, s0 = first_token(family, 1, 2, 16, 16)
    g = torch.full_like(g, -20.0)
    o, S = one_step(family, True, q, k, v, g, beta, 1e3 * s0)
    o_ref, S_ref = one_step(family, False, q, k, v, g, beta, 1e3 * s0)
    assert torch.isfinite(o).all() and torch.isfinite(S).all()
    assert_close(o, o_ref, 1e-5, f"{family} g=-20: o_t")
    assert_close(S, S_ref, 1e-5, f"{family} g=-20: state")


def test_kernel_in_place_and_strided_inputs():
    from linattn.ops.common.triton_step_kernel import fused_step

    B, H, K, V = 2, 3, 16, 24
    gen = torch.Generator().manual_seed(3)
    wide = randn(B, H, 3 * K, generator=gen).to(DEVICE)
    q, k = wide[..., :K], wide[..., K:2 * K]  # head strides 3K: not contiguous
    v = randn(B, H, V, generator=gen).to(DEVICE)
    g = log_gate(H, generator=gen).to(DEVICE).expand(B, H)  # batch stride 0, as retention's constant gate
    beta = torch.rand(B, H, generator=gen).to(DEVICE)
    state = randn(B, H, K, V, generator=gen).to(DEVICE)
    o_ref, S_ref = gated_delta_step_reference(q, l2norm(k), v, g, beta, state, scale=0.5)
    before = state.data_ptr()
    o, S = fused_step(q, l2norm(k), v, state, scale=0.5, gate="scalar", g_t=g, beta_t=beta, inplace=True)
    assert S is state and S.data_ptr() == before
    assert_close(o, o_ref, 1e-5, "in place: o_t")
    assert_close(state, S_ref, 1e-5, "in place: state")


OPS = {
    "simple_gla": (simple_gla, simple_gla_step),
    "gla": (gla, gla_step),
    "gated_delta_rule": (gated_delta_rule, gated_delta_rule_step),
    "delta_rule": (delta_rule, delta_rule_step),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_public_steps_equal_recurrent_op(family, fused_backend):
    """40 tokens through op_step (dispatched to the kernel) == the recurrent op over the sequence."""
    op, op_step = OPS[family]
    T = 40
    q, k, v, g, beta, s0 = step_inputs(family, 2, T, 2, 24, 20, seed=2)
    args = {name: x for name, x in (("g", g), ("beta", beta)) if x is not None}
    o_ref, S_ref = op(q, k, v, **args, initial_state=s0, output_final_state=True, backend="recurrent")
    S, outs = s0, []
    with torch.no_grad():
        for t in range(T):
            o_t, S = op_step(q[:, t], k[:, t], v[:, t], **{name: a[:, t] for name, a in args.items()}, state=S)
            outs.append(o_t)
    assert fused_backend["gated_delta_rule" if family == "delta_rule" else family] == T  # every step was fused
    assert_close(torch.stack(outs, 1), o_ref, 1e-5, f"{family}: {T} fused steps vs recurrent, outputs")
    assert_close(S, S_ref, 1e-5, f"{family}: {T} fused steps vs recurrent, final state")


def test_dispatch_rules(fused_backend):
    from linattn.ops.common.triton_step_kernel import STEP_KERNELS

    simple_gla_step_triton = STEP_KERNELS["simple_gla"]
    ref = simple_gla_step_reference
    x = torch.randn(2, 2, 16, device=DEVICE)
    assert select_step("simple_gla", ref, x, None) is simple_gla_step_triton
    assert select_step("simple_gla", ref, x.double()) is ref  # float64 stays on PyTorch
    needs_grad = x.clone().requires_grad_(True)
    assert select_step("simple_gla", ref, needs_grad) is ref  # no backward in the kernel
    with torch.no_grad():
        assert select_step("simple_gla", ref, needs_grad) is simple_gla_step_triton
    assert select_step("simple_gla", ref, torch.randn(2, 2, 1024, device=DEVICE)) is ref  # K too wide for a tile
    set_step_backend("torch")
    assert select_step("simple_gla", ref, x) is ref
    set_step_backend("auto")
    assert select_step("simple_gla", ref, x) is (simple_gla_step_triton if x.is_cuda else ref)
    with pytest.raises(ValueError, match="step backend"):
        set_step_backend("fast")
    assert get_step_backend() == "auto"


def test_layer_decoding_with_fused_steps(fused_backend):
    """A gated DeltaNet layer: prefill then fused single-token steps == one full forward."""
    from linattn.layers import build_mixer

    torch.manual_seed(0)
    layer = build_mixer("gated_delta_rule", 32, 2).to(DEVICE)
    x = torch.randn(2, 9, 32, device=DEVICE)
    with torch.no_grad():
        y, _ = layer(x)
        ys, cache = [], None
        y1, cache = layer(x[:, :4])
        ys.append(y1)
        for t in range(4, 9):
            yt, cache = layer(x[:, t:t + 1], cache)
            ys.append(yt)
    assert fused_backend["gated_delta_rule"] == 5
    assert_close(torch.cat(ys, 1), y, 1e-5, "gated_delta_rule layer: prefill 4 + 5 fused steps vs full")


def test_decode_step_bench_runs(tmp_path):
    """The benchmark runs (small, CPU interpreter or CUDA), writes JSON, and its fused rows agree with torch."""
    import json

    from linattn.bench.decode_step import main

    out = tmp_path / "decode_step.json"
    rows = main(["--families", "simple_gla,delta_rule", "--B", "1", "--H", "2", "--K", "16", "--steps", "1",
                 "--repeats", "1", "--out", str(out)])
    assert [r["family"] for r in rows] == ["simple_gla", "delta_rule"]
    assert json.loads(out.read_text())["rows"] == rows
    for r in rows:
        assert r["fused_err_o"] < 1e-5 and r["fused_err_state"] < 1e-5 and r["fused_us"] > 0


@pytest.mark.parametrize("name", ["retention", "linear_attn"])
def test_retention_and_linear_attn_steps_use_the_fused_kernel(name, fused_backend):
    """retention and linear_attn decode through the simple_gla step kernel: 30 fused steps == the
    recurrent op (linear attention with its normaliser, which rides along as an extra value column)."""
    from linattn.ops.linear_attn import linear_attn, linear_attn_step
    from linattn.ops.retention import retention, retention_step

    op, op_step = (retention, retention_step) if name == "retention" else (linear_attn, linear_attn_step)
    kwargs = {} if name == "retention" else {"feature_map": "elu", "normalize": True}
    T = 30
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, T, 2, 16, generator=gen).to(DEVICE) for _ in range(3))
    o_ref, S_ref = op(q, k, v, output_final_state=True, backend="recurrent", **kwargs)
    S, outs = None, []
    with torch.no_grad():
        for t in range(T):
            o_t, S = op_step(q[:, t], k[:, t], v[:, t], state=S, **kwargs)
            outs.append(o_t)
    assert fused_backend["simple_gla"] == T  # every step ran on the fused kernel
    assert_close(torch.stack(outs, 1), o_ref, 1e-5, f"{name}: {T} fused steps vs recurrent, outputs")
    assert_close(S, S_ref, 1e-5, f"{name}: {T} fused steps vs recurrent, final state")


def test_the_step_kernel_keeps_rows_and_heads_on_the_grid_s_first_axis(monkeypatch):
    """CUDA caps a grid's second and third axes at 65,535 programs: the step's B*H (times value blocks) lie on the
    first, so decoding more rows times heads than that launches."""
    from linattn.ops.common import triton_step_kernel
    from linattn.ops.common.triton_launch import FastKernel

    grids = []
    launch = FastKernel.launch
    monkeypatch.setattr(FastKernel, "launch", lambda self, grid, args, kwargs: grids.append(tuple(grid)) or launch(
        self, grid, args, kwargs))
    B, H, K, V = 3, 2, 16, 40  # V = 40: three value blocks of 16
    q, k, v = (randn(B, H, d).to(DEVICE) for d in (K, K, V))
    k, g = l2norm(k), log_gate(B, H).to(DEVICE)
    o, S = triton_step_kernel.simple_gla_step_triton(q, k, v, g, None, scale=0.5)
    o_ref, S_ref = simple_gla_step_reference(q, k, v, g, None, scale=0.5)
    assert grids == [(3 * B * H,)]
    assert_close(o, o_ref, 1e-5, "o")
    assert_close(S, S_ref, 1e-5, "state")
