"""Reference forms of the gated delta rule (Gated DeltaNet), written for its generalisation with a
separate read key p (Comba); p = k is the gated delta rule, and no gate (g = None) the plain delta rule.

    S_t = exp(g_t) (I - b_t k_t p_t^T) S_{t-1} + b_t k_t v_t^T
        = a_t S_{t-1} + b_t k_t (v_t - a_t S_{t-1}^T p_t)^T,       a_t = exp(g_t)
    o_t = S_t^T (scale * q_t)

Matrix form (per head, G = cumsum(g), gamma_t = exp(G_t), D_ts = exp(G_t - G_s) for s <= t):
writing S_t = gamma_t S_0 + sum_{s<=t} D_ts k_s u_s^T, the "pseudo-values" u_t satisfy

    u_t = b_t (v_t - gamma_t S_0^T p_t) - sum_{s<t} b_t (p_t . k_s) D_ts u_s,

i.e. (I + A) U = diag(b) (V - diag(gamma) P S_0) with A_ts = b_t (p_t . k_s) D_ts (s < t), and

    O = (Q K^T ⊙ D ⊙ M) U + diag(gamma) Q S_0,     S_T = gamma_T S_0 + sum_s D_Ts k_s u_s^T.

Both forms compute in float32 (float64 for float64 inputs); outputs take the input dtype.
"""

from __future__ import annotations

import torch

from ..common.checks import compute_dtype
from ..common.masking import tril_matmul
from ..common.triangular import solve_unit_lower


def delta_update(S: torch.Tensor, k_t: torch.Tensor, v_t: torch.Tensor, p_t: torch.Tensor,
                 b_t: torch.Tensor) -> torch.Tensor:
    """One delta-rule correction S + b_t k_t (v_t - S^T p_t)^T; S [B, H, K, V], k_t, p_t [B, H, K],
    v_t [B, H, V], b_t [B, H]."""
    error = v_t - torch.einsum("bhkv,bhk->bhv", S, p_t)
    return S + (b_t[..., None] * k_t)[..., :, None] * error[..., None, :]


def read(S: torch.Tensor, q_t: torch.Tensor, scale: float) -> torch.Tensor:
    """o_t = S^T (scale q_t)."""
    return torch.einsum("bhkv,bhk->bhv", S, q_t * scale)


def gated_delta_step_reference(
    q_t: torch.Tensor, k_t: torch.Tensor, v_t: torch.Tensor, g_t: torch.Tensor | None, beta_t: torch.Tensor,
    state: torch.Tensor | None, *, scale: float, p_t: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token: S <- exp(g_t) S; S <- S + b_t k_t (v_t - S^T p_t)^T; o_t = S^T q_t (p_t = k_t by default).

    Inputs [B, H, ...] already validated; returns (o_t in q_t's dtype, state in the compute dtype).
    """
    dt, in_dtype = compute_dtype(q_t), q_t.dtype
    B, H, K = q_t.shape
    S = q_t.new_zeros(B, H, K, v_t.shape[-1], dtype=dt) if state is None else state.to(dt)
    q_t, k_t, v_t, beta_t = (x.to(dt) for x in (q_t, k_t, v_t, beta_t))
    if g_t is not None:
        S = torch.exp(g_t.to(dt))[..., None, None] * S
    S = delta_update(S, k_t, v_t, k_t if p_t is None else p_t.to(dt), beta_t)
    return read(S, q_t, scale).to(in_dtype), S


def gated_delta_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None,
    beta: torch.Tensor,
    *,
    scale: float,
    p: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token-by-token recurrence of the module docstring (g None: no decay; p None: p = k)."""
    in_dtype, T = q.dtype, q.shape[1]
    S = initial_state
    outputs = []
    for t in range(T):
        o_t, S = gated_delta_step_reference(
            q[:, t], k[:, t], v[:, t], None if g is None else g[:, t], beta[:, t], S,
            scale=scale, p_t=None if p is None else p[:, t],
        )
        outputs.append(o_t)
    return torch.stack(outputs, dim=1).to(in_dtype), (S if output_final_state else None)


def gated_delta_parallel(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None,
    beta: torch.Tensor,
    *,
    scale: float,
    p: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Explicit T x T matrix form through the triangular solve (I + A)^-1 (module docstring)."""
    dt, in_dtype = compute_dtype(q), q.dtype
    T = q.shape[1]
    # per-head layout [B, H, T, D]
    q, k, v = (x.to(dt).transpose(1, 2) for x in (q, k, v))
    p = k if p is None else p.to(dt).transpose(1, 2)
    b = beta.to(dt).transpose(1, 2)[..., None]  # [B, H, T, 1]
    G = torch.zeros_like(b[..., 0]) if g is None else torch.cumsum(g.to(dt), dim=1).transpose(1, 2)  # [B, H, T]
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    D = torch.exp((G[..., :, None] - G[..., None, :]).masked_fill(~causal, float("-inf")))  # [B, H, T, T]
    gamma = torch.exp(G)[..., None]  # [B, H, T, 1]

    A = (b * (p @ k.transpose(-1, -2)) * D).tril(-1)
    rhs = b * v
    if initial_state is not None:
        S0 = initial_state.to(dt)
        rhs = rhs - b * gamma * (p @ S0)
    U = solve_unit_lower(A, rhs)
    o = tril_matmul(((scale * q) @ k.transpose(-1, -2) * D).masked_fill(~causal, 0.0), U)  # masking.py
    if initial_state is not None:
        o = o + gamma * (scale * q) @ S0
    S_final = None
    if output_final_state:
        S_final = (k * D[..., -1, :, None]).transpose(-1, -2) @ U  # D[T, s] = decay from s to the end
        if initial_state is not None:
            S_final = S_final + gamma[..., -1:, :] * S0
    return o.transpose(1, 2).to(in_dtype), S_final
