"""Chunkwise-parallel simple_gla (scalar decay per head), pure PyTorch, any device.

    S_t = exp(g_t) S_{t-1} + k_t v_t^T,        o_t = S_t^T (scale * q_t)

Split time into N chunks of C tokens and let G_t be the cumulative log gate *restarted at every
chunk* (G_t <= 0, G_t = sum of g over the chunk's tokens up to and including t). With S_n the state
entering chunk n, L = G of the chunk's last token:

    o_t     = sum_{s <= t in chunk} (q_t . k_s) exp(G_t - G_s) v_s   +   exp(G_t) S_n^T q_t
    S_{n+1} = exp(L) S_n + sum_s exp(L - G_s) k_s v_s^T

Every exponent is <= 0 (s <= t, or s before the chunk's end), so nothing overflows at any T and
any gate. The intra-chunk products, the chunk writes and the reads are batched over all chunks;
only S_n -> S_{n+1} loops over the N chunks.
"""

from __future__ import annotations

import torch

from ..common.checks import compute_dtype
from ..common.chunking import chunk_local_cumsum
from ..common.masking import tril_matmul
from ..common.state_scan import chunk_state_scan, chunks_heads_first, chunks_heads_last


def simple_gla_chunk(
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
    """Chunkwise-parallel form (see the module docstring); inputs validated by ``simple_gla``."""
    dt, in_dtype = compute_dtype(q), q.dtype
    T, C = q.shape[1], chunk_size
    q, k, v = (chunks_heads_first(x.to(dt), C) for x in (q, k, v))  # [B, H, N, C, K or V]
    G = chunk_local_cumsum(g.to(dt), C).movedim(3, 1)  # [B, H, N, C]
    q = q * scale

    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    D = torch.exp((G[..., :, None] - G[..., None, :]).masked_fill(~causal, float("-inf")))
    o = tril_matmul(((q @ k.transpose(-1, -2)) * D).masked_fill(~causal, 0.0), v)  # intra-chunk (masking.py)

    L = G[..., -1:]  # [B, H, N, 1]
    U = (k * torch.exp(L - G)[..., None]).transpose(-1, -2) @ v  # [B, H, N, K, V]
    states, S = chunk_state_scan(torch.exp(L)[..., None], U, initial_state)
    o = o + (q * torch.exp(G)[..., None]) @ states  # inter-chunk
    return chunks_heads_last(o, T).to(in_dtype), (S if output_final_state else None)
