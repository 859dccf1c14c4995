"""Chunkwise DeltaFormer: the triangular solve chunk by chunk, then blockwise causal SDPA.

For the chunk of rows [a, a + C) (a counts the cached positions too) the kernel rows
kappa_t. (softmax over keys s < t) are computed against all keys [0, a + C) at once; the solve

    U_c = (I + diag(b_c) kappa_cc)^-1 (V_c - diag(b_c) kappa_c,past U_past)

needs only the previous chunks' u's, as one matmul. Then every query block attends over (K, U) with
SDPA and a causal mask that is a view of one shared tensor. Working memory per chunk: C x (T0 + T)
(kernel rows) plus C x C; the whole-sequence tensors are K and U, O((T0 + T) (K + V)).
Autograd keeps each chunk's kernel rows and U_past for the backward, i.e. O(T^2) in total (as for any
softmax kernel without a hand-written backward); the forward alone (torch.no_grad) is linear in T.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..common.causal_softmax import ChunkMasks, masked_softmax
from ..common.checks import compute_dtype
from ..common.kv_cache import KVCache
from ..common.triangular import solve_unit_lower
from .reference import _past


def deltaformer_chunk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float,
    initial_state: KVCache | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, KVCache | None]:
    """Chunkwise-parallel DeltaFormer (see the module docstring); any T, any device."""
    dt, in_dtype = compute_dtype(q), q.dtype
    q, k, v, beta = (x.to(dt) for x in (q, k, v, beta))
    k0, u0 = _past(initial_state, k, v.shape[-1], dt)
    T0, T, C = k0.shape[1], q.shape[1], chunk_size
    P = T0 + T
    keys = torch.cat([k0, k], dim=1).transpose(1, 2)  # [B, H, P, K]
    qh, vh, bh = q.transpose(1, 2), v.transpose(1, 2), beta.transpose(1, 2)[..., None]
    strict, causal = ChunkMasks(C, P, strict=True, device=q.device), ChunkMasks(C, P, device=q.device)

    us = u0.transpose(1, 2)  # u's of every position so far, [B, H, T0 + done, V]
    for a in range(0, T, C):
        e = min(a + C, T)
        rows, start, end = e - a, T0 + a, T0 + e
        kappa = bh[:, :, a:e] * masked_softmax(scale * keys[:, :, start:end] @ keys[:, :, :end].transpose(-1, -2),
                                               strict(end, rows))
        rhs = vh[:, :, a:e] if start == 0 else vh[:, :, a:e] - kappa[..., :start] @ us
        us = torch.cat([us, solve_unit_lower(kappa[..., start:], rhs)], dim=2)

    blocks = []
    for a in range(0, T, C):
        e = min(a + C, T)
        end = T0 + e
        blocks.append(F.scaled_dot_product_attention(qh[:, :, a:e], keys[:, :, :end], us[:, :, :end],
                                                     attn_mask=causal(end, e - a), scale=scale))
    o = torch.cat(blocks, dim=2).transpose(1, 2)
    state = KVCache(keys.transpose(1, 2), us.transpose(1, 2)) if output_final_state else None
    return o.to(in_dtype), state
