"""Chunkwise-parallel GLA (per-channel decay), pure PyTorch, any device, stable for any gate.

    S_t = diag(exp(g_t)) S_{t-1} + k_t v_t^T,        o_t = S_t^T (scale * q_t)

Time is split into N chunks of C tokens; G_t in R^K is the cumulative log gate restarted at every
chunk (G_t <= 0). With S_n the state entering chunk n and L = G of the chunk's last token:

    o_t     = sum_{s <= t in chunk} A_ts v_s + (q_t ⊙ exp(G_t))^T S_n,  A_ts = q_t^T diag(exp(G_t - G_s)) k_s
    S_{n+1} = diag(exp(L)) S_n + sum_s (k_s ⊙ exp(L - G_s)) v_s^T

Stability. A per-channel decay cannot be split as exp(G_t) exp(-G_s) (exp(-G_s) overflows at
g = -20 per token after 5 tokens), and the full [C, C, K] tensor of exp(G_t - G_s) costs C x the
memory of q. So each chunk is cut into sub-chunks of c = 16 tokens. With b_i the last token before
sub-chunk i, for t in sub-chunk i and any earlier s (s <= b_i):

    exp(G_t - G_s) = exp(G_t - G_{b_i}) * exp(G_{b_i} - G_s),

two factors <= 1: the queries of sub-chunk i decayed to b_i, and every earlier key decayed to b_i;
the whole row block is one batched matmul. For s and t in the same sub-chunk, exp(G_{b_i} - G_s)
is >= 1; it is used in the same matmul only when every |G_t - G_{b_i}| <= 30 (typical gates:
16 tokens of GLA's logsigmoid/16 gate); otherwise (e.g. g = -20) the [c, c, K] differences
G_t - G_s (s <= t) are formed explicitly and exponentiated. That choice reads the gates: eager mode
branches on it (one host sync); under torch.compile it is made inside the graph, with the same result.

Every exponent is <= 0, or <= 30 in the factored diagonal blocks, and masked entries are set to -inf
before exp, so nothing overflows and no gradient is NaN; tiny decays underflow to 0, their true
value to float precision.
"""

from __future__ import annotations

import torch

from ..common.checks import compute_dtype
from ..common.chunking import chunk_local_cumsum
from ..common.masking import tril_matmul
from ..common.state_scan import chunk_state_scan, chunks_heads_first, chunks_heads_last, largest_divisor_at_most

SUB_CHUNK = 16
FACTOR_LIMIT = 30.0  # largest |G_t - G_b| within a sub-chunk for which exp(G_b - G_s) may be formed


