"""path_attn's backward with splits (``splits.py``), one split of query blocks at a time, in Triton.

With splits, most (query block, key block) pairs of the backward pass meet across whole splits: key block j of an
earlier split J is read as K~_j against X_{a,J}, query block a moved to J's end. The chunk-by-chunk backward
(``triton_kernels.path_bwd_kernel``) walks each query block's chain and adds every pair's dK and dV atomically;
here the queries of one split A are first moved to every earlier split's end (X_{a,J}, kept: T x K values per
batch*head at most), so the pairs become plain flash-attention backward work:

- ``path_split_down_kernel`` (a program per query block of split A): the diagonal block, the earlier chunks of a's
  own split chunk by chunk (atomic adds, as chunk by chunk: at most SPLIT - 1 pairs), then the chain down across the
  earlier splits, storing X_{a,J}, and the cache read with X_{a,-1} (its part of dQ stored as W);
- ``path_split_keys_kernel`` (a program per key block j of the earlier splits): over the query blocks a of split A,
  dK~_j += scale dS^T X_{a,J}, dV_j += P^T dO_a and the gates' column sums, held in registers and added once (each
  key block has one program and the splits go one launch after another, so no two programs write the same rows);
- ``path_split_frames_kernel`` (a program per query block a of split A and earlier split J):
  dX_{a,J} = scale sum_{j in J} dS_{a,j} K~_j (dS recomputed) and the gates' row sums;
- ``path_split_up_kernel`` (a program per query block of split A): the adjoint up the chain. Across split J,
  dE~_J -= X_{a,J}^T W and W <- W - W E~_J^T + dX_{a,J}, then across a's own chunks as chunk by chunk; dQ^_a = W.

Scratch per (batch*head, query block of the split), reused by every split: X [NS, C, BK], the own split's chain
queries [SPLIT, C, BK] and dS [SPLIT, C, C] (in the input dtype, as the products read them), dX [NS, C, BK] and
W [C, BK] float32.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..common.triton_launch import fast_launch
from ..common.triton_utils import mm
from .triton_kernels import (
    _adjoint_step,
    _cache_bwd,
    _chain_step,
    _chunks_down,
    _chunks_up,
    _gate_bias,
    _query_block,
)


@fast_launch
@triton.jit(do_not_specialize=["N", "T0", "A"])
def path_split_down_kernel(qh, intra, E, kh, Es, v, s0, v0, G, do, lse, delta, dintra, dkh, dv, ds0, dv0, dG, qscr,
                           sscr, xq, wscr, scale, N, T0, A, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr,
                           SPLIT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                           PREC: tl.constexpr, UP: tl.constexpr):
    """Grid (SPLIT, B*H): query block a = A SPLIT + program 0 (none past the last chunk). Shapes as
    ``path_bwd_kernel``'s; the scratch of (batch*head, program 0): qscr [SPLIT, C, BK], sscr [SPLIT, C, C],
    xq [NS, C, BK] (X_{a,J} at J), wscr [C, BK] float32."""
    i, i_bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    a = A * SPLIT + i
    if a < N:
        NC = N * C
        NS = (N + SPLIT - 1) // SPLIT
        L = T0 + NC
        a0 = A * SPLIT
        slot = i_bh * SPLIT + i
        qs, ss = qscr + slot * SPLIT * C * BK, sscr + slot * SPLIT * C * C
        xqs, ws = xq + slot * NS * C * BK, wscr + slot * C * BK
        o_c, o_k, o_v = tl.arange(0, C), tl.arange(0, BK), tl.arange(0, BV)
        m_k, m_v = o_k < K, o_v < V
        scale2 = scale * 1.4426950408889634
        rows = a * C + o_c
        kb, vb = kh + i_bh * NC * K, v + i_bh * NC * V
        Gb = G + i_bh * L
        q_cur, do_a, lse_a, delta_a, Grow = _query_block(qh, intra, v, do, lse, delta, dintra, dv, Gb, i_bh, a, N,
                                                         NC, T0, o_c, o_k, o_v, m_k, m_v, K, V, C, PREC, UP)
        # a's own split, chunk by chunk
        q_cur, dgr = _chunks_down(q_cur, a, a0, qs, ss, E + i_bh * N * K * K, kb, vb, dkh + i_bh * NC * K,
                                  dv + i_bh * NC * V, dG + i_bh * L, Gb, do_a, lse_a, delta_a, Grow, T0, L, o_c, o_k,
                                  o_v, m_k, m_v, scale, scale2, K, V, C, BK, PREC, UP)
        for ii in range(0, A):  # down across the earlier splits: X_{a,J}
            J = A - 1 - ii
            tl.store(xqs + (J * C + o_c[:, None]) * BK + o_k[None, :], q_cur.to(xq.dtype.element_ty))
            q_cur = _chain_step(q_cur, Es + (i_bh * NS + J) * K * K, o_k, m_k, K, PREC, UP)
        W, dgr = _cache_bwd(q_cur.to(qh.dtype.element_ty), s0 + i_bh * T0 * K, v0 + i_bh * T0 * V,
                            ds0 + i_bh * T0 * K, dv0 + i_bh * T0 * V, dG + i_bh * L, do_a, lse_a, delta_a, Grow, Gb,
                            dgr, T0, L, o_k, o_v, m_k, m_v, scale, scale2, K, V, C, BN, BK, PREC, UP)
        tl.store(ws + o_c[:, None] * BK + o_k[None, :], W)
        tl.atomic_add(dG + i_bh * L + T0 + rows, dgr * scale, sem="relaxed")


@triton.jit
def _split_pair(X, kj, vj, do_a, lse_a, delta_a, Grow, Gb, n, cols, L, scale2, PREC: tl.constexpr,
                UP: tl.constexpr):
    """(P, dS = P (dP - delta)) of query block X against a key block of an earlier split, in float32."""
    s = mm(X, tl.trans(kj), PREC, UP) * scale2 + _gate_bias(Grow, Gb, n, cols, L, scale2)
    p = tl.exp2(s - lse_a[:, None])
    return p, p * (mm(do_a, tl.trans(vj), PREC, UP) - delta_a[:, None])


@fast_launch
@triton.jit(do_not_specialize=["N", "T0", "A"])
def path_split_keys_kernel(ks, v, G, do, lse, delta, dks, dv, dG, xq, scale, N, T0, A, K: tl.constexpr,
                           V: tl.constexpr, C: tl.constexpr, SPLIT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                           PREC: tl.constexpr, UP: tl.constexpr):
    """Grid (A SPLIT, B*H), after ``path_split_down_kernel`` of split A: key block j = program 0 of the earlier
    splits, against every query block of split A; dks, dv and dG's columns there read, added to and stored (one
    program per key block, one launch per split)."""
    j, i_bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    NC = N * C
    NS = (N + SPLIT - 1) // SPLIT
    L = T0 + NC
    a0 = A * SPLIT
    J = j // SPLIT
    o_c, o_k, o_v = tl.arange(0, C), tl.arange(0, BK), tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    scale2 = scale * 1.4426950408889634
    Gb = G + i_bh * L
    cols = j * C + o_c
    kj = tl.load(ks + (i_bh * NC + cols[:, None]) * K + o_k[None, :], mask=m_k[None, :], other=0.0)
    vj = tl.load(v + (i_bh * NC + cols[:, None]) * V + o_v[None, :], mask=m_v[None, :], other=0.0)
    dk = tl.zeros([C, BK], dtype=tl.float32)
    dvj = tl.zeros([C, BV], dtype=tl.float32)
    dgc = tl.zeros([C], dtype=tl.float32)
    for i in range(0, tl.minimum(SPLIT, N - a0)):
        rows = (a0 + i) * C + o_c
        X = tl.load(xq + (((i_bh * SPLIT + i) * NS + J) * C + o_c[:, None]) * BK + o_k[None, :])
        do_a = tl.load(do + (i_bh * NC + rows[:, None]) * V + o_v[None, :], mask=m_v[None, :], other=0.0)
        lse_a = tl.load(lse + i_bh * NC + rows)
        delta_a = tl.load(delta + i_bh * NC + rows)
        p, ds = _split_pair(X, kj, vj, do_a, lse_a, delta_a, tl.load(Gb + T0 + rows), Gb, T0 + j * C, T0 + cols, L,
                            scale2, PREC, UP)
        dvj += mm(tl.trans(p).to(do_a.dtype), do_a, PREC, UP)
        dk += mm(tl.trans(ds).to(X.dtype), X, PREC, UP)
        dgc -= tl.sum(ds, axis=0)
    pk = dks + (i_bh * NC + cols[:, None]) * K + o_k[None, :]
    tl.store(pk, tl.load(pk, mask=m_k[None, :], other=0.0) + dk * scale, mask=m_k[None, :])
    pv = dv + (i_bh * NC + cols[:, None]) * V + o_v[None, :]
    tl.store(pv, tl.load(pv, mask=m_v[None, :], other=0.0) + dvj, mask=m_v[None, :])
    pg = dG + i_bh * L + T0 + cols
    tl.store(pg, tl.load(pg) + dgc * scale)


@fast_launch
@triton.jit(do_not_specialize=["N", "T0", "A"])
def path_split_frames_kernel(ks, v, G, do, lse, delta, dG, xq, dxq, scale, N, T0, A, K: tl.constexpr,
                             V: tl.constexpr, C: tl.constexpr, SPLIT: tl.constexpr, BK: tl.constexpr,
                             BV: tl.constexpr, PREC: tl.constexpr, UP: tl.constexpr):
    """Grid (SPLIT A, B*H), after ``path_split_down_kernel`` of split A: query block a = A SPLIT + program 0 // A of
    split A against the key blocks of earlier split J = program 0 % A: dX_{a,J} = scale sum_{j in J} dS_{a,j} K~_j
    stored (dxq [B H SPLIT, NS, C, BK] float32, as xq), the gates' row sums added atomically."""
    pid, i_bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    i = pid // A
    J = pid % A
    a = A * SPLIT + i
    if a < N:
        NC = N * C
        NS = (N + SPLIT - 1) // SPLIT
        L = T0 + NC
        o_c, o_k, o_v = tl.arange(0, C), tl.arange(0, BK), tl.arange(0, BV)
        m_k, m_v = o_k < K, o_v < V
        scale2 = scale * 1.4426950408889634
        Gb = G + i_bh * L
        rows = a * C + o_c
        frame = ((i_bh * SPLIT + i) * NS + J) * C * BK
        X = tl.load(xq + frame + o_c[:, None] * BK + o_k[None, :])
        do_a = tl.load(do + (i_bh * NC + rows[:, None]) * V + o_v[None, :], mask=m_v[None, :], other=0.0)
        lse_a = tl.load(lse + i_bh * NC + rows)
        delta_a = tl.load(delta + i_bh * NC + rows)
        Grow = tl.load(Gb + T0 + rows)
        dX = tl.zeros([C, BK], dtype=tl.float32)
        dgr = tl.zeros([C], dtype=tl.float32)
        for jj in range(0, SPLIT):
            j = J * SPLIT + jj
            cols = j * C + o_c
            kj = tl.load(ks + (i_bh * NC + cols[:, None]) * K + o_k[None, :], mask=m_k[None, :], other=0.0)
            vj = tl.load(v + (i_bh * NC + cols[:, None]) * V + o_v[None, :], mask=m_v[None, :], other=0.0)
            p, ds = _split_pair(X, kj, vj, do_a, lse_a, delta_a, Grow, Gb, T0 + j * C, T0 + cols, L, scale2, PREC,
                                UP)
            dX += mm(ds.to(kj.dtype), kj, PREC, UP)
            dgr += tl.sum(ds, axis=1)
        tl.store(dxq + frame + o_c[:, None] * BK + o_k[None, :], dX * scale)
        tl.atomic_add(dG + i_bh * L + T0 + rows, dgr * scale, sem="relaxed")


