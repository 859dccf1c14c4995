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
