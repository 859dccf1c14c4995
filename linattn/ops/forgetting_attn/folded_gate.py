"""forgetting_attn through torch's scaled_dot_product_attention (SDPA): the gate folded into the keys.

For query t, softmax_s(scale q_t.k_s + G_t - G_s) = softmax_s(scale q_t.k_s - G_s): G_t is the same for every key
of row t. The per-key bias -G_s is one more key dimension against a query dimension of ones,

    scale [q_t, 1] . [k_s, -G_s / scale],

so plain causal attention over widened queries and keys gives FoX's output, and SDPA's fused CUDA kernels (memory
linear in T) run it. In bf16 one number cannot carry G_s (it grows with t: at |G_s / scale| ~ 1e4 bf16 is off by
~30), so x = -G_s / scale (float32) is split into three parts of 8 significant bits each, bf16 values whose sum is
x exactly, each against a query dimension of one: the products are exact and add up in SDPA's float32
accumulator. All three parts get the same gradient (the column sums of dS), which is
x's. q, k and v are zero-padded to one head dim (K + 3 rounded up to a multiple of 8, and at least V), the width
SDPA's fused kernels take for all three; the output's padding is dropped. Keys and values are widened per query
head (the gate is a query head's), so grouped-query attention runs with H key heads here.

Used by the triton backend where ``LAUNCH["sdpa"]`` is set (:func:`folded_gate_applies`): bf16 on CUDA, no
window, no cache. Non-finite keys, values or gates are confined by softmax_attn's guard (a non-finite gate makes
G, so the key rows, non-finite from its position on).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..softmax_attn.core import causal_attention
from ..softmax_attn.reference import expand_kv_heads

PARTS = 3  # bf16 parts of -G / scale: 3 x 8 mantissa bits reach float32's 24


def folded_gate_applies(q: torch.Tensor, V: int, window: int, cached: int, enabled: bool) -> bool:
    """Whether a call runs here: ``enabled`` (the launch setting), q on CUDA in bf16 (fp16 could not hold the
    parts' range), no sliding window, no cache, and the widened head dim at most 256 (SDPA's fused kernels)."""
    return enabled and q.is_cuda and q.dtype == torch.bfloat16 and not window and not cached \
        and _width(q.shape[-1], V) <= 256


def _width(K: int, V: int) -> int:
    return -(-max(K + PARTS, V) // 8) * 8


class _SplitBF16(torch.autograd.Function):
    """x (float32) -> [..., PARTS] parts with bf16 values summing to x exactly, stored in ``dtype`` (so that their
    gradient comes in the attention's dtype, not rounded to bf16 on the way back); the gradient of x is the parts'
    mean gradient (they all get the same one, module docstring)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        # each part keeps the top 8 significant bits of what is left (the low 16 bits of its float32 pattern
        # cleared: a bf16 value), so the three add up to x exactly. Bits, not a round trip through bf16: a
        # compiler may drop x.to(bfloat16).float() as a no-op, and x - that would then be 0
        parts, rest = [], x.float().contiguous()
        for _ in range(PARTS):
            part = (rest.view(torch.int32) & -65536).view(torch.float32)  # -65536 = 0xFFFF0000
            parts.append(part)
            rest = rest - part
        return torch.stack(parts, dim=-1).to(dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.float().mean(dim=-1), None


def folded_gate_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, G: torch.Tensor, scale: float
                          ) -> torch.Tensor:
    """o [B, T, H, V] (q's dtype) of FoX attention (module docstring): q [B, T, H, K], k [B, T, H_kv, K],
    v [B, T, H_kv, V] in one dtype, G [B, H, T] (the cumulative log gates, float32 or float64); differentiable in
    all four."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    D = _width(K, V)
    x = (-G.float() / scale).transpose(1, 2)  # [B, T, H]
    parts = _SplitBF16.apply(x, q.dtype)
    ones = q.new_ones(B, T, H, PARTS)
    q_wide = F.pad(torch.cat([q, ones], dim=-1), (0, D - K - PARTS))
    per_query_head = (lambda x: x) if k.shape[2] == H else (lambda x: expand_kv_heads(x, H))
    k_wide = F.pad(torch.cat([per_query_head(k), parts], dim=-1), (0, D - K - PARTS))
    v_wide = F.pad(per_query_head(v), (0, D - V))
    return causal_attention(q_wide, k_wide, v_wide, scale)[..., :V]
