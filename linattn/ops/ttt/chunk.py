"""Chunkwise-parallel mini-batch gradient descent on a linear memory (TTT-Linear without inner norm,
and Titans with momentum eta and weight decay alpha), pure PyTorch, any device.

Chunks of C tokens start on mini-batch boundaries (C is a multiple of the mini-batch size b). In a
chunk entered with memory M_n and momentum S_n, write w_s = -theta_s k_s u_s^T for the step of token
s, with u_s = M_{p(s)}^T k_s - v_s its error at the weights its mini-batch started with (p(s) is the
last token before that mini-batch; M_{-1} = M_n). Unrolling S_t = eta_t S_{t-1} + w_t and
M_t = a_t M_{t-1} + S_t (a = 1 - alpha) inside the chunk:

    M_r = A_r M_n + d_r S_n + sum_{s <= r} c_rs w_s,       S_r = E_r S_n + sum_{s <= r} e_rs w_s,
    e_rs = prod_{s<j<=r} eta_j,  P_ri = prod_{i<j<=r} a_j,  c = P e,  A_r = prod_{j<=r} a_j,
    E_r = prod_{j<=r} eta_j,  d_r = sum_i P_ri E_i.

So the errors solve the unit-lower-triangular system (the mini-batch is what makes it triangular)

    u_t + sum_s theta_s c_{p(t)s} (k_t . k_s) u_s = A_{p(t)} M_n^T k_t + d_{p(t)} S_n^T k_t - v_t,

and o_t = M_t^T q_t = A_t M_n^T q_t + d_t S_n^T q_t - sum_{s <= t} theta_s c_ts (q_t . k_s) u_s.
TTT-Linear is eta = alpha = 0 with no momentum state (c = the causal mask of ones, A = 1, d = 0).
The solve, the products and the reads are batched over all chunks; only (M_n, S_n) -> (M_{n+1},
S_{n+1}) loops over chunks. Products of gates are taken directly (cumprod, no logs), so eta = 0 and
alpha = 1 are exact and nothing overflows for gates in [0, 1].
"""

from __future__ import annotations

import torch

from ..common.checks import compute_dtype
from ..common.masking import tril_matmul
from ..common.state_scan import chunks_heads_first, chunks_heads_last
from ..common.triangular import solve_unit_lower
from .chunk_norm import ttt_linear_norm_chunk


def segment_products(x: torch.Tensor) -> torch.Tensor:
    """x [..., C] -> P [..., C, C] with P_ri = prod_{i<j<=r} x_j for i <= r (1 on the diagonal), 0 above."""
    C = x.shape[-1]
    below = torch.ones(C, C, dtype=torch.bool, device=x.device).tril(-1)  # [j, i]: j > i
    factors = torch.where(below, x[..., :, None], torch.ones((), dtype=x.dtype, device=x.device))
    return torch.cumprod(factors, dim=-2).tril()


def _coefficients(alpha: torch.Tensor | None, eta: torch.Tensor | None, C: int, like: torch.Tensor):
    """(c, A, d, e, E) of the module docstring for gates [B, H, N, C] (None: TTT, no momentum/decay);
    ``like`` [B, H, N, C] gives shape, dtype and device."""
    if alpha is None:
        P = torch.ones(C, C, dtype=like.dtype, device=like.device).tril().expand(*like.shape, C)
        A = torch.ones((), dtype=like.dtype, device=like.device).expand(like.shape)
    else:
        P = segment_products(1 - alpha)
        A = torch.cumprod(1 - alpha, dim=-1)
    if eta is None:
        return P, A, None, None, None
    e = segment_products(eta)
    E = torch.cumprod(eta, dim=-1)
    # P is lower triangular: products that row r must not read beyond r (masking.py)
    return tril_matmul(P, e), A, tril_matmul(P, E[..., None])[..., 0], e, E


