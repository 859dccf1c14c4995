"""Chunkwise-parallel gated delta rule (pure PyTorch, any device), in its generalisation with a
separate read key p (Comba; p = k for the gated delta rule, g = None for the plain delta rule).

Within a chunk of C tokens entered with state S (G: cumulative log gate restarted at the chunk,
gamma_t = exp(G_t), D_ts = exp(G_t - G_s) for s <= t), the WY / UT representation is

    (I + A) [U0 | W] = [diag(b) V | diag(b gamma) P],   A_ts = b_t (p_t . k_s) D_ts  (s < t)
    U = U0 - W S                                   (pseudo-values, see reference.py)
    O = diag(gamma) (scale Q) S + (scale Q K^T ⊙ D ⊙ M) U
    S' = gamma_C S + K_end^T U = (gamma_C I - K_end^T W) S + K_end^T U0,   K_end = diag(D_Cs) K.

Everything except the transition S -> S' is computed for all chunks at once (one batched triangular
solve); the Python loop over chunks does one [K, K] x [K, V] matmul per chunk. Only in-chunk
differences of cumulative gates are exponentiated (all factors are <= 1 for g <= 0), and memory
grows linearly in T.
"""

from __future__ import annotations

import torch

from ..common.checks import compute_dtype
from ..common.chunking import chunk_local_cumsum
from ..common.state_scan import chunks_heads_first, chunks_heads_last
from ..common.triangular import solve_unit_lower


def matrix_state_scan(
    M: torch.Tensor, R: torch.Tensor, initial_state: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run S_{n+1} = M_n S_n + R_n over chunks n = 0..N-1 from S_0 = initial_state (None: zeros).

    ``M`` [B, H, N, K, K], ``R`` [B, H, N, K, V]. Returns (the states entering every chunk
    [B, H, N, K, V], the state after the last chunk [B, H, K, V]).
    """
    B, H, N, K, V = R.shape
    S = R.new_zeros(B, H, K, V) if initial_state is None else initial_state.to(R.dtype)
    entering = []
    # unbind (not R[:, :, n]): its backward stacks the N gradients once, where indexing in the loop
    # would write a zero-filled full-size gradient per chunk (O(N^2) memory traffic)
    for M_n, R_n in zip(M.reshape(B * H, N, K, K).unbind(1), R.reshape(B * H, N, K, V).unbind(1)):
        entering.append(S)
        S = torch.baddbmm(R_n, M_n, S.reshape(B * H, K, V)).view(B, H, K, V)
    return torch.stack(entering, dim=2), S


def gated_delta_chunk(
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
    """Chunkwise form of the module docstring; inputs [B, T, H, ...] validated by the public op."""
    dt, in_dtype = compute_dtype(q), q.dtype
    T, K, V, C = q.shape[1], q.shape[-1], v.shape[-1], chunk_size
    # [B, H, N, C, D], zero-padded at the end (b = 0 and g = 0 there: padding changes nothing)
    q, k, v = (chunks_heads_first(x.to(dt), C) for x in (q, k, v))
    p = k if p is None else chunks_heads_first(p.to(dt), C)
    b = chunks_heads_first(beta.to(dt), C)[..., None]  # [B, H, N, C, 1]
    if g is None:
        G = torch.zeros_like(b[..., 0])
    else:
        G = chunk_local_cumsum(g.to(dt), C).movedim(3, 1)  # [B, H, N, C]
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    D = torch.exp((G[..., :, None] - G[..., None, :]).masked_fill(~causal, float("-inf")))  # [B, H, N, C, C]
    gamma = torch.exp(G)[..., None]  # [B, H, N, C, 1]: decay from the chunk start to t
    k_end = k * D[..., -1, :, None]  # k_s times the decay from s to the chunk end

    A = b * (p @ k.transpose(-1, -2)) * D  # the solve reads only its strictly lower triangle
    U0, W = solve_unit_lower(A, torch.cat([b * v, (b * gamma) * p], dim=-1)).split([V, K], dim=-1)
    eye = torch.eye(K, dtype=dt, device=q.device)
    M = gamma[..., -1:, :] * eye - k_end.transpose(-1, -2) @ W  # [B, H, N, K, K]
    R = k_end.transpose(-1, -2) @ U0  # [B, H, N, K, V]
    S_in, S_final = matrix_state_scan(M, R, initial_state)

    U = U0 - W @ S_in
    q = scale * q
    o = (gamma * q) @ S_in + (q @ k.transpose(-1, -2) * D) @ U
    return chunks_heads_last(o, T).to(in_dtype), (S_final if output_final_state else None)