def _masked_exp(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """exp(x) where ``keep``, 0 elsewhere (masked before exponentiating, so no inf and no NaN grad)."""
    return torch.exp(x.masked_fill(~keep, float("-inf")))


def gla_intra_chunk_scores(
    q: torch.Tensor, k: torch.Tensor, G: torch.Tensor, sub: int = SUB_CHUNK, factor_diagonal: bool | None = None
) -> torch.Tensor:
    """A_ts = q_t^T diag(exp(G_t - G_s)) k_s for s <= t inside every chunk, 0 above the diagonal.

    q, k, G [..., C, K] (G the in-chunk cumulative log gates); returns [..., C, C]. ``sub`` is the
    sub-chunk length (the largest divisor of C that is <= ``sub`` is used). Row block i (the
    queries of sub-chunk i, decayed to the boundary b_i before it) meets every earlier key through
    exp(G_{b_i} - G_s) <= 1 in one matmul. The diagonal blocks s, t in sub-chunk i either use the
    same matmul with exp(G_{b_i} - G_s) >= 1 (``factor_diagonal``; allowed when every |G_t - G_{b_i}|
    <= FACTOR_LIMIT, so nothing overflows and q's factor stays >= e^-30) or the explicit [c, c, K]
    differences (any gate). None picks the first whenever it is allowed: in eager mode by reading the
    gates (one host sync), under torch.compile inside the graph (:func:`_scores_either`).
    """
    *lead, C, K = q.shape
    c = largest_divisor_at_most(C, sub)
    m = C // c
    qs, Gs = q.reshape(*lead, m, c, K), G.reshape(*lead, m, c, K)
    Gb = torch.cat([torch.zeros_like(Gs[..., :1, -1, :]), Gs[..., :-1, -1, :]], dim=-2)  # [..., m, K]
    rel = Gs - Gb[..., :, None, :]  # G_t - G_{b_i} for t in sub-chunk i
    q_in = qs * torch.exp(rel)  # [..., m, c, K]; <= 1 when g <= 0
    if factor_diagonal is None and rel.numel() and torch.compiler.is_compiling():
        return _scores_either(q_in, qs, k, G, Gs, Gb, rel.abs().amax() <= FACTOR_LIMIT)
    if factor_diagonal is None:
        factor_diagonal = bool(rel.abs().amax() <= FACTOR_LIMIT) if rel.numel() else True
    A = _row_block_scores(q_in, k, G, Gb, factor_diagonal)
    if factor_diagonal:
        return A.masked_fill(~torch.ones(C, C, dtype=torch.bool, device=q.device).tril(), 0.0)
    return A + _explicit_diagonal(qs, k, Gs)


def _row_block_scores(q_in: torch.Tensor, k: torch.Tensor, G: torch.Tensor, Gb: torch.Tensor,
                         with_diagonal: bool | torch.Tensor) -> torch.Tensor:
    """[..., C, C]: every row block against the keys of the earlier sub-chunks in one matmul, and against its own
    sub-chunk's keys too where ``with_diagonal`` (factored diagonal blocks; entries above the diagonal are then
    not yet zeroed); a bool tensor decides inside the graph."""
    *lead, m, c, K = q_in.shape
    C = m * c
    dev = q_in.device
    block = torch.arange(C, device=dev) // c  # sub-chunk of every key
    rows = torch.arange(m, device=dev)[:, None]
    keys_used = block[None, :] < rows  # [m, C]
    if isinstance(with_diagonal, torch.Tensor):
        keys_used = keys_used | ((block[None, :] == rows) & with_diagonal)
    elif with_diagonal:
        keys_used = block[None, :] <= rows
    k_rel = _masked_exp(Gb[..., :, None, :] - G[..., None, :, :], keys_used[..., None])  # [..., m, C, K]
    k_in = (k[..., None, :, :] * k_rel).masked_fill(~keys_used[..., None], 0.0)  # selection: a NaN key stays out
    A = q_in @ k_in.transpose(-1, -2)  # [..., m, c(t), C(s)]
    return A.reshape(*lead, C, C)


def _explicit_diagonal(qs: torch.Tensor, k: torch.Tensor, Gs: torch.Tensor) -> torch.Tensor:
    """[..., C, C]: the diagonal blocks from the explicit [c, c, K] decay differences (s <= t), 0 elsewhere."""
    *lead, m, c, K = qs.shape
    dev = qs.device
    ks = k.reshape(*lead, m, c, K)
    tril_c = torch.ones(c, c, dtype=torch.bool, device=dev).tril()[:, :, None]
    D = _masked_exp(Gs[..., :, None, :] - Gs[..., None, :, :], tril_c)  # [..., m, c, c, K]
    A_diag = (qs[..., :, None, :] * D * ks[..., None, :, :]).sum(-1).masked_fill(~tril_c[..., 0], 0.0)
    same = torch.eye(m, dtype=torch.bool, device=dev)[:, None, :, None]  # [m, 1, m, 1]: block i of row block i
    A_full = torch.where(same, A_diag[..., :, :, None, :], torch.zeros((), dtype=A_diag.dtype, device=dev))
    return A_full.reshape(*lead, m * c, m * c)


def _scores_either(q_in: torch.Tensor, qs: torch.Tensor, k: torch.Tensor, G: torch.Tensor, Gs: torch.Tensor,
                   Gb: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """The scores with eager mode's choice of diagonal blocks made by the bool tensor ``factor`` (no host sync, no
    graph break; torch.cond cannot be used: its two branches' gradients differ in strides). The explicit
    blocks are formed either way and masked out when factoring: where factoring is allowed they are finite, so
    they add exact zeros (and zero gradients); where it is not, the matmul leaves the diagonal blocks out, as
    eager mode does, so nothing overflows."""
    C = qs.shape[-3] * qs.shape[-2]
    A = _row_block_scores(q_in, k, G, Gb, factor)
    A = A.masked_fill(~torch.ones(C, C, dtype=torch.bool, device=qs.device).tril(), 0.0)
    return A + torch.where(factor, torch.zeros((), dtype=A.dtype, device=A.device), _explicit_diagonal(qs, k, Gs))


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

    o = tril_matmul(gla_intra_chunk_scores(q, k, G), v)  # intra-chunk (masking.py)

    L = G[..., -1:, :]  # [B, H, N, 1, K]
    U = (k * torch.exp(L - G)).transpose(-1, -2) @ v  # [B, H, N, K, V]
    states, S = chunk_state_scan(torch.exp(L).transpose(-1, -2), U, initial_state)
    o = o + (q * torch.exp(G)) @ states  # inter-chunk
    return chunks_heads_last(o, T).to(in_dtype), (S if output_final_state else None)