def linear_memory_chunk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    theta: torch.Tensor,
    alpha: torch.Tensor | None,
    eta: torch.Tensor | None,
    M0: torch.Tensor | None,
    S0: torch.Tensor | None,
    *,
    scale: float,
    mini_batch_size: int,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Outputs and final (M, S) (S None without momentum) of the docstring's recurrence; inputs as
    validated by the public ops (q, k [B, T, H, K], v [B, T, H, V], gates [B, T, H])."""
    dt, in_dtype = compute_dtype(q), q.dtype
    B, T, H, K = q.shape
    V = v.shape[-1]
    b = mini_batch_size
    C = b * max(1, chunk_size // b)  # chunk boundaries on mini-batch boundaries
    q, k, v = (chunks_heads_first(x.to(dt), C) for x in (q, k, v))  # [B, H, N, C, K or V]
    theta, alpha, eta = (None if x is None else chunks_heads_first(x.to(dt), C) for x in (theta, alpha, eta))
    N = q.shape[2]
    c, A, d, e, E = _coefficients(alpha, eta, C, theta)

    # the row p(t) each token's mini-batch starts after (-1: the chunk's entering state)
    pos = torch.arange(C, device=q.device)
    prev = (pos // b) * b - 1
    has_prev = prev >= 0
    pidx = prev.clamp_min(0)
    c_prev = c[..., pidx, :].masked_fill(~has_prev[:, None], 0.0)
    A_prev = torch.where(has_prev, A[..., pidx], torch.ones((), dtype=dt, device=q.device))
    kk = k @ k.transpose(-1, -2)
    rhs = [A_prev[..., None] * k]
    if d is not None:
        rhs.append((d[..., pidx] * has_prev)[..., None] * k)
    X = solve_unit_lower(theta[..., None, :] * c_prev * kk, torch.cat(rhs + [v], dim=-1))
    Wk, Wd, Uv = X.split([K, K if d is not None else 0, V], dim=-1)

    # the row each chunk leaves from: its last token, the last real token for the padded last chunk
    exit_row = torch.full((N,), C - 1, dtype=torch.long, device=q.device)
    exit_row[-1] = (T - 1) - (N - 1) * C
    n = torch.arange(N, device=q.device)
    kc = (theta * c[..., n, exit_row, :])[..., None] * k  # [B, H, N, C, K]
    A_exit = A[..., n, exit_row][..., None, None]  # [B, H, N, 1, 1]
    if d is not None:
        ke = (theta * e[..., n, exit_row, :])[..., None] * k
        d_exit, E_exit = (x[..., n, exit_row][..., None, None] for x in (d, E))

    M = q.new_zeros(B, H, K, V) if M0 is None else M0.to(dt)
    S = None if d is None else (q.new_zeros(B, H, K, V) if S0 is None else S0.to(dt))
    # per-chunk views made once: unbind's backward stacks the gradients once, where indexing
    # inside the loop would add a full-size zero tensor per chunk (quadratic in T)
    Wk, Uv, kc, A_exit = (x.unbind(2) for x in (Wk, Uv, kc, A_exit))
    if S is not None:
        Wd, ke, d_exit, E_exit = (x.unbind(2) for x in (Wd, ke, d_exit, E_exit))
    Ms, Ss, Us = [], [], []
    for i in range(N):
        U = Wk[i] @ M - Uv[i]
        if S is not None:
            U = U + Wd[i] @ S
            Ss.append(S)
        Ms.append(M)
        Us.append(U)
        M_next = A_exit[i] * M - kc[i].transpose(-1, -2) @ U
        if S is not None:
            M_next = M_next + d_exit[i] * S
            S = E_exit[i] * S - ke[i].transpose(-1, -2) @ U
        M = M_next
    M_in, U = torch.stack(Ms, dim=2), torch.stack(Us, dim=2)  # [B, H, N, K, V], [B, H, N, C, V]

    q = q * scale
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    scores = ((q @ k.transpose(-1, -2)) * c * theta[..., None, :]).masked_fill(~causal, 0.0)
    o = A[..., None] * (q @ M_in) - tril_matmul(scores, U)
    if S is not None:
        o = o + d[..., None] * (q @ torch.stack(Ss, dim=2))
    return chunks_heads_last(o, T).to(in_dtype), M, S


def ttt_linear_chunk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    eta: torch.Tensor,
    *,
    scale: float,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
    mini_batch_size: int = 16,
    norm_weight: torch.Tensor | None = None,
    norm_bias: torch.Tensor | None = None,
    norm_eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """TTT-Linear's chunk backend: the linear-memory chunks above, or with the inner norm one
    mini-batch per chunk (chunk_norm.py)."""
    if norm_weight is not None:
        o, W = ttt_linear_norm_chunk(q, k, v, eta, scale=scale, initial_state=initial_state,
                                     mini_batch_size=mini_batch_size, norm_weight=norm_weight,
                                     norm_bias=norm_bias, norm_eps=norm_eps)
    else:
        o, W, _ = linear_memory_chunk(q, k, v, eta, None, None, initial_state, None, scale=scale,
                                      mini_batch_size=mini_batch_size, chunk_size=chunk_size)
    return o, (W if output_final_state else None)


def titans_chunk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    theta: torch.Tensor,
    alpha: torch.Tensor,
    eta: torch.Tensor,
    *,
    scale: float,
    initial_state: tuple[torch.Tensor, torch.Tensor] | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
    mini_batch_size: int = 16,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """Titans' chunk backend (the linear-memory chunks above with momentum and weight decay)."""
    M0, S0 = (None, None) if initial_state is None else initial_state
    o, M, S = linear_memory_chunk(q, k, v, theta, alpha, eta, M0, S0, scale=scale,
                                  mini_batch_size=mini_batch_size, chunk_size=chunk_size)
    return o, ((M, S) if output_final_state else None)
