"""Reference forms of the scalar-decay linear RNN (Mamba2 / SSD core, data-dependent decay).

    S_t = exp(g_t) S_{t-1} + k_t v_t^T,        o_t = S_t^T (scale * q_t)

Matrix form: O = ((Q K^T) ⊙ D) V with D_ts = exp(G_t - G_s) for s <= t (0 above the diagonal),
G = cumsum(g) along time, plus the initial state's contribution exp(G_t) S_0^T q_t.
Both forms compute in float32 (float64 for float64 inputs); outputs take the input dtype.
"""

from __future__ import annotations

import torch

from ..common.checks import compute_dtype
from ..common.masking import tril_matmul


def simple_gla_recurrent(
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
        S = torch.exp(g[:, t])[..., None, None] * S + k[:, t, :, :, None] * v[:, t, :, None, :]
        outputs.append(torch.einsum("bhkv,bhk->bhv", S, q[:, t] * scale))
    o = torch.stack(outputs, dim=1)
    return o.to(in_dtype), (S if output_final_state else None)


def simple_gla_parallel(
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
    """Explicit T x T matrix form; the decay matrix is built from differences of cumulative gates."""
    dt, in_dtype = compute_dtype(q), q.dtype
    q, k, v, g = (x.to(dt) for x in (q, k, v, g))
    T = q.shape[1]
    G = torch.cumsum(g, dim=1).transpose(1, 2)  # [B, H, T]
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    diff = (G[..., :, None] - G[..., None, :]).masked_fill(~causal, float("-inf"))
    D = torch.exp(diff)  # [B, H, T, T]
    scores = (torch.einsum("bthk,bshk->bhts", q * scale, k) * D).masked_fill(~causal, 0.0)
    o = tril_matmul(scores, v.transpose(1, 2)).transpose(1, 2)
    S_final = None
    if initial_state is not None:
        S0 = initial_state.to(dt)
        o = o + torch.einsum("bthk,bhkv->bthv", q * scale * torch.exp(G).transpose(1, 2)[..., None], S0)
    if output_final_state:
        w = torch.exp(G[..., -1:] - G)  # [B, H, T]: decay from s to the end
        S_final = torch.einsum("bhs,bshk,bshv->bhkv", w, k, v)
        if initial_state is not None:
            S_final = S_final + torch.exp(G[..., -1])[..., None, None] * initial_state.to(dt)
    return o.to(in_dtype), S_final


def simple_gla_step_reference(
    q_t: torch.Tensor,
    k_t: torch.Tensor,
    v_t: torch.Tensor,
    g_t: torch.Tensor,
    state: torch.Tensor | None,
    *,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decoding step (inputs validated by the public ``simple_gla_step``)."""
    dt = compute_dtype(q_t)
    B, H, K = q_t.shape
    S = q_t.new_zeros(B, H, K, v_t.shape[-1], dtype=dt) if state is None else state.to(dt)
    S = torch.exp(g_t.to(dt))[..., None, None] * S + k_t.to(dt)[..., :, None] * v_t.to(dt)[..., None, :]
    o_t = torch.einsum("bhkv,bhk->bhv", S, q_t.to(dt) * scale)
    return o_t.to(q_t.dtype), S
