"""Chunkwise PaTH attention: the UT transform inside chunks (all chunks at once), keys carried across.

Inside every chunk c (C positions, all chunks batched), with L = tril(diag(b) W W^T, -1),

    [T_w | T_k] = (I + L)^-1 diag(b) [W | tril(W K^T, -1)]
    Q^ = Q - tril(Q W^T) T_w          queries moved to the frame of the chunk start: q^_t = (H_t..H_a)^T q_t
    A  = tril(Q K^T) - tril(Q W^T) T_k  intra-chunk scores q_t^T H_t..H_{s+1} k_s
    P  = I - W^T T_w                  the chunk's Householder product H_{a+C-1} .. H_a  (K x K)
    K^ = K - T_k^T W                  the chunk's keys moved to the frame of the chunk end

Only the cache of past keys (all moved to the frame of the current chunk start) is carried from chunk
to chunk: scores against the past are Q^ S^T, then S <- [S P^T ; K^] (one [P x K] x [K x K] matmul).
The forget gate enters as chunk-local cumulative sums plus a per-key log decay carried like the keys,
so nothing is exponentiated but softmax logits. Working memory per chunk: C x (T0 + T) scores, the
carried keys (T0 + T) x K and one K x K product per chunk. Cost O(T^2 (K + K^2 / C)).
Training: the chunk loop runs in segments of ~sqrt(N) chunks under activation checkpointing (only each
segment's incoming carried keys are kept; a segment is recomputed in the backward), so the memory
autograd holds is O(T K sqrt(N) + T C sqrt(N)) rather than O(T^2 K / C); not linear (no hand-written
backward yet). The forward alone (no grad) is linear in T.
"""

from __future__ import annotations

import math

import torch
from torch.utils.checkpoint import checkpoint

from ..common.causal_softmax import causal_mask
from ..common.checks import compute_dtype
from ..common.chunking import chunk_local_cumsum, from_chunks, to_chunks
from ..common.kv_cache import KVCache
from ..common.triangular import solve_unit_lower
from .reference import _past


def _heads_first(x: torch.Tensor, C: int) -> torch.Tensor:
    """[B, T, H, ...] -> [B, H, N, C, ...] (zero-padded to a multiple of C)."""
    x = to_chunks(x, C)
    return x.permute(0, 3, 1, 2, *range(4, x.dim()))


def _segment(S: torch.Tensor, D: torch.Tensor, V_all: torch.Tensor, *chunks: torch.Tensor,
             scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A run of consecutive chunks against the carried keys S [B, H, P, K] and log decays D [B, H, P]:
    ``chunks`` holds 7 tensors per chunk (Q^, intra scores, P^T, K^, total and local log decay, V); returns
    their outputs [B, H, n, C, V] and the carried (S, D) after them."""
    outputs = []
    for i in range(0, len(chunks), 7):
        Qhat, intra, Pt, Khat, total, Gl, Vc = chunks[i:i + 7]
        P = S.shape[2]
        past = scale * Qhat @ S.transpose(-1, -2) + Gl[..., :, None] + D[..., None, :]
        p = torch.softmax(torch.cat([past, intra], dim=-1), dim=-1)
        outputs.append(p[..., :P] @ V_all[:, :, :P] + p[..., P:] @ Vc)
        S = torch.cat([S @ Pt, Khat], dim=2)
        D = torch.cat([D + total[..., None], total[..., None] - Gl], dim=2)
    return torch.stack(outputs, dim=2), S, D


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
    g = torch.zeros_like(beta) if g is None else g.to(dt)
    k0, v0, d0 = _past(initial_state, k, v.shape[-1], dt)
    B, T, H, K = q.shape
    T0, C = k0.shape[1], chunk_size
    Q, Kc, W, Vc = (_heads_first(x, C) for x in (q, k, w, v))  # [B, H, N, C, *]; padding: w = b = 0, H = I
    b = _heads_first(beta, C)[..., None]
    Gl = chunk_local_cumsum(g, C).permute(0, 3, 1, 2)  # [B, H, N, C]
    N = Q.shape[2]
    M, Ms = causal_mask(C, C, device=q.device), causal_mask(C, C, strict=True, device=q.device)
    tril = lambda x, m: x.masked_fill(~m, 0.0)
    tr = lambda x: x.transpose(-1, -2)

    # Everything that does not depend on earlier chunks, for all chunks at once.
    X = solve_unit_lower(b * (W @ tr(W)), b * torch.cat([W, tril(W @ tr(Kc), Ms)], dim=-1))
    Tw, Tk = X[..., :K], X[..., K:]
    QW = tril(Q @ tr(W), M)
    Qhat = Q - QW @ Tw
    intra = scale * (tril(Q @ tr(Kc), M) - QW @ Tk) + (Gl[..., :, None] - Gl[..., None, :])
    intra = intra.masked_fill(~M, float("-inf"))
    Pt = torch.eye(K, dtype=dt, device=q.device) - tr(Tw) @ W  # P^T = I - T_w^T W
    Khat = Kc - tr(Tk) @ W
    total = Gl[..., -1]  # [B, H, N] log decay across each chunk

    S, D = k0.transpose(1, 2), d0.transpose(1, 2)  # past keys in the current frame [B, H, P, K]; log decays
    V_all = torch.cat([v0.transpose(1, 2), from_chunks(Vc.permute(0, 2, 3, 1, 4), N * C).transpose(1, 2)], dim=2)
    per_chunk = (Qhat, intra, Pt, Khat, total, Gl, Vc)
    train = torch.is_grad_enabled() and any(x.requires_grad for x in (*per_chunk, S, D))
    # one unbind per tensor (its backward is one stack), not an indexing op per chunk (a full-size
    # zero tensor per chunk in the backward)
    chunks = [x for n_chunk in zip(*(x.unbind(2) for x in per_chunk)) for x in n_chunk]
    m = math.isqrt(N - 1) + 1 if train else N  # segments of ~sqrt(N) chunks, recomputed in the backward
    outputs = []
    for lo in range(0, N, m):
        args = (S, D, V_all, *chunks[7 * lo:7 * min(lo + m, N)])
        o_seg, S, D = checkpoint(_segment, *args, scale=scale, use_reentrant=False) if train else _segment(*args,
                                                                                                       scale=scale)
        outputs.append(o_seg)
    o = torch.cat(outputs, dim=2).permute(0, 2, 3, 1, 4)  # [B, N, C, H, V]
    o = from_chunks(o, T)
    state = None
    if output_final_state:
        end = T0 + T
        state = KVCache(S[:, :, :end].transpose(1, 2), V_all[:, :, :end].transpose(1, 2),
                        {"log_decay": D[:, :, :end].transpose(1, 2)})
    return o.to(in_dtype), state
