"""Chunkwise PaTH attention: the UT transform inside chunks (all chunks at once), keys carried across.

Inside every chunk c (C positions, all chunks batched), with L = tril(diag(b) W W^T, -1),

    [T_w | T_k] = (I + L)^-1 diag(b) [W | tril(W K^T, -1)]
    Q^ = Q - tril(Q W^T) T_w          queries moved to the frame of the chunk start: q^_t = (H_t..H_a)^T q_t
    A  = tril(Q K^T) - tril(Q W^T) T_k  intra-chunk scores q_t^T H_t..H_{s+1} k_s
    P  = I - W^T T_w                  the chunk's Householder product H_{a+C-1} .. H_a  (K x K)
    K^ = K - T_k^T W                  the chunk's keys moved to the frame of the chunk end

Across chunks (blockwise.py), query block a attends to earlier chunk j through its queries moved back chunk by
chunk, Q^_a P_{a-1} .. P_{j+1}, against K^_j (and to the cache, keys in the frame of the first chunk's start,
likewise). The forget gate enters as chunk-local cumulative sums plus sums of chunk totals (times scale, like
the scores), so nothing is exponentiated but softmax logits. Cost O(T^2 (K + K^2 / C)). Forward and backward
(hand-written, recomputing each query block's logits from the saved row log-sum-exp) hold O(T (K + C + V) + N
K^2) memory: linear in T for training too. The final cache moves every key to the frame of the end with suffix
products of the chunks' K x K products.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..common.causal_softmax import causal_mask
from ..common.checks import compute_dtype
from ..common.chunking import chunk_local_cumsum, from_chunks, to_chunks
from ..common.kv_cache import KVCache
from ..common.masking import all_finite_here, confine_attention, finite_part, nonfinite_rows, tril_matmul
from ..common.triangular import solve_unit_lower
from .blockwise import PathBlockwise
from .reference import _past


def _heads_first(x: torch.Tensor, C: int) -> torch.Tensor:
    """[B, T, H, ...] -> [B, H, N, C, ...] (zero-padded to a multiple of C)."""
    x = to_chunks(x, C)
    return x.permute(0, 3, 1, 2, *range(4, x.dim()))


@dataclass
class UTTransform:
    """What :func:`ut_transform` gives, every tensor [B, H, N, C, *] (chunks of C tokens, heads first)."""

    Qhat: torch.Tensor  # queries moved past the chunk's own Householder factors up to their row
    intra: torch.Tensor  # [.., C, C] in-chunk logits (scaled, gate bias included), -inf above the diagonal
    Khat: torch.Tensor  # keys moved to the chunk's end frame
    E: torch.Tensor  # [.., K, K]: the chunk's product of factors is P = I - E (E = W^T T_w)
    Vc: torch.Tensor  # values
    Gl: torch.Tensor  # [B, H, N, C] log gates summed within the chunk


def ut_transform(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor, beta: torch.Tensor,
                 g: torch.Tensor | None, scale: float, C: int) -> UTTransform:
    """Everything of PaTH's chunk form that does not depend on earlier chunks, for all chunks at once (inputs
    [B, T, H, *] in the compute dtype; padding to a multiple of C: w = b = 0, so its factors are I). With the UT
    transform T = (I + tril(b W W^T, -1))^-1 b [W, tril(W K^T, -1)] = [T_w, T_k]:
    Qhat = Q - tril(Q W^T) T_w, Khat = K - T_k^T W, intra = scale (tril(Q K^T) - tril(Q W^T) T_k + G_t - G_s)."""
    K = q.shape[-1]
    g = torch.zeros_like(beta) if g is None else g
    Q, Kc, W, Vc = (_heads_first(x, C) for x in (q, k, w, v))
    b = _heads_first(beta, C)[..., None]
    Gl = chunk_local_cumsum(g, C).permute(0, 3, 1, 2)
    M, Ms = causal_mask(C, C, device=q.device), causal_mask(C, C, strict=True, device=q.device)
    tril = lambda x, m: x.masked_fill(~m, 0.0)
    tr = lambda x: x.transpose(-1, -2)
    X = solve_unit_lower(b * (W @ tr(W)), b * torch.cat([W, tril(W @ tr(Kc), Ms)], dim=-1))
    Tw, Tk = X[..., :K], X[..., K:]
    QW = tril(Q @ tr(W), M)
    Qhat = Q - tril_matmul(QW, Tw)  # row t reads rows <= t only, whatever the later rows hold (masking.py)
    intra = scale * (tril(Q @ tr(Kc), M) - tril_matmul(QW, Tk) + (Gl[..., :, None] - Gl[..., None, :]))
    return UTTransform(Qhat=Qhat, intra=intra.masked_fill(~M, float("-inf")), Khat=Kc - tr(Tk) @ W,
                       E=tr(W) @ Tw, Vc=Vc, Gl=Gl)


def path_attn_chunk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    w: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor | None = None,
    *,
    scale: float,
    initial_state: KVCache | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, KVCache | None]:
    """Chunkwise-parallel PaTH (see the module docstring); any T, any device."""
    dt, in_dtype = compute_dtype(q), q.dtype
    q, k, v, w, beta = (x.to(dt) for x in (q, k, v, w, beta))
    g = None if g is None else g.to(dt)
    k0, v0, d0 = _past(initial_state, k, v.shape[-1], dt)
    T, K, C = q.shape[1], q.shape[-1], chunk_size
    ut = ut_transform(q, k, v, w, beta, g, scale, C)
    Qhat, intra, Khat, Vc, Gl = ut.Qhat, ut.intra, ut.Khat, ut.Vc, ut.Gl
    Pt = torch.eye(K, dtype=dt, device=q.device) - ut.E.transpose(-1, -2)  # P^T = I - T_w^T W
    total = Gl[..., -1]  # [B, H, N] log decay across each chunk

    S0, V0, D0 = (x.transpose(1, 2) for x in (k0, v0, d0))  # cache [B, H, T0, *]
    # the gate bias is inside the scale (logit = scale (q.k~ + G_t - G_s)): the blockwise pass adds scaled gates
    if all_finite_here(Vc, V0):
        o = PathBlockwise.apply(Qhat, intra, Pt, Khat, scale * total, scale * Gl, Vc, S0, V0, scale * D0, scale)
    else:  # P V reads the values' finite part; the rows that see a non-finite value are NaN afterwards (masking.py)
        o = PathBlockwise.apply(Qhat, intra, Pt, Khat, scale * total, scale * Gl, finite_part(Vc), S0,
                                finite_part(V0), scale * D0, scale)
        bad = nonfinite_rows(torch.cat([V0, Vc.flatten(2, 3)], dim=2))  # [B, H, T0 + N C]
        o = confine_attention(o.flatten(2, 3), bad).unflatten(2, (-1, C))
    o = from_chunks(o.permute(0, 2, 3, 1, 4), T)
    state = None
    if output_final_state:
        state = _final_state(S0, V0, D0, Khat, Vc, Pt, total, Gl, T)
    return o.to(in_dtype), state


def _final_state(S0: torch.Tensor, V0: torch.Tensor, D0: torch.Tensor, Khat: torch.Tensor, Vc: torch.Tensor,
                 Pt: torch.Tensor, total: torch.Tensor, Gl: torch.Tensor, T: int) -> KVCache:
    """Every key moved to the frame of the last position: K^_j P_{j+1}^T .. P_{N-1}^T (suffix products of
    the chunks' K x K products, N of them), the values, and the log decays G_end - G_s."""
    B, H, N, C, K = Khat.shape
    R, suffix = torch.eye(K, dtype=Khat.dtype, device=Khat.device).expand(B, H, K, K), []
    for j in range(N - 1, -1, -1):  # R_j = P_{j+1}^T .. P_{N-1}^T
        suffix.append(R)
        R = Pt[:, :, j] @ R
    R_all = torch.stack(suffix[::-1], dim=2)  # [B, H, N, K, K]; R is now P_0^T .. P_{N-1}^T
    after = total.flip(-1).cumsum(-1).flip(-1)  # c_j + .. + c_{N-1}
    keys = torch.cat([S0 @ R, (Khat @ R_all).reshape(B, H, N * C, K)], dim=2)
    decay = torch.cat([D0 + total.sum(-1, keepdim=True), (after[..., None] - Gl).reshape(B, H, N * C)], dim=2)
    values = torch.cat([V0, Vc.reshape(B, H, N * C, -1)], dim=2)
    end = S0.shape[2] + T
    keys, values, decay = (x[:, :, :end].transpose(1, 2) for x in (keys, values, decay))
    return KVCache(keys, values, {"log_decay": decay})
