"""Reference forms of gated linear attention (GLA, per-channel data-dependent decay).

    S_t = diag(exp(g_t)) S_{t-1} + k_t v_t^T,        o_t = S_t^T (scale * q_t)

with g_t in R^K (log decay of every key channel, <= 0). Matrix form: with G = cumsum(g) along time,

    o_t = sum_{s <= t} (sum_i q_ti k_si exp(G_ti - G_si)) v_s + (q_t ⊙ exp(G_t))^T S_0,

i.e. O = A V with A_ts = q_t^T diag(exp(G_t - G_s)) k_s (a [T, T, K] decay tensor; small T only).
Both forms compute in float32 (float64 for float64 inputs); outputs take the input dtype.
"""

from __future__ import annotations

import torch

from ..common.checks import compute_dtype
from ..common.masking import tril_matmul


def gla_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    *,
    scale: float,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token-by-token recurrence, read next to the equation in the module docstring."""
    dt, in_dtype = compute_dtype(q), q.dtype
    B, T, H, K = q.shape
    V = v.shape[-1]
    q, k, v, g = (x.to(dt) for x in (q, k, v, g))
    S = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.to(dt)
    outputs = []
    for t in range(T):
        S = torch.exp(g[:, t])[..., None] * S + k[:, t, :, :, None] * v[:, t, :, None, :]
        outputs.append(torch.einsum("bhkv,bhk->bhv", S, q[:, t] * scale))
    o = torch.stack(outputs, dim=1)
    return o.to(in_dtype), (S if output_final_state else None)


def gla_parallel(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    *,
    scale: float,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Explicit matrix form with the [T, T, K] decay tensor exp(G_t - G_s) (s <= t)."""
    dt, in_dtype = compute_dtype(q), q.dtype
    q, k, v, g = (x.to(dt) for x in (q, k, v, g))
    T = q.shape[1]
    q = q * scale
    G = torch.cumsum(g, dim=1)  # [B, T, H, K]
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    diff = (G[:, :, None] - G[:, None, :]).masked_fill(~causal[:, :, None, None], float("-inf"))
    A = torch.einsum("bthk,bshk,btshk->bhts", q, k, torch.exp(diff))  # [B, H, T, T]
    A = A.masked_fill(~causal, 0.0)  # by selection: 0 x NaN of a later k would leak (masking.py)
    o = tril_matmul(A, v.transpose(1, 2)).transpose(1, 2)
    S_final = None
    if initial_state is not None:
        o = o + torch.einsum("bthk,bhkv->bthv", q * torch.exp(G), initial_state.to(dt))
    if output_final_state:
        S_final = torch.einsum("bshk,bshv->bhkv", k * torch.exp(G[:, -1:] - G), v)
        if initial_state is not None:
            S_final = S_final + torch.exp(G[:, -1])[..., None] * initial_state.to(dt)
    return o.to(in_dtype), S_final


def gla_step_reference(
    q_t: torch.Tensor,
    k_t: torch.Tensor,
    v_t: torch.Tensor,
    g_t: torch.Tensor,
    state: torch.Tensor | None,
    *,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decoding step (inputs validated by the public ``gla_step``)."""
    dt = compute_dtype(q_t)
    B, H, K = q_t.shape
    S = q_t.new_zeros(B, H, K, v_t.shape[-1], dtype=dt) if state is None else state.to(dt)
    S = torch.exp(g_t.to(dt))[..., None] * S + k_t.to(dt)[..., :, None] * v_t.to(dt)[..., None, :]
    o_t = torch.einsum("bhkv,bhk->bhv", S, q_t.to(dt) * scale)
    return o_t.to(q_t.dtype), S
