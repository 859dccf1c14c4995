"""Chunkwise-parallel GLA (per-channel decay), pure PyTorch, any device, stable for any gate.

    S_t = diag(exp(g_t)) S_{t-1} + k_t v_t^T,        o_t = S_t^T (scale * q_t)

Time is split into N chunks of C tokens; G_t in R^K is the cumulative log gate restarted at every
chunk (G_t <= 0). With S_n the state entering chunk n and L = G of the chunk's last token:

    o_t     = sum_{s <= t in chunk} A_ts v_s + (q_t ⊙ exp(G_t))^T S_n,  A_ts = q_t^T diag(exp(G_t - G_s)) k_s
    S_{n+1} = diag(exp(L)) S_n + sum_s (k_s ⊙ exp(L - G_s)) v_s^T

Stability. A per-channel decay cannot be split as exp(G_t) exp(-G_s) (exp(-G_s) overflows at
g = -20 per token after 5 tokens), and the full [C, C, K] tensor of exp(G_t - G_s) costs C x the
memory of q. So each chunk is cut into sub-chunks of c = 16 tokens:

* t and s in the same sub-chunk: the [c, c, K] differences G_t - G_s (s <= t, so <= 0) are formed
  explicitly and exponentiated;
* t in sub-chunk i, s in an earlier sub-chunk j < i: with b_i the last token before sub-chunk i and
  e_j the last token of sub-chunk j (e_j <= b_i),
      exp(G_t - G_s) = exp(G_t - G_{b_i}) * exp(G_{b_i} - G_{e_j}) * exp(G_{e_j} - G_s),
  three factors that are each <= 1: a query scaled within its sub-chunk, a [K] factor between the
  two boundaries, and a key scaled within its sub-chunk; the block is one batched matmul.

Every exponent is <= 0 (or -inf where masked), so nothing overflows and no gradient is NaN; tiny
decays underflow to 0, their true value to float precision.
"""

from __future__ import annotations

import torch

from ..common.checks import compute_dtype
from ..common.chunking import chunk_local_cumsum
from ..common.state_scan import chunk_state_scan, chunks_heads_first, chunks_heads_last, largest_divisor_at_most

SUB_CHUNK = 16


def _masked_exp(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """exp(x) where ``keep``, 0 elsewhere (masked before exponentiating, so no inf and no NaN grad)."""
    return torch.exp(x.masked_fill(~keep, float("-inf")))


def gla_intra_chunk_scores(q: torch.Tensor, k: torch.Tensor, G: torch.Tensor, sub: int = SUB_CHUNK) -> torch.Tensor:
    """A_ts = q_t^T diag(exp(G_t - G_s)) k_s for s <= t inside every chunk, 0 above the diagonal.

    q, k, G [..., C, K] (G the in-chunk cumulative log gates); returns [..., C, C]. ``sub`` is the
    sub-chunk length (the largest divisor of C that is <= ``sub`` is used).
    """
    *lead, C, K = q.shape
    c = largest_divisor_at_most(C, sub)
    m = C // c
    qs, ks, Gs = (x.reshape(*lead, m, c, K) for x in (q, k, G))
    dev = q.device

    # same sub-chunk: explicit [c, c, K] decay differences, s <= t
    tril_c = torch.ones(c, c, dtype=torch.bool, device=dev).tril()[:, :, None]
    D = _masked_exp(Gs[..., :, None, :] - Gs[..., None, :, :], tril_c)  # [..., m, c, c, K]
    A_diag = (qs[..., :, None, :] * D * ks[..., None, :, :]).sum(-1)  # [..., m, c, c]

    # earlier sub-chunk j < i: factor through the boundaries b_i (before sub-chunk i) and e_j (end of j)
    Ge = Gs[..., -1, :]  # [..., m, K]
    Gb = torch.cat([torch.zeros_like(Ge[..., :1, :]), Ge[..., :-1, :]], dim=-2)  # [..., m, K]
    q_in = qs * torch.exp(Gs - Gb[..., :, None, :])  # [..., m, c, K]
    k_in = ks * torch.exp(Ge[..., :, None, :] - Gs)  # [..., m, c, K]
    lower_m = torch.ones(m, m, dtype=torch.bool, device=dev).tril(-1)[:, :, None]
    mid = _masked_exp(Gb[..., :, None, :] - Ge[..., None, :, :], lower_m)  # [..., m(i), m(j), K]
    A_off = (q_in[..., :, None, :, :] * mid[..., :, :, None, :]) @ k_in[..., None, :, :, :].transpose(-1, -2)
    # A_off [..., i, j, c(t), c(s)] -> add the diagonal blocks, lay out as [C, C]
    eye = torch.eye(m, dtype=q.dtype, device=dev)
    A = A_off + A_diag[..., :, None, :, :] * eye[:, :, None, None]
    return A.transpose(-3, -2).reshape(*lead, C, C)


def gla_chunk(
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
    """Chunkwise-parallel form (see the module docstring); inputs validated by ``gla``."""
    dt, in_dtype = compute_dtype(q), q.dtype
    T, C = q.shape[1], chunk_size
    q, k, v = (chunks_heads_first(x.to(dt), C) for x in (q, k, v))  # [B, H, N, C, K or V]
    G = chunk_local_cumsum(g.to(dt), C).movedim(3, 1)  # [B, H, N, C, K]
    q = q * scale

    o = gla_intra_chunk_scores(q, k, G) @ v  # intra-chunk

    L = G[..., -1:, :]  # [B, H, N, 1, K]
    U = (k * torch.exp(L - G)).transpose(-1, -2) @ v  # [B, H, N, K, V]
    states, S = chunk_state_scan(torch.exp(L).transpose(-1, -2), U, initial_state)
    o = o + (q * torch.exp(G)) @ states  # inter-chunk
    return chunks_heads_last(o, T).to(in_dtype), (S if output_final_state else None)
