"""Chunkwise-parallel MesaNet, pure PyTorch, any device.

    G_t = exp(g_t) G_{t-1} + b_t k_t k_t^T,   H_t = exp(g_t) H_{t-1} + b_t k_t v_t^T,
    o_t = H_t^T (G_t + diag(lamb))^-1 (scale q_t)

Split time into N chunks of C tokens; let Gc_t be the log gate summed over the chunk up to t and
(G_n, H_n) the states entering chunk n. With W_ts = exp(Gc_t - Gc_s) b_s (s <= t, in the chunk):

    G_t = exp(Gc_t) G_n + sum_s W_ts k_s k_s^T          (every t of every chunk at once)
    x_t = (G_t + diag(lamb))^-1 (scale q_t)             (one solve batched over all t)
    o_t = sum_s W_ts (x_t . k_s) v_s + exp(Gc_t) H_n^T x_t

Only (G_n, H_n) -> (G_{n+1}, H_{n+1}) loops over chunks, carried as one [K, K + V] matrix. Every
exponent is <= 0 for g <= 0. Memory is O(T K^2) for the per-token G_t (linear in T).
"""

from __future__ import annotations

import torch

from ..common.checks import compute_dtype
from ..common.chunking import chunk_local_cumsum
from ..common.masking import tril_matmul
from ..common.state_scan import chunk_state_scan, chunks_heads_first, chunks_heads_last
from .reference import MesaState, initial_mesa_state
from .solve import spd_solve


def mesa_net_chunk(
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
    """Chunkwise-parallel form (see the module docstring); inputs validated by ``mesa_net``."""
    dt, in_dtype = compute_dtype(q), q.dtype
    B, T, H, K = q.shape
    C = chunk_size
    q, k, v = (chunks_heads_first(x.to(dt), C) for x in (q, k, v))  # [B, H, N, C, K or V]
    b = chunks_heads_first(beta.to(dt), C)  # [B, H, N, C]
    Gc = chunk_local_cumsum(g.to(dt), C).movedim(3, 1)  # [B, H, N, C]
    G0, H0 = initial_mesa_state(initial_state, B, H, K, v.shape[-1], dt, q.device)

    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    W = torch.exp((Gc[..., :, None] - Gc[..., None, :]).masked_fill(~causal, float("-inf"))) * b[..., None, :]
    W = W.masked_fill(~causal, 0.0)  # by selection: a later NaN beta times 0 would leak (masking.py)
    L = Gc[..., -1:]  # [B, H, N, 1]
    kw = k * (torch.exp(L - Gc) * b)[..., None]  # k_s decayed to the chunk end, times b_s
    U = kw.transpose(-1, -2) @ torch.cat([k, v], dim=-1)  # [B, H, N, K, K + V]: what chunk n writes
    states, last = chunk_state_scan(torch.exp(L)[..., None], U, torch.cat([G0, H0], dim=-1))
    G_in, H_in = states.split([K, v.shape[-1]], dim=-1)  # entering each chunk

    decay = torch.exp(Gc)[..., None, None]  # [B, H, N, C, 1, 1]
    kk = (k[..., :, None] * k[..., None, :]).flatten(-2)  # [B, H, N, C, K*K]
    G_all = tril_matmul(W, kk).unflatten(-1, (K, K)) + decay * G_in[:, :, :, None]
    X = spd_solve(G_all + torch.diag_embed(lamb.to(dt))[:, None, None], q * scale, solver, cg_steps)
    o = tril_matmul(((X @ k.transpose(-1, -2)) * W).masked_fill(~causal, 0.0), v) + (X * decay[..., 0]) @ H_in
    final = tuple(last.split([K, v.shape[-1]], dim=-1)) if output_final_state else None
    return chunks_heads_last(o, T).to(in_dtype), final
