"""Chunkwise-parallel gated delta rule (pure PyTorch, any device), in its generalisation with a
separate read key p (Comba; p = k for the gated delta rule, g = None for the plain delta rule).

Within a chunk of C tokens entered with state S (G: cumulative log gate restarted at the chunk,
gamma_t = exp(G_t), D_ts = exp(G_t - G_s) for s <= t), the WY / UT representation is

    (I + A) [U0 | W] = [diag(b) V | diag(b gamma) P],   A_ts = b_t (p_t . k_s) D_ts  (s < t)
    U = U0 - W S                                   (pseudo-values, see reference.py)
    O = diag(gamma) (scale Q) S + QK U = (diag(gamma) scale Q - QK W) S + QK U0,   QK = scale Q K^T ⊙ D ⊙ M
    S' = gamma_C S + K_end^T U = (gamma_C I - K_end^T W) S + K_end^T U0,   K_end = diag(D_Cs) K.

Everything except the transition S -> S' is computed for all chunks at once (one batched inverse of
I + A); the Python loop over chunks (common/matrix_scan.py) does one [K, K] x [K, V] matmul per chunk,
forward and backward. Only in-chunk differences of cumulative gates are exponentiated (all factors
are <= 1 for g <= 0), and memory grows linearly in T. Layout inside: [N, B, H, C, D] (chunks first).
"""

from __future__ import annotations

import torch

from ..common.checks import compute_dtype
from ..common.chunking import chunk_local_cumsum, from_chunks, to_chunks
from ..common.masking import tril_matmul
from ..common.matrix_scan import matrix_state_scan
from ..common.triangular import unit_lower_inverse


def chunks_first(x: torch.Tensor, C: int, dtype: torch.dtype) -> torch.Tensor:
    """[B, T, H, ...] -> contiguous [N, B, H, C, ...] in ``dtype`` (time zero-padded to a multiple of C)."""
    x = to_chunks(x, C)  # [B, N, C, H, ...]
    return x.permute(1, 0, 3, 2, *range(4, x.dim())).to(dtype, memory_format=torch.contiguous_format)


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
    T, K, C = q.shape[1], q.shape[-1], chunk_size
    # [N, B, H, C, D], zero-padded at the end (b = 0 and g = 0 there: padding changes nothing)
    q, k, v = (chunks_first(x, C, dt) for x in (q, k, v))
    p = k if p is None else chunks_first(p, C, dt)
    b = chunks_first(beta, C, dt)[..., None]  # [N, B, H, C, 1]
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    if g is None:  # no decay: D is the causal mask
        G, D = torch.zeros_like(b[..., 0]), causal.to(dt)
    else:
        G = chunk_local_cumsum(g.to(dt), C).permute(1, 0, 3, 2)  # [N, B, H, C]
        D = torch.exp((G[..., :, None] - G[..., None, :]).masked_fill(~causal, float("-inf")))  # [N, B, H, C, C]
    gamma = torch.exp(G)[..., None]  # [N, B, H, C, 1]: decay from the chunk start to t
    k_end = k * D[..., -1, :, None]  # k_s times the decay from s to the chunk end

    A = b * (p @ k.transpose(-1, -2)) * D  # only its strictly lower triangle is read
    # (I + A)^-1 diag(b), masked by selection: its zeros above the diagonal times a later NaN beta would leak
    T_b = (unit_lower_inverse(A) * b.transpose(-1, -2)).masked_fill(~causal, 0.0)
    U0 = tril_matmul(T_b, v)  # row t reads rows <= t only, whatever the later rows hold (masking.py)
    W = tril_matmul(T_b, p if g is None else gamma * p)
    eye = torch.eye(K, dtype=dt, device=q.device)
    M = gamma[..., -1:, :] * eye - k_end.transpose(-1, -2) @ W  # [N, B, H, K, K]
    R = k_end.transpose(-1, -2) @ U0  # [N, B, H, K, V]
    S_in, S_final = matrix_state_scan(M, R, initial_state)

    # O = diag(gamma) Q S + QK (U0 - W S) = (diag(gamma) Q - QK W) S + QK U0, QK = scale Q K^T ⊙ D ⊙ M
    QK = (q @ k.transpose(-1, -2) * (scale * D)).masked_fill(~causal, 0.0)
    o = (q * (scale * gamma) - tril_matmul(QK, W)) @ S_in + tril_matmul(QK, U0)
    o = o.permute(1, 0, 3, 2, 4).to(in_dtype, memory_format=torch.contiguous_format)  # [B, N, C, H, V]
    return from_chunks(o, T), (S_final if output_final_state else None)
