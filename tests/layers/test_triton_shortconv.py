"""ShortConv backends "triton" and "conv1d" == the multiply-add path: values, new cache and the gradients of
x, cache, weight and bias (fp32 1e-5, bf16 RMSE), every mode, W in {1, 3, 4}, T shorter than the kernel,
strided inputs, prefill + steps, backend selection and its errors.

Runs on CUDA when present, else on the CPU through Triton's interpreter (tests/conftest.py)."""

import pytest
import torch

from linattn.layers.shortconv import ShortConv, set_shortconv_backend
from linattn.ops.common.triton_compat import triton_available
from linattn.testing import assert_close, randn

pytestmark = [pytest.mark.triton, pytest.mark.skipif(not triton_available(), reason="triton not installed")]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def conv_module(D, W, activation="silu", bias=False, mode="learned", seed=0):
    torch.manual_seed(seed)
    m = ShortConv(D, kernel_size=W, activation=activation, bias=bias, mode=mode)
    if bias:
        torch.nn.init.normal_(m.bias)
    return m.to(DEVICE)


def run(m, backend, x, cache, seed=1):
    """(y, new cache, dx, dcache, dweight, dbias) of ``m`` with ``backend``: a fixed random cotangent on y and
    on the new cache (which is made of x and the cache)."""
    m.backend = backend
    x = x.detach().clone().requires_grad_(True)
    cache = None if cache is None else cache.detach().clone().requires_grad_(True)
    params = [p for p in (m.weight, m.bias) if isinstance(p, torch.nn.Parameter)]
    for p in params:
        p.grad = None
    y, new = m(x, cache)
    gen = torch.Generator().manual_seed(seed)
    loss = (y.float() * randn(*y.shape, generator=gen).to(DEVICE)).sum()
    loss = loss + (new.float() * randn(*new.shape, generator=gen).to(DEVICE)).sum()
    loss.backward()
    grads = [x.grad, None if cache is None else cache.grad] + [p.grad for p in params]
    return [y.detach(), new.detach()] + grads


def compare(m, x, cache, backends=("triton", "conv1d"), tol=1e-5, grad_tol=None, metric="rel", reference_fp32=False):
    up = (lambda t: t.float()) if reference_fp32 else (lambda t: t)
    expected = run(m, "muladd", up(x), None if cache is None else up(cache))
    names = ["y", "new cache", "dx", "dcache", "dweight", "dbias"]
    for backend in backends:
        got = run(m, backend, x, cache)
        for name, a, e in zip(names, got, expected):
            if e is None or e.numel() == 0:
                continue
            assert a is not None and a.shape == e.shape, f"{backend}: {name} missing or of another shape"
            assert_close(a, e, tol if name in ("y", "new cache") else (grad_tol or tol), f"{backend}: {name}", metric)


@pytest.mark.parametrize("T", [1, 2, 37, 70])
@pytest.mark.parametrize("with_cache", [False, True])
def test_matches_muladd_fp32(T, with_cache):
    m = conv_module(40, 4, bias=True)
    gen = torch.Generator().manual_seed(T)
    x = randn(2, T, 40, generator=gen).to(DEVICE)
    cache = randn(2, 3, 40, generator=gen).to(DEVICE) if with_cache else None
    compare(m, x, cache)


@pytest.mark.parametrize("programs", [1, 3])
def test_backward_programs_walking_several_row_blocks(programs, monkeypatch):
    """Few programs: each walks several row blocks (2 of 3 per program with 3, the last one half empty)."""
    from linattn.layers import shortconv_triton

    monkeypatch.setitem(shortconv_triton.LAUNCH, "bwd_programs", programs)
    m = conv_module(40, 4, bias=True)
    gen = torch.Generator().manual_seed(11)
    compare(m, randn(2, 70, 40, generator=gen).to(DEVICE), randn(2, 3, 40, generator=gen).to(DEVICE),
            backends=("triton",))


@pytest.mark.parametrize("W,activation,mode", [(3, None, "learned"), (1, "silu", "learned"), (4, "silu", "shift"),
                                               (4, "silu", "identity"), (2, "silu", "learned")])
def test_kernel_sizes_activations_and_modes(W, activation, mode):
    m = conv_module(24, W, activation=activation, mode=mode)
    gen = torch.Generator().manual_seed(W)
    x = randn(3, 19, 24, generator=gen).to(DEVICE)
    compare(m, x, randn(3, W - 1, 24, generator=gen).to(DEVICE))


