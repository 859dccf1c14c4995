"""Reference forms of MesaNet (arXiv 2506.05233), per head:

    G_t = exp(g_t) G_{t-1} + b_t k_t k_t^T          [K, K]
    H_t = exp(g_t) H_{t-1} + b_t k_t v_t^T          [K, V]
    o_t = H_t^T (G_t + diag(lamb))^-1 (scale * q_t)

Matrix form: with D_ts = exp(G_t - G_s) b_s for s <= t (0 above the diagonal), G = cumsum(g),

    G_t = sum_s D_ts k_s k_s^T + exp(G_t) G_0,      x_t = (G_t + diag(lamb))^-1 (scale q_t),
    O   = ((X K^T) ⊙ D) V + exp(G) ⊙ (X H_0).

Both forms compute in float32 (float64 for float64 inputs); outputs take the input dtype; the state
is the pair (G [B, H, K, K], H [B, H, K, V]).
"""

from __future__ import annotations

import torch

from ..common.checks import compute_dtype
from ..common.masking import tril_matmul
from .solve import spd_solve

MesaState = tuple[torch.Tensor, torch.Tensor]


def initial_mesa_state(
    initial_state: MesaState | None, B: int, H: int, K: int, V: int, dt: torch.dtype, device: torch.device
) -> MesaState:
    """(G_0, H_0) in the compute dtype (zeros when ``initial_state`` is None)."""
    if initial_state is None:
        return torch.zeros(B, H, K, K, dtype=dt, device=device), torch.zeros(B, H, K, V, dtype=dt, device=device)
    return initial_state[0].to(dt), initial_state[1].to(dt)


def mesa_update(state: MesaState, k_t: torch.Tensor, v_t: torch.Tensor, g_t: torch.Tensor,
                beta_t: torch.Tensor) -> MesaState:
    """G <- exp(g) G + b k k^T, H <- exp(g) H + b k v^T; k_t [B, H, K], v_t [B, H, V], g_t, beta_t [B, H]."""
    G, Hs = state
    decay = torch.exp(g_t)[..., None, None]
    bk = (beta_t[..., None] * k_t)[..., :, None]
    return decay * G + bk * k_t[..., None, :], decay * Hs + bk * v_t[..., None, :]


def mesa_read(state: MesaState, q_t: torch.Tensor, lamb: torch.Tensor, solver: str,
              cg_steps: int | None) -> torch.Tensor:
    """o = H^T (G + diag(lamb))^-1 q for one token; q_t [B, H, K] (already scaled), lamb [H, K]."""
    G, Hs = state
    x = spd_solve(G + torch.diag_embed(lamb), q_t, solver, cg_steps)
    return torch.einsum("bhkv,bhk->bhv", Hs, x)


def mesa_net_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    lamb: torch.Tensor,
    *,
    scale: float,
    initial_state: MesaState | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
    solver: str = "exact",
    cg_steps: int | None = None,
) -> tuple[torch.Tensor, MesaState | None]:
    """Token-by-token recurrence, read next to the equation in the module docstring."""
    dt, in_dtype = compute_dtype(q), q.dtype
    B, T, H, K = q.shape
    q, k, v, g, beta, lamb = (x.to(dt) for x in (q, k, v, g, beta, lamb))
    state = initial_mesa_state(initial_state, B, H, K, v.shape[-1], dt, q.device)
    outputs = []
    for t in range(T):
        state = mesa_update(state, k[:, t], v[:, t], g[:, t], beta[:, t])
        outputs.append(mesa_read(state, q[:, t] * scale, lamb, solver, cg_steps))
    o = torch.stack(outputs, dim=1)
    return o.to(in_dtype), (state if output_final_state else None)


def mesa_net_parallel(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    lamb: torch.Tensor,
    *,
    scale: float,
    initial_state: MesaState | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
    solver: str = "exact",
    cg_steps: int | None = None,
) -> tuple[torch.Tensor, MesaState | None]:
    """Explicit T x T matrix form: every G_t built at once, then one solve batched over all t."""
    dt, in_dtype = compute_dtype(q), q.dtype
    B, T, H, K = q.shape
    q, k, v, g, beta = (x.to(dt).transpose(1, 2) for x in (q, k, v, g, beta))
    # q, k [B, H, T, K]; v [B, H, T, V]; g, beta [B, H, T]
    G0, H0 = initial_mesa_state(initial_state, B, H, K, v.shape[-1], dt, q.device)
    Gc = torch.cumsum(g, dim=-1)
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    D = torch.exp((Gc[..., :, None] - Gc[..., None, :]).masked_fill(~causal, float("-inf"))) * beta[..., None, :]
    D = D.masked_fill(~causal, 0.0)  # by selection: a later NaN beta times 0 would leak (masking.py)
    kk = (k[..., :, None] * k[..., None, :]).flatten(-2)  # [B, H, T, K*K]
    G_all = tril_matmul(D, kk).unflatten(-1, (K, K)) + torch.exp(Gc)[..., None, None] * G0[:, :, None]
    X = spd_solve(G_all + torch.diag_embed(lamb.to(dt))[:, None], q * scale, solver, cg_steps)  # [B, H, T, K]
    o = tril_matmul(((X @ k.transpose(-1, -2)) * D).masked_fill(~causal, 0.0), v) + (X * torch.exp(Gc)[..., None]) @ H0
    final = None
    if output_final_state:
        w = (torch.exp(Gc[..., -1:] - Gc) * beta)[..., None]  # decay from s to the end, times b_s
        last = torch.exp(Gc[..., -1])[..., None, None]
        final = ((k * w).transpose(-1, -2) @ k + last * G0, (k * w).transpose(-1, -2) @ v + last * H0)
    return o.transpose(1, 2).to(in_dtype), final


def mesa_net_step_reference(
    q_t: torch.Tensor,
    k_t: torch.Tensor,
    v_t: torch.Tensor,
    g_t: torch.Tensor,
    beta_t: torch.Tensor,
    lamb: torch.Tensor,
    state: MesaState | None,
    *,
    scale: float,
    solver: str = "exact",
    cg_steps: int | None = None,
) -> tuple[torch.Tensor, MesaState]:
    """One decoding step (inputs validated by the public ``mesa_net_step``)."""
    dt, in_dtype = compute_dtype(q_t), q_t.dtype
    B, H, K = q_t.shape
    state = initial_mesa_state(state, B, H, K, v_t.shape[-1], dt, q_t.device)
    q_t, k_t, v_t, g_t, beta_t, lamb = (x.to(dt) for x in (q_t, k_t, v_t, g_t, beta_t, lamb))
    state = mesa_update(state, k_t, v_t, g_t, beta_t)
    return mesa_read(state, q_t * scale, lamb, solver, cg_steps).to(in_dtype), state
