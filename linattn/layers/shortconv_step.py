"""Fused Triton kernel for one ShortConv decoding step (import only with Triton).

For one token x_t [B, D], the cache c [B, W-1, D] of the W-1 previous inputs and the taps w [D, W]:

    y_t = act( sum_{i<W-1} w_i ⊙ c_i + w_{W-1} ⊙ x_t (+ bias) ),      c' = [c_1, ..., c_{W-2}, x_t]

in one launch instead of a concatenation, W multiply-adds, the activation and a copy of the cache (a
dozen small kernels, which dominate a decoding step's launch count). Summed in float32 in the order of
ShortConv's multiply-adds. A program per (channel block, batch row) loads cache row i before it stores
row i - 1, and every load and store of a channel is made by the thread that owns that channel, so c'
may be written over c (``cache_out=cache``: the static decoding path) or into a new tensor (the eager
cached path, which must leave the caller's cache as it was). CUDA tensors, or the CPU under
TRITON_INTERPRET=1.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ..ops.common.triton_compat import patch_interpreter
from ..ops.common.triton_launch import fast_launch
from ..ops.common.triton_utils import cdiv, next_power_of_2

patch_interpreter()

LAUNCH = {"BD": 256, "num_warps": 4}


@fast_launch
@triton.jit
def _conv_step_kernel(x, cache, w, bias, y, cache_out, D, sx_b, W: tl.constexpr, BD: tl.constexpr,
                      HAS_BIAS: tl.constexpr, SILU: tl.constexpr):
    """Grid (cdiv(D, BD), B). x rows have batch stride sx_b (channels contiguous); cache, cache_out
    [B, W-1, D], y [B, D] and w [D, W] are contiguous."""
    i_d, i_b = tl.program_id(0), tl.program_id(1).to(tl.int64)
    o_d = i_d * BD + tl.arange(0, BD)
    m_d = o_d < D
    row = i_b * (W - 1) * D + o_d
    z = tl.zeros([BD], dtype=tl.float32)
    for i in tl.static_range(W - 1):
        c_i = tl.load(cache + row + i * D, mask=m_d, other=0.0)
        z += c_i.to(tl.float32) * tl.load(w + o_d * W + i, mask=m_d, other=0.0).to(tl.float32)
        if i > 0:
            tl.store(cache_out + row + (i - 1) * D, c_i.to(cache_out.dtype.element_ty), mask=m_d)
    x_t = tl.load(x + i_b * sx_b + o_d, mask=m_d, other=0.0)
    z += x_t.to(tl.float32) * tl.load(w + o_d * W + (W - 1), mask=m_d, other=0.0).to(tl.float32)
    if W > 1:
        tl.store(cache_out + row + (W - 2) * D, x_t.to(cache_out.dtype.element_ty), mask=m_d)
    if HAS_BIAS:
        z += tl.load(bias + o_d, mask=m_d, other=0.0).to(tl.float32)
    if SILU:
        z = z * tl.sigmoid(z)
    tl.store(y + i_b * D + o_d, z.to(y.dtype.element_ty), mask=m_d)


def conv_step_triton(x: torch.Tensor, cache: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     silu: bool, cache_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One token: x [B, D] (channels contiguous), cache [B, W-1, D], weight [D, W] -> (y [B, D] in x's dtype,
    the new cache). ``cache_out``: where the new cache goes (``cache`` itself for an in-place shift; a contiguous
    [B, W-1, D] tensor); None allocates one in the cache's dtype."""
    if not x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"ShortConv backend 'triton' needs CUDA tensors, got x on {x.device} "
                         "(set TRITON_INTERPRET=1 to run the kernels on the CPU)")
    B, D = x.shape
    W = weight.shape[-1]
    if x.stride(-1) != 1:
        x = x.contiguous()
    if cache_out is cache and not cache.is_contiguous():
        raise ValueError("an in-place ShortConv step needs a contiguous cache [B, W-1, D]")
    cache = cache.contiguous()
    if cache_out is None:
        cache_out = torch.empty_like(cache)
    y = torch.empty(B, D, device=x.device, dtype=x.dtype)
    BD = min(LAUNCH["BD"], next_power_of_2(D))
    _conv_step_kernel[(cdiv(D, BD), B)](
        x=x, cache=cache, w=weight.contiguous(), bias=x if bias is None else bias, y=y, cache_out=cache_out, D=D,
        sx_b=x.stride(0), W=W, BD=BD, HAS_BIAS=bias is not None, SILU=silu, num_warps=LAUNCH["num_warps"])
    return y, cache_out
