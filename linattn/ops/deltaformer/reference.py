"""Reference forms of DeltaFormer (arXiv 2505.19488): token-by-token recurrence and the matrix form.

Per head, with kappa the causal softmax kernel over strictly past keys,

    kappa_ts = exp(scale k_t.k_s) / sum_{r<t} exp(scale k_t.k_r)      (s < t; kappa_0. = 0)
    u_t = v_t - b_t sum_{s<t} kappa_ts u_s                          (the delta-rule "pseudo-values")
    o_t = sum_{s<=t} softmax_s(scale q_t.k_s) u_s                   (causal softmax attention over U)

Matrix form: U = (I + A)^-1 V with A = diag(b) tril(softmax-kernel(K K^T), -1) (strictly lower), then
O = causal-softmax(Q K^T scale) U. The state is a KVCache of the past keys and their u's: a cache
continues the sequence (its positions are "past" for both the kernel and the attention).
Both forms compute in float32 (float64 for float64 inputs); outputs take the input dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..common.causal_softmax import causal_mask, masked_softmax
from ..common.checks import compute_dtype
from ..common.kv_cache import KVCache
from ..common.masking import confined_attention
from ..common.triangular import solve_unit_lower


def _past(initial_state: KVCache | None, like: torch.Tensor, V: int, dt: torch.dtype) -> tuple[torch.Tensor, ...]:
    """Cached keys [B, T0, H, K] and u's [B, T0, H, V] in ``dt`` (empty when there is no cache)."""
    B, _, H, K = like.shape
    if initial_state is None:
        return like.new_zeros(B, 0, H, K, dtype=dt), like.new_zeros(B, 0, H, V, dtype=dt)
    return initial_state.k.to(dt), initial_state.v.to(dt)


def deltaformer_recurrent(
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
    """Token by token: u_t from the past keys and u's, then attend with q_t over all keys so far."""
    dt, in_dtype = compute_dtype(q), q.dtype
    q, k, v, beta = (x.to(dt) for x in (q, k, v, beta))
    keys, us = _past(initial_state, k, v.shape[-1], dt)
    outputs = []
    for t in range(q.shape[1]):
        u_t = v[:, t]
        if keys.shape[1] > 0:
            kappa = torch.softmax(scale * torch.einsum("bhk,bshk->bhs", k[:, t], keys), dim=-1)
            u_t = u_t - beta[:, t, :, None] * torch.einsum("bhs,bshv->bhv", kappa, us)
        keys = torch.cat([keys, k[:, t, None]], dim=1)
        us = torch.cat([us, u_t[:, None]], dim=1)
        p = torch.softmax(scale * torch.einsum("bhk,bshk->bhs", q[:, t], keys), dim=-1)
        outputs.append(torch.einsum("bhs,bshv->bhv", p, us))
    o = torch.stack(outputs, dim=1)
    return o.to(in_dtype), (KVCache(keys, us) if output_final_state else None)


def deltaformer_parallel(
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
    """Explicit matrix form: one T x (T0 + T) kernel, one triangular solve, one causal SDPA."""
    dt, in_dtype = compute_dtype(q), q.dtype
    q, k, v, beta = (x.to(dt) for x in (q, k, v, beta))
    k0, u0 = _past(initial_state, k, v.shape[-1], dt)
    T0, T = k0.shape[1], q.shape[1]
    keys = torch.cat([k0, k], dim=1)
    qh, kh, keys_h, vh, u0h = (x.transpose(1, 2) for x in (q, k, keys, v, u0))  # [B, H, time, *]
    kappa = masked_softmax(scale * kh @ keys_h.transpose(-1, -2), causal_mask(T, T0 + T, strict=True,
                                                                              device=q.device))
    A = beta.transpose(1, 2)[..., None] * kappa  # [B, H, T, T0 + T]: row t = b_t kappa_t.
    U = solve_unit_lower(A[..., T0:], vh - A[..., :T0] @ u0h)
    us = torch.cat([u0h, U], dim=2)
    mask = causal_mask(T, T0 + T, device=q.device)
    o = confined_attention(lambda q_, k_, v_: F.scaled_dot_product_attention(q_, k_, v_, attn_mask=mask, scale=scale),
                           qh, keys_h, us)  # masking.py: hidden keys and u's stay out of P U
    state = KVCache(keys, us.transpose(1, 2)) if output_final_state else None
    return o.transpose(1, 2).to(in_dtype), state
