"""The plain-PyTorch baselines against their recurrences written out token by token, and their checks."""

import pytest
import torch
import torch.nn.functional as F

from linattn.layers import LRULayer, MambaLayer
from linattn.layers.scan import diagonal_scan, linear_scan
from linattn.testing import assert_close


def test_linear_scan_matches_loop_real_and_complex():
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float64, torch.complex128):
        a = torch.rand(2, 19, 3, generator=gen, dtype=torch.float64).to(dtype) * 0.9
        if dtype.is_complex:
            a = a * torch.exp(1j * torch.randn(2, 19, 3, generator=gen, dtype=torch.float64))
        b = torch.randn(2, 19, 3, generator=gen, dtype=torch.float64).to(dtype)
        h0 = torch.randn(2, 3, generator=gen, dtype=torch.float64).to(dtype)
        h, hs = h0, []
        for t in range(19):
            h = a[:, t] * h + b[:, t]
            hs.append(h)
        err = (linear_scan(a, b, h0) - torch.stack(hs, 1)).abs().max() / torch.stack(hs, 1).abs().max()
        assert err < 1e-12, f"scan {dtype}: {err}"


@pytest.mark.parametrize("T, chunk", [(1, 4), (3, 4), (8, 4), (19, 4), (19, 64)])
@pytest.mark.parametrize("with_h0", [False, True])
def test_diagonal_scan_matches_the_doubling_scan(T, chunk, with_h0):
    """Values and gradients (of log a, b, h0) of the chunkwise time-invariant scan equal the generic scan's,
    for whole and partial chunks, one chunk and many, complex and real."""
    gen = torch.Generator().manual_seed(T)
    for dtype in (torch.complex128, torch.float64):
        log_a = torch.complex(-torch.rand(3, generator=gen, dtype=torch.float64) * 0.5,
                              torch.randn(3, generator=gen, dtype=torch.float64))
        log_a = (log_a if dtype.is_complex else log_a.real).requires_grad_()
        b = torch.randn(2, T, 3, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
        h0 = torch.randn(2, 3, generator=gen, dtype=torch.float64).to(dtype).requires_grad_() if with_h0 else None
        got = diagonal_scan(log_a, b, h0, chunk)
        want = linear_scan(torch.exp(log_a).expand(2, T, 3), b, h0)
        assert_close(torch.view_as_real(got) if dtype.is_complex else got,
                     torch.view_as_real(want) if dtype.is_complex else want, 1e-12, f"diagonal scan {dtype}")
        w = torch.randn(2, T, 3, generator=gen, dtype=torch.float64).to(dtype)
        inputs = [log_a, b] + ([h0] if with_h0 else [])
        g_got = torch.autograd.grad((got * w).real.sum(), inputs)
        # the doubling scan never reads a for a single token without h0: its gradient there is zero
        g_want = torch.autograd.grad((want * w).real.sum(), inputs, allow_unused=True)
        for name, a, e, inp in zip(("log_a", "b", "h0"), g_got, g_want, inputs):
            e = torch.zeros_like(inp) if e is None else e
            if dtype.is_complex:
                a, e = torch.view_as_real(a), torch.view_as_real(e)
            assert_close(a, e, 1e-11, f"d{name} {dtype}")


def test_lru_runs_in_float32_under_bf16_autocast():
    """Under autocast the projections would come out in bf16, from which no complex tensor can be built: the
    recurrence runs in complex64, the output has x's dtype, and forward and backward agree with float32."""
    torch.manual_seed(3)
    layer = LRULayer(16, state_dim=12, chunk_size=8)
    x = torch.randn(2, 37, 16, requires_grad=True)
    y32, _ = layer(x, use_cache=False)
    g = torch.randn_like(y32)
    grads32 = torch.autograd.grad((y32 * g).sum(), [x, *layer.parameters()])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, cache = layer(x)
    assert y.dtype == torch.float32 and cache.state.dtype == torch.complex64
    assert_close(y, y32, 1e-6, "LRU under autocast vs float32")
    grads = torch.autograd.grad((y * g).sum(), [x, *layer.parameters()])
    for (name, _), a, e in zip([("x", None), *layer.named_parameters()], grads, grads32):
        assert_close(a, e, 1e-5, f"d{name} under autocast vs float32")
    xb = x.detach().bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        yb, _ = layer(xb, use_cache=False)
    assert yb.dtype == torch.bfloat16
    assert_close(yb.float(), layer(xb.float(), use_cache=False)[0], 1e-2, "bf16 input, bf16 output")


def test_lru_matches_its_recurrence():
    torch.manual_seed(1)
    layer = LRULayer(8, state_dim=6).double()
    x = torch.randn(2, 9, 8, dtype=torch.float64)
    y, cache = layer(x)
    lam = torch.exp(torch.complex(-torch.exp(layer.nu_log), torch.exp(layer.theta_log)))
    gamma = torch.sqrt(1 - lam.abs() ** 2)
    Bc, Cc = torch.complex(layer.B_re, layer.B_im), torch.complex(layer.C_re, layer.C_im)
    h = torch.zeros(2, 6, dtype=torch.complex128)
    ys = []
    for t in range(9):
        h = lam * h + gamma * (x[:, t].to(torch.complex128) @ Bc.T)
        ys.append((h @ Cc.T).real + layer.D * x[:, t])
    assert_close(y, torch.stack(ys, 1), 1e-10, "LRU vs loop")
    assert_close(cache.state.abs(), h.abs(), 1e-10, "LRU state")


def test_mamba_matches_its_recurrence():
    torch.manual_seed(2)
    layer = MambaLayer(8, state_dim=4, expand=2, chunk_size=4, short_conv="").double()
    x = torch.randn(2, 10, 8, dtype=torch.float64)
    y, _ = layer(x)
    xin, z = layer.in_proj(x).chunk(2, -1)
    u = F.silu(xin)
    r, Bm, Cm = layer.x_proj(u).split([layer.dt_rank, 4, 4], -1)
    dt = F.softplus(layer.dt_proj(r) + layer.dt_bias)
    A = -torch.exp(layer.A_log.double())
    h = torch.zeros(2, 16, 4, dtype=torch.float64)
    outs = []
    for t in range(10):
        h = torch.exp(dt[:, t, :, None] * A) * h + (dt[:, t] * u[:, t])[:, :, None] * Bm[:, t, None, :]
        outs.append((h @ Cm[:, t, :, None])[..., 0] + layer.D * u[:, t])
    expected = layer.out_proj(torch.stack(outs, 1) * F.silu(z))
    assert_close(y, expected, 1e-10, "Mamba vs loop")


def test_baseline_checks():
    with pytest.raises(ValueError, match="tie_kv=True is not available for lru"):
        LRULayer(8, tie_kv=True)
    with pytest.raises(ValueError, match="short_conv must be a subset of 'v'"):
        MambaLayer(8, short_conv="k")
    with pytest.raises(ValueError, match="conv_mode must be one of"):
        MambaLayer(8, conv_mode="fixed")
    with pytest.raises(ValueError, match=r"x must have shape \[B, T, d_model\] with d_model = 8"):
        LRULayer(8)(torch.randn(1, 3, 7))


@pytest.mark.parametrize("mixer", ["lru", "mamba"])
def test_bidirectional_classifier_trains_under_bf16_autocast(mixer):
    """The LRA classifier around a baseline, as the Trainer runs it with precision bf16: forward and backward
    run, and the logits stay within bf16 rounding of float32."""
    from linattn.models import ModelConfig, SequenceClassifier

    torch.manual_seed(0)
    clf = SequenceClassifier(ModelConfig(vocab_size=20, mixer=mixer, d_model=16, n_layers=2, n_heads=1), 2,
                             bidirectional=True)
    ids = torch.randint(0, 20, (3, 40))
    want = clf(ids)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = clf(ids)
    got.float().sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in clf.parameters())
    assert_close(got.float(), want, 2e-2, f"{mixer} classifier under bf16 autocast vs float32")
