"""ShortConv over packed sequences (cu_seqlens): each sequence convolved alone, on every backend; no input of one
document reaches another's outputs; per-sequence caches in and out; bad packing refused by name."""

from __future__ import annotations

import pytest
import torch

from linattn.layers import ShortConv
from linattn.testing import assert_same_gradients

LENGTHS = (2, 1, 7, 3)  # shorter than the kernel, one token, longer than it
D, W = 5, 4
CU = torch.tensor([0, 2, 3, 10, 13], dtype=torch.int32)


@pytest.mark.parametrize("with_cache", [False, True], ids=["zeros", "cache"])
@pytest.mark.parametrize("backend", ["muladd", "conv1d", "triton"])
def test_packed_equals_separate(backend: str, with_cache: bool) -> None:
    # the Triton kernels take CUDA tensors where there is a GPU (else the CPU interpreter runs them)
    device = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    conv = ShortConv(D, kernel_size=W, bias=True).to(device)
    conv.backend = backend
    x = torch.randn(1, sum(LENGTHS), D, device=device, requires_grad=True)
    cache = torch.randn(len(LENGTHS), W - 1, D, device=device, requires_grad=True) if with_cache else None
    y, new_cache = conv(x, cache, cu_seqlens=CU.to(device))

    ys, caches = [], []
    for i, (s, e) in enumerate(zip(CU[:-1].tolist(), CU[1:].tolist(), strict=True)):
        y_i, c_i = conv(x[:, s:e], None if cache is None else cache[i:i + 1])
        ys.append(y_i)
        caches.append(c_i)
    y_ref, cache_ref = torch.cat(ys, dim=1), torch.cat(caches, dim=0)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(new_cache, cache_ref, rtol=0, atol=0)

    leaves = [x, conv.weight, conv.bias] + ([cache] if with_cache else [])
    w = torch.linspace(-1, 1, y.numel(), device=device).reshape(y.shape)
    assert_same_gradients((y * w).sum() + new_cache.sum(), (y_ref * w).sum() + cache_ref.sum(), leaves,
                          rtol=1e-5, atol=1e-5)


def test_no_leakage_across_documents() -> None:
    torch.manual_seed(1)
    conv = ShortConv(D, kernel_size=W)
    x = torch.randn(1, sum(LENGTHS), D)
    y, _ = conv(x, cu_seqlens=CU)
    x2 = x.clone()
    x2[:, :3] += 10.0  # the first two documents change
    y2, _ = conv(x2, cu_seqlens=CU)
    assert torch.equal(y2[:, 3:], y[:, 3:]), "a later document's output read an earlier document"
    unpacked, _ = conv(x2)
    assert not torch.equal(unpacked[:, 3:], y[:, 3:]), "without cu_seqlens the conv does cross the boundary"


def test_bad_packing_is_named() -> None:
    conv = ShortConv(D, kernel_size=W)
    with pytest.raises(ValueError, match=r"x must have batch size B = 1 with cu_seqlens"):
        conv(torch.randn(2, 13, D), cu_seqlens=CU)
    with pytest.raises(ValueError, match=r"cu_seqlens must end at the packed length T = 12, got 13"):
        conv(torch.randn(1, 12, D), cu_seqlens=CU)
    with pytest.raises(TypeError, match=r"cu_seqlens must have dtype int32 or int64"):
        conv(torch.randn(1, 13, D), cu_seqlens=CU.float())
    with pytest.raises(ValueError, match=r"cache with cu_seqlens must have shape \[N, W-1, D\] = \[4, 3, 5\]"):
        conv(torch.randn(1, 13, D), torch.zeros(1, W - 1, D), cu_seqlens=CU)


@pytest.mark.parametrize("kernel_size", [1, 2, 5])
def test_packed_multiply_adds_at_other_kernel_sizes(kernel_size: int) -> None:
    torch.manual_seed(2)
    conv = ShortConv(D, kernel_size=kernel_size)
    conv.backend = "muladd"
    x = torch.randn(1, sum(LENGTHS), D)
    cache = torch.randn(len(LENGTHS), kernel_size - 1, D)
    y, new_cache = conv(x, cache, cu_seqlens=CU)
    bounds = zip(CU[:-1].tolist(), CU[1:].tolist(), strict=True)
    pieces = [conv(x[:, s:e], cache[i:i + 1]) for i, (s, e) in enumerate(bounds)]
    torch.testing.assert_close(y, torch.cat([p[0] for p in pieces], dim=1), rtol=1e-5, atol=1e-5)
    assert torch.equal(new_cache, torch.cat([p[1] for p in pieces], dim=0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kernel_size", [1, 2, 5])
def test_packed_triton_kernels_keep_taps_inside_each_sequence(kernel_size: int, dtype: torch.dtype) -> None:
    """Without a cache the Triton kernels run the packed row in place (no gapped copy): outputs, new caches and
    gradients of each sequence alone, at kernel sizes below and above the shortest sequences."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(3)
    conv = ShortConv(D, kernel_size=kernel_size, bias=True).to(device)
    conv.backend = "triton"
    x = torch.randn(1, sum(LENGTHS), D, device=device, dtype=dtype, requires_grad=True)
    y, new_cache = conv(x, cu_seqlens=CU.to(device))
    bounds = list(zip(CU[:-1].tolist(), CU[1:].tolist(), strict=True))
    pieces = [conv(x[:, s:e]) for s, e in bounds]
    y_ref, cache_ref = torch.cat([p[0] for p in pieces], dim=1), torch.cat([p[1] for p in pieces], dim=0)
    assert torch.equal(y, y_ref), "the packed outputs differ from each sequence's own"
    assert torch.equal(new_cache, cache_ref)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    w = torch.linspace(-1, 1, y.numel(), device=device).reshape(y.shape)
    assert_same_gradients((y.float() * w).sum() + new_cache.float().sum(),
                          (y_ref.float() * w).sum() + cache_ref.float().sum(), [x, conv.weight, conv.bias],
                          rtol=tol, atol=tol)


def test_packed_triton_kernels_confine_non_finite_inputs() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    conv = ShortConv(D, kernel_size=W).to(device)
    conv.backend = "triton"
    x = torch.randn(1, sum(LENGTHS), D, device=device)
    x[0, 9] = float("nan")  # the third document's last token
    x.requires_grad_()
    y, _ = conv(x, cu_seqlens=CU.to(device))
    assert torch.isfinite(y[0, :9]).all() and torch.isfinite(y[0, 10:]).all()
    (y[0, 10:].sum()).backward()
    # (doc 3's own rows get NaN gradients, dy = 0 times act'(NaN), as in any batched op; no other document does)
    assert torch.isfinite(x.grad[0, :4]).all() and torch.isfinite(x.grad[0, 10:]).all()


def test_packed_triton_kernels_refuse_a_batch_or_a_cache() -> None:
    from linattn.layers.shortconv_triton import causal_conv_triton

    device = "cuda" if torch.cuda.is_available() else "cpu"
    weight = torch.randn(D, W, device=device)
    pos = torch.zeros(13, dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match=r"packed ShortConv kernels take x \[1, T, D\] and no cache"):
        causal_conv_triton(torch.randn(2, 13, D, device=device), None, weight, None, True, pos=pos)
    with pytest.raises(ValueError, match=r"pos must hold one integer position per row of x \(12\)"):
        causal_conv_triton(torch.randn(1, 12, D, device=device), None, weight, None, True, pos=pos)
