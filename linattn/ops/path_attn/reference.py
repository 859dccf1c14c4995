"""Reference forms of PaTH attention (arXiv 2505.16381): token-by-token recurrence and the UT matrix form.

Per head, with Householder-like transitions H_r = I - b_r w_r w_r^T (w_r unit-norm, b_r in (0, 2)),

    logit_ts = scale (q_t^T (H_t H_{t-1} ... H_{s+1}) k_s + G_t - G_s),     s <= t   (empty product: I)
    o_t = sum_{s<=t} softmax_s(logit_t.) v_s,          G = cumsum(g) (optional forget gate, FoX-style)

Recurrence: keep every past key in the frame of "now": when H_t arrives, k~_s <- H_t k~_s for all s < t,
then append k_t; logit_ts = scale (q_t.k~_s + G_t - G_s). The transformed keys k~ obey the delta-rule-like recurrence
S_t = H_t S_{t-1} + k_t e_t^T (S = [k~_1 .. k~_t]), whose WY/UT form gives the matrix form

    X = (I + L)^-1 diag(b) [W S0 | tril(W K^T, -1)],     L = tril(diag(b) W W^T, -1)
    scores = [Q S0 | tril(Q K^T)] - tril(Q W^T) X,       O = softmax(scale (scores + bias), causal) [V0; V]

(S0 = the cached keys, already in the frame of the cache's end). The gate bias is inside the scale, as in
FLA's path_attn (its kernel and its PyTorch reference): the same arguments give the same numbers. The state is
a KVCache of the keys transformed up to the last position, the values, and extras["log_decay"] = G_end - G_s
(0 without g).
Both forms compute in float32 (float64 for float64 inputs); outputs take the input dtype.
"""

from __future__ import annotations

import torch

from ..common.causal_softmax import causal_mask, masked_softmax
from ..common.checks import compute_dtype
from ..common.kv_cache import KVCache
from ..common.masking import confined_attention, tril_matmul
from ..common.triangular import solve_unit_lower


def _past(initial_state: KVCache | None, k: torch.Tensor, V: int, dt: torch.dtype) -> tuple[torch.Tensor, ...]:
    """Cached transformed keys [B, T0, H, K], values [B, T0, H, V] and log decays [B, T0, H] in ``dt``."""
    B, _, H, K = k.shape
    if initial_state is None:
        return k.new_zeros(B, 0, H, K, dtype=dt), k.new_zeros(B, 0, H, V, dtype=dt), k.new_zeros(B, 0, H, dtype=dt)
    return initial_state.k.to(dt), initial_state.v.to(dt), initial_state.extras["log_decay"].to(dt)


def path_attn_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    w: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor | None = None,
    *,
    scale: float,
    initial_state: KVCache | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, KVCache | None]:
    """Token by token: apply H_t to every past key, append k_t, attend with q_t."""
    dt, in_dtype = compute_dtype(q), q.dtype
    q, k, v, w, beta = (x.to(dt) for x in (q, k, v, w, beta))
    keys, vals, decay = _past(initial_state, k, v.shape[-1], dt)
    outputs = []
    for t in range(q.shape[1]):
        w_t, b_t = w[:, t, None], beta[:, t, None, :, None]  # [B, 1, H, K], [B, 1, H, 1]
        keys = keys - b_t * (keys * w_t).sum(-1, keepdim=True) * w_t  # k~_s <- (I - b_t w_t w_t^T) k~_s
        if g is not None:
            decay = decay + g[:, t, None].to(dt)
        keys = torch.cat([keys, k[:, t, None]], dim=1)
        vals = torch.cat([vals, v[:, t, None]], dim=1)
        decay = torch.cat([decay, decay.new_zeros(decay.shape[0], 1, decay.shape[2])], dim=1)
        logits = scale * (torch.einsum("bhk,bshk->bhs", q[:, t], keys) + decay.transpose(1, 2))
        outputs.append(torch.einsum("bhs,bshv->bhv", torch.softmax(logits, dim=-1), vals))
    o = torch.stack(outputs, dim=1)
    state = KVCache(keys, vals, {"log_decay": decay}) if output_final_state else None
    return o.to(in_dtype), state


def path_attn_parallel(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    w: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor | None = None,
    *,
    scale: float,
    initial_state: KVCache | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, KVCache | None]:
    """Explicit UT form over the whole sequence: one T x T triangular solve, T x (T0 + T) scores."""
    dt, in_dtype = compute_dtype(q), q.dtype
    q, k, v, w, beta = (x.to(dt) for x in (q, k, v, w, beta))
    k0, v0, d0 = _past(initial_state, k, v.shape[-1], dt)
    T0, T = k0.shape[1], q.shape[1]
    Q, Kn, W, S0, Vall = (x.transpose(1, 2) for x in (q, k, w, k0, torch.cat([v0, v], dim=1)))  # [B, H, time, *]
    b = beta.transpose(1, 2)[..., None]  # [B, H, T, 1]
    M, Ms = causal_mask(T, T, device=q.device), causal_mask(T, T, strict=True, device=q.device)
    tril = lambda x, m: x.masked_fill(~m, 0.0)
    X = solve_unit_lower(b * (W @ W.transpose(-1, -2)),
                         b * torch.cat([W @ S0.transpose(-1, -2), tril(W @ Kn.transpose(-1, -2), Ms)], dim=-1))
    scores = torch.cat([Q @ S0.transpose(-1, -2), tril(Q @ Kn.transpose(-1, -2), M)], dim=-1)
    scores = scores - tril_matmul(tril(Q @ W.transpose(-1, -2), M), X)  # [B, H, T, T0 + T] (masking.py)
    G = torch.zeros_like(beta).transpose(1, 2) if g is None else torch.cumsum(g.to(dt), dim=1).transpose(1, 2)
    bias = G[..., None] + torch.cat([d0.transpose(1, 2), -G], dim=-1)[..., None, :]  # G_t - G_s (G_s past: -d0)
    p = masked_softmax(scale * (scores + bias), causal_mask(T, T0 + T, device=q.device))
    o = confined_attention(lambda p_, _, v_: p_ @ v_, p, Vall, Vall).transpose(1, 2)  # P V: masking.py
    state = None
    if output_final_state:
        keys = torch.cat([S0, Kn], dim=2) - X.transpose(-1, -2) @ W  # every key moved to the frame of T
        decay = G[..., -1:] + torch.cat([d0.transpose(1, 2), -G], dim=-1)
        state = KVCache(keys.transpose(1, 2), Vall.transpose(1, 2), {"log_decay": decay.transpose(1, 2)})
    return o.to(in_dtype), state