def test_bf16_against_float32_muladd():
    m = conv_module(64, 4, bias=True)
    gen = torch.Generator().manual_seed(5)
    x = randn(2, 45, 64, generator=gen).to(DEVICE).bfloat16()
    cache = randn(2, 3, 64, generator=gen).to(DEVICE).bfloat16()
    # float32 multiply-adds on the same bf16-rounded inputs
    compare(m, x, cache, backends=("triton",), tol=5e-3, grad_tol=1e-2, metric="rmse", reference_fp32=True)


def test_strided_inputs():
    m = conv_module(32, 4)
    gen = torch.Generator().manual_seed(7)
    wide = randn(2, 21, 96, generator=gen).to(DEVICE)
    compare(m, wide[:, :, 32:64], None, backends=("triton",))  # time stride 96: passed to the kernel
    compare(m, randn(2, 32, 21, generator=gen).to(DEVICE).transpose(1, 2), None, backends=("triton",))  # copied


def test_prefill_then_steps_equal_full():
    m = conv_module(16, 4)
    m.backend = "triton"
    x = randn(2, 12, 16, generator=torch.Generator().manual_seed(8)).to(DEVICE)
    with torch.no_grad():
        y, last = m(x)
        y1, cache = m(x[:, :2])  # prefill shorter than the kernel
        ys = [y1]
        for t in range(2, 12):
            yt, cache = m(x[:, t:t + 1], cache)
            ys.append(yt)
    assert_close(torch.cat(ys, 1), y, 1e-6, "triton: prefill 2 + 10 steps vs full")
    assert torch.equal(cache, last) and torch.equal(last, x[:, -3:])


def test_backend_selection_and_errors(monkeypatch):
    from linattn.layers import build_mixer

    layer = build_mixer("gated_delta_rule", 32, 2, short_conv="qkv").to(DEVICE)
    x = torch.randn(2, 9, 32, device=DEVICE)
    y_ref, _ = layer(x)
    assert set_shortconv_backend(layer, "triton") == 3
    assert all(c.backend == "triton" for c in layer.convs.values())
    y, _ = layer(x)
    assert_close(y, y_ref, 1e-5, "gated_delta_rule layer with triton ShortConvs")
    with pytest.raises(ValueError, match="backend must be one of"):
        set_shortconv_backend(layer, "cudnn")
    conv = conv_module(8, 4)
    conv.backend = "cudnn"
    with pytest.raises(ValueError, match="ShortConv.backend must be one of"):
        conv(torch.randn(1, 5, 8, device=DEVICE))
    if DEVICE == "cpu":
        monkeypatch.delenv("TRITON_INTERPRET")
        conv.backend = "triton"
        with pytest.raises(ValueError, match="needs CUDA tensors"):
            conv(torch.randn(1, 5, 8))


def test_shortconv_bench_runs(tmp_path):
    """The benchmark runs (small, CPU interpreter or CUDA), writes JSON, and every backend agrees with muladd."""
    import json

    from linattn.bench.shortconv import main

    out = tmp_path / "shortconv.json"
    rows = main(["--B", "1", "--T", "20", "--D", "16", "--repeats", "1", "--dtype", "float32", "--out", str(out)])
    assert json.loads(out.read_text())["rows"] == rows and len(rows) == 1
    assert rows[0]["triton_err"] < 1e-5 and rows[0]["conv1d_err"] < 1e-5 and rows[0]["triton_fwdbwd_ms"] > 0


def test_custom_op_registration():
    """torch.library.opcheck of the forward and backward ops: schema, fake (meta) kernel, AOT dispatch
    (torch.compile). Autograd falls through them by design (an autograd Function differentiates the pair), so
    opcheck's autograd-registration test does not apply."""
    import linattn.layers.shortconv_triton  # noqa: F401  (registers linattn::short_conv_fwd / _bwd)

    gen = torch.Generator().manual_seed(12)
    x, cache, w, b, dy = (randn(*s, generator=gen).to(DEVICE) for s in ((2, 9, 16), (2, 3, 16), (16, 4), (16,),
                                                                         (2, 9, 16)))
    checks = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")
    result = torch.library.opcheck(torch.ops.linattn.short_conv_fwd.default, (x, cache, w, b, True),
                                   test_utils=checks)
    result |= torch.library.opcheck(torch.ops.linattn.short_conv_bwd.default, (x, cache, w, b, True, dy),
                                    test_utils=checks)
    assert all(v == "SUCCESS" for v in result.values()), result