@fast_launch
@triton.jit(do_not_specialize=["N", "A"])
def path_split_up_kernel(kh, E, Es, dqh, dE, dEs, qscr, sscr, xq, dxq, wscr, scale, N, A, K: tl.constexpr,
                         C: tl.constexpr, SPLIT: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr,
                         UP: tl.constexpr):
    """Grid (SPLIT, B*H), after the keys' and frames' kernels of split A: query block a = A SPLIT + program 0 up the
    chain's adjoint, from the cache's W across the earlier splits (adding dX_{a,J}) and a's own chunks; dqh stored,
    dE and dEs added atomically."""
    i, i_bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    a0 = A * SPLIT
    a = a0 + i
    if a < N:
        NC = N * C
        NS = (N + SPLIT - 1) // SPLIT
        o_c, o_k = tl.arange(0, C), tl.arange(0, BK)
        m_k = o_k < K
        slot = i_bh * SPLIT + i
        qs, ss = qscr + slot * SPLIT * C * BK, sscr + slot * SPLIT * C * C
        frames = slot * NS * C * BK + o_c[:, None] * BK + o_k[None, :]
        W = tl.load(wscr + slot * C * BK + o_c[:, None] * BK + o_k[None, :])
        for J in range(0, A):
            X = tl.load(xq + frames + J * C * BK)
            W = _adjoint_step(W, X, Es + (i_bh * NS + J) * K * K, dEs + (i_bh * NS + J) * K * K, o_k, m_k, K, PREC,
                              UP)
            W += tl.load(dxq + frames + J * C * BK)
        # a's own split, chunk by chunk
        W = _chunks_up(W, a, a0, qs, ss, E + i_bh * N * K * K, dE + i_bh * N * K * K, kh + i_bh * NC * K, o_c, o_k,
                       m_k, scale, K, C, BK, PREC, UP)
        tl.store(dqh + (i_bh * NC + a * C + o_c[:, None]) * K + o_k[None, :], W, mask=m_k[None, :])
