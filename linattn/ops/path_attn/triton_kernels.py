"""PaTH's attention across chunks as Triton kernels: the flash pass with queries moved back chunk by chunk and
split by split.

Inputs per batch*head (from the per-chunk UT transform, ``triton.py``), chunks of C positions: Q^_a (queries moved
to the start of chunk a), K^_j (keys moved to the end of chunk j), E_j = I - P_j (P_j the chunk's K x K Householder
product: the chain applies q - q E_j, so the identity part is exact and only the correction is rounded),
the intra-chunk logits A_a (scale and gate included, -inf above the diagonal), values, the cache (keys S0 in the
frame of chunk 0's start, values V0) and G (float64 cumulative log gates at every position, the cache's first).
For query block a and an earlier chunk j,

    logit_{a,j} = scale (Q_{a,j} K^_j^T + G_t - G_s),   Q_{a,a-1} = Q^_a,   Q_{a,j-1} = Q_{a,j} P_j,

and the cache is read with Q_{a,-1}. Chunks are grouped into splits of SPLIT (``splits.py``): for chunks of a's own
split the chain steps chunk by chunk as above; an earlier split J is crossed whole, its key blocks read as
K~_j (the keys moved on to J's end) against the query at J's end, then Q <- Q - Q E~_J: plain flash attention over
the split's key blocks and one product per split.

Forward (a program per one or two query chunks and batch*head): the block's own keys from A_a (and, for a second
chunk, its queries against the first chunk's keys, then moved across that chunk), the chunks of the first chunk's
split, the earlier splits, then the cache, in one online softmax, the query chain carried in registers; o and the
base-2 log-sum-exp are stored.

Backward chunk by chunk (splits: ``split_backward_kernels.py``, one split of query blocks at a time), a fixed
number of programs, each taking query blocks in turn, so that its scratch stays bounded: pass 1 walks down as the
forward, computing dS = P (dP - delta) per key block and adding dV += P^T dO, dK^ += scale dS^T Q and the gates'
column sums with atomic adds; it keeps dS and the chain's query Q_{a,j} of every key block in the program's scratch
(in the input dtype, in which the products read them); the cache ends it with W = scale dS_{a,-1} S0. Pass 2 walks
up the chain's adjoint: across chunk j, dE_j -= Q_{a,j}^T W and W <- W - W E_j^T + scale dS_{a,j} K^_j; finally
dQ^_a = W. Memory: the scratch is programs x N C (C + K) elements, linear in T; nothing of size T x T.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..common.triton_launch import fast_launch
from ..common.triton_masking import is_finite
from ..common.triton_utils import mm


@triton.jit
def _gate_bias(Grow, Gb, n, cols, L, scale2):
    """scale (G_t - G_s) in log2 units, from float64 G relative to the block's first key (see forgetting_attn)."""
    ref = tl.load(Gb + n)
    gc = tl.load(Gb + cols, mask=cols < L, other=ref)
    return ((Grow - ref).to(tl.float32) * scale2)[:, None] - ((gc - ref).to(tl.float32) * scale2)[None, :]


@triton.jit
def _fwd_step(qd, kj, vj, Grow, Gb, n, cols, L, scale2, m_i, l_i, acc, PREC: tl.constexpr, UP: tl.constexpr):
    """One key block of the online softmax (every key visible): the updated (m_i, l_i, acc)."""
    s = mm(qd, tl.trans(kj), PREC, UP) * scale2 + _gate_bias(Grow, Gb, n, cols, L, scale2)
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    return m_new, l_i * alpha + tl.sum(p, axis=1), acc * alpha[:, None] + mm(p.to(vj.dtype), vj, PREC, UP)


@triton.jit
def _chain_step(q_cur, Eb, o_k, m_k, K: tl.constexpr, PREC: tl.constexpr, UP: tl.constexpr):
    """Q <- Q - Q E (the query moved back through one product, E at Eb [K, K])."""
    Ej = tl.load(Eb + o_k[:, None] * K + o_k[None, :], mask=m_k[:, None] & m_k[None, :], other=0.0)
    return q_cur - mm(q_cur.to(Ej.dtype), Ej, PREC, UP)


@triton.jit
def _masked_step(s, vj, m_i, l_i, acc, bad, PREC: tl.constexpr, UP: tl.constexpr):
    """One key block of the online softmax where some keys are hidden (s = -inf; every row sees a key of the
    block or of an earlier one): a hidden value's probability is 0, but 0 x NaN = NaN, so the block reads the
    values' finite part and ``bad`` marks the rows that see a non-finite one (set to NaN at the end)."""
    v_ok = is_finite(vj)
    col_bad = tl.max(tl.where(v_ok, 0, 1), axis=1)
    bad = bad | (tl.max(tl.where(s > float("-inf"), col_bad[None, :], 0), axis=1) > 0)
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    acc = acc * alpha[:, None] + mm(p.to(vj.dtype), tl.where(v_ok, vj, 0.0).to(vj.dtype), PREC, UP)
    return m_new, l_i * alpha + tl.sum(p, axis=1), acc, bad


@fast_launch
@triton.jit(do_not_specialize=["N", "T0"])
def path_fwd_kernel(qh, intra, E, kh, ks, Es, v, s0, v0, G, o, lse, scale, N, T0, K: tl.constexpr,
                    V: tl.constexpr, C: tl.constexpr, ROWS: tl.constexpr, SPLIT: tl.constexpr, BN: tl.constexpr,
                    BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr, UP: tl.constexpr):
    """Grid (cdiv(N C, ROWS), B*H): the query rows of ROWS / C chunks (one or two) a0 .. per program. qh, kh, ks
    [B, H, N C, K]; intra [B, H, N, C, C]; E [B, H, N, K, K]; Es [B, H, NS, K, K]; v [B, H, N C, V];
    s0 [B, H, T0, K]; v0 [B, H, T0, V]; G [B, H, T0 + N C] float64; o [B, H, N C, V]; lse [B, H, N C] float32.

    With two chunks a0, a1 = a0 + 1, the block's own keys take two masked steps: chunk a0's rows read their
    intra-chunk logits there and a1's rows Q^_{a1} K^_{a0}^T, then a1's rows read theirs from chunk a1; a1's rows
    then cross a0 (Q <- Q - Q E_{a0}), and from there on both chunks' rows share the chain of a0."""
    i_m, i_bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    a0 = i_m * (ROWS // C)
    NC = N * C
    NS = (N + SPLIT - 1) // SPLIT
    L = T0 + NC
    o_r, o_c, o_k, o_v = tl.arange(0, ROWS), tl.arange(0, C), tl.arange(0, BK), tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    rows = a0 * C + o_r
    m_rows = rows < NC  # the second chunk may lie past the last
    scale2 = scale * 1.4426950408889634
    qb, kb, ksb, vb = qh + i_bh * NC * K, kh + i_bh * NC * K, ks + i_bh * NC * K, v + i_bh * NC * V
    Gb = G + i_bh * L
    Grow = tl.load(Gb + T0 + rows, mask=m_rows, other=0.0)
    q_cur = tl.load(qb + rows[:, None] * K + o_k[None, :], mask=m_rows[:, None] & m_k[None, :],
                    other=0.0).to(tl.float32)
    # each row's logits over its own chunk (scale and gate included, -inf above the diagonal)
    own = tl.load(intra + (i_bh * NC + rows)[:, None] * C + o_c[None, :], mask=m_rows[:, None],
                  other=0.0) * 1.4426950408889634
    cols = a0 * C + o_c
    va = tl.load(vb + cols[:, None] * V + o_v[None, :], mask=m_v[None, :], other=0.0)
    s = own
    if ROWS > C:
        kj = tl.load(kb + cols[:, None] * K + o_k[None, :], mask=m_k[None, :], other=0.0)
        cross = mm(q_cur.to(kj.dtype), tl.trans(kj), PREC, UP) * scale2 \
            + _gate_bias(Grow, Gb, T0 + a0 * C, T0 + cols, L, scale2)
        s = tl.where((o_r >= C)[:, None], cross, own)
    m_i = tl.full([ROWS], -1e30, dtype=tl.float32)
    l_i = tl.zeros([ROWS], dtype=tl.float32)
    acc = tl.zeros([ROWS, BV], dtype=tl.float32)
    bad = rows < 0
    m_i, l_i, acc, bad = _masked_step(s, va, m_i, l_i, acc, bad, PREC, UP)
    if ROWS > C:
        vb1 = tl.load(vb + (cols + C)[:, None] * V + o_v[None, :], mask=((cols + C) < NC)[:, None] & m_v[None, :],
                      other=0.0)
        m_i, l_i, acc, bad = _masked_step(tl.where((o_r >= C)[:, None], own, float("-inf")), vb1, m_i, l_i, acc,
                                          bad, PREC, UP)
        Eb = E + (i_bh * N + a0) * K * K
        Ea = tl.load(Eb + o_k[:, None] * K + o_k[None, :], mask=m_k[:, None] & m_k[None, :], other=0.0)
        q_cur = q_cur - tl.where((o_r >= C)[:, None], mm(q_cur.to(Ea.dtype), Ea, PREC, UP), 0.0)
    A = a0 // SPLIT
    for i in range(0, a0 - A * SPLIT):  # the earlier chunks of a0's split, one product each
        j = a0 - 1 - i
        cols = j * C + o_c
        kj = tl.load(kb + cols[:, None] * K + o_k[None, :], mask=m_k[None, :], other=0.0)
        vj = tl.load(vb + cols[:, None] * V + o_v[None, :], mask=m_v[None, :], other=0.0)
        m_i, l_i, acc = _fwd_step(q_cur.to(kj.dtype), kj, vj, Grow, Gb, T0 + j * C, T0 + cols, L, scale2, m_i, l_i,
                                  acc, PREC, UP)
        q_cur = _chain_step(q_cur, E + (i_bh * N + j) * K * K, o_k, m_k, K, PREC, UP)
    for i in range(0, A):  # earlier splits whole: their keys at the split's end, one product per split
        J = A - 1 - i
        qd = q_cur.to(ks.dtype.element_ty)
        for jj in range(0, SPLIT):
            cols = (J * SPLIT + jj) * C + o_c
            kj = tl.load(ksb + cols[:, None] * K + o_k[None, :], mask=m_k[None, :], other=0.0)
            vj = tl.load(vb + cols[:, None] * V + o_v[None, :], mask=m_v[None, :], other=0.0)
            m_i, l_i, acc = _fwd_step(qd, kj, vj, Grow, Gb, T0 + (J * SPLIT + jj) * C, T0 + cols, L, scale2, m_i,
                                      l_i, acc, PREC, UP)
        q_cur = _chain_step(q_cur, Es + (i_bh * NS + J) * K * K, o_k, m_k, K, PREC, UP)
    for n in range(0, T0, BN):
        ccols = n + tl.arange(0, BN)
        mc = ccols < T0
        sk = tl.load(s0 + (i_bh * T0 + ccols[:, None]) * K + o_k[None, :], mask=mc[:, None] & m_k[None, :], other=0.0)
        sv = tl.load(v0 + (i_bh * T0 + ccols[:, None]) * V + o_v[None, :], mask=mc[:, None] & m_v[None, :], other=0.0)
        sc = mm(q_cur.to(sk.dtype), tl.trans(sk), PREC, UP) * scale2 + _gate_bias(Grow, Gb, n, ccols, L, scale2)
        sc = tl.where(mc[None, :], sc, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, axis=1))
        pc = tl.exp2(sc - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(pc, axis=1)
        acc = acc * alpha[:, None] + mm(pc.to(sv.dtype), sv, PREC, UP)
        m_i = m_new
    out = tl.where(bad[:, None], float("nan"), acc / l_i[:, None])
    tl.store(o + (i_bh * NC + rows[:, None]) * V + o_v[None, :], out.to(o.dtype.element_ty),
             mask=m_rows[:, None] & m_v[None, :])
    tl.store(lse + i_bh * NC + rows, m_i + tl.log2(l_i), mask=m_rows)


@triton.jit
def _bwd_step(qd, kj, vj, do_a, lse_a, delta_a, Grow, Gb, n, cols, L, dvb, dkb, dGb, o_c, o_k, o_v, m_k, m_v,
              scale, scale2, K: tl.constexpr, V: tl.constexpr, PREC: tl.constexpr, UP: tl.constexpr):
    """One key block of pass 1 (every key visible): dV and dK of the block (at dvb, dkb: the block's first row)
    and the gates' column sums (at dGb) added atomically; returns dS = P (dP - delta) in float32."""
    s = mm(qd, tl.trans(kj), PREC, UP) * scale2 + _gate_bias(Grow, Gb, n, cols, L, scale2)
    p = tl.exp2(s - lse_a[:, None])
    ds = p * (mm(do_a, tl.trans(vj), PREC, UP) - delta_a[:, None])
    tl.atomic_add(dvb + o_c[:, None] * V + o_v[None, :], mm(tl.trans(p).to(do_a.dtype), do_a, PREC, UP),
                  mask=m_v[None, :], sem="relaxed")
    tl.atomic_add(dkb + o_c[:, None] * K + o_k[None, :], mm(tl.trans(ds).to(qd.dtype), qd, PREC, UP) * scale,
                  mask=m_k[None, :], sem="relaxed")
    tl.atomic_add(dGb + o_c, -tl.sum(ds, axis=0) * scale, sem="relaxed")
    return ds


@triton.jit
def _adjoint_step(W, Q, Eb, dEb, o_k, m_k, K: tl.constexpr, PREC: tl.constexpr, UP: tl.constexpr):
    """Up the chain's adjoint across one product Q_out = Q - Q E: dE -= Q^T W (atomic, at dEb) and the part of
    dQ that flows through the product, W - W E^T."""
    Ej = tl.load(Eb + o_k[:, None] * K + o_k[None, :], mask=m_k[:, None] & m_k[None, :], other=0.0)
    Wd = W.to(Ej.dtype)
    tl.atomic_add(dEb + o_k[:, None] * K + o_k[None, :], -mm(tl.trans(Q), Wd, PREC, UP),
                  mask=m_k[:, None] & m_k[None, :], sem="relaxed")
    return W - mm(Wd, tl.trans(Ej), PREC, UP)


@triton.jit
def _diagonal_bwd(intra_a, dintra_a, vb, dvb, rows, do_a, lse_a, delta_a, o_c, o_v, m_v, V: tl.constexpr,
                  C: tl.constexpr, PREC: tl.constexpr, UP: tl.constexpr):
    """The diagonal block of query block ``rows``: its logits are an input (dS stored at dintra_a), its values get
    P^T dO (atomically, at dvb: the batch*head's first row)."""
    s = tl.load(intra_a + o_c[:, None] * C + o_c[None, :]) * 1.4426950408889634
    p = tl.exp2(s - lse_a[:, None])
    va = tl.load(vb + rows[:, None] * V + o_v[None, :], mask=m_v[None, :], other=0.0)
    ds = p * (mm(do_a, tl.trans(va), PREC, UP) - delta_a[:, None])
    tl.store(dintra_a + o_c[:, None] * C + o_c[None, :], ds)
    tl.atomic_add(dvb + rows[:, None] * V + o_v[None, :], mm(tl.trans(p).to(do_a.dtype), do_a, PREC, UP),
                  mask=m_v[None, :], sem="relaxed")


@triton.jit
def _cache_bwd(qd, s0b, v0b, ds0b, dv0b, dGb, do_a, lse_a, delta_a, Grow, Gb, dgr, T0, L, o_k, o_v, m_k, m_v, scale,
               scale2, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
               PREC: tl.constexpr, UP: tl.constexpr):
    """The cache's keys (s0b, v0b: the batch*head's first row), read with qd = Q_{a,-1}: their gradients and the
    gates' column sums added atomically (at ds0b, dv0b, dGb); returns (the gradient of Q_{a,-1}, dgr with the
    rows' sums added)."""
    W = tl.zeros([C, BK], dtype=tl.float32)
    for n in range(0, T0, BN):
        ccols = n + tl.arange(0, BN)
        mc = ccols < T0
        sk = tl.load(s0b + ccols[:, None] * K + o_k[None, :], mask=mc[:, None] & m_k[None, :], other=0.0)
        sv = tl.load(v0b + ccols[:, None] * V + o_v[None, :], mask=mc[:, None] & m_v[None, :], other=0.0)
        sc = mm(qd, tl.trans(sk), PREC, UP) * scale2 + _gate_bias(Grow, Gb, n, ccols, L, scale2)
        pc = tl.where(mc[None, :], tl.exp2(sc - lse_a[:, None]), 0.0)
        dsc = pc * (mm(do_a, tl.trans(sv), PREC, UP) - delta_a[:, None])
        tl.atomic_add(dv0b + ccols[:, None] * V + o_v[None, :], mm(tl.trans(pc).to(do_a.dtype), do_a, PREC, UP),
                      mask=mc[:, None] & m_v[None, :], sem="relaxed")
        tl.atomic_add(ds0b + ccols[:, None] * K + o_k[None, :], mm(tl.trans(dsc).to(qd.dtype), qd, PREC, UP) * scale,
                      mask=mc[:, None] & m_k[None, :], sem="relaxed")
        W += mm(dsc.to(sk.dtype), sk, PREC, UP) * scale
        dgr += tl.sum(dsc, axis=1)
        tl.atomic_add(dGb + ccols, -tl.sum(dsc, axis=0) * scale, mask=mc, sem="relaxed")
    return W, dgr


@triton.jit
def _query_block(qh, intra, v, do, lse, delta, dintra, dv, Gb, i_bh, a, N, NC, T0, o_c, o_k, o_v, m_k, m_v,
                 K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, PREC: tl.constexpr, UP: tl.constexpr):
    """Query block a of batch*head i_bh for the backward pass, its diagonal block done (``_diagonal_bwd``):
    (Q^ in float32, dO, the base-2 log-sum-exp, delta, G at the rows)."""
    rows = a * C + o_c
    q = tl.load(qh + (i_bh * NC + rows[:, None]) * K + o_k[None, :], mask=m_k[None, :], other=0.0).to(tl.float32)
    do_a = tl.load(do + (i_bh * NC + rows[:, None]) * V + o_v[None, :], mask=m_v[None, :], other=0.0)
    lse_a, delta_a = tl.load(lse + i_bh * NC + rows), tl.load(delta + i_bh * NC + rows)
    _diagonal_bwd(intra + (i_bh * N + a) * C * C, dintra + (i_bh * N + a) * C * C, v + i_bh * NC * V,
                  dv + i_bh * NC * V, rows, do_a, lse_a, delta_a, o_c, o_v, m_v, V, C, PREC, UP)
    return q, do_a, lse_a, delta_a, tl.load(Gb + T0 + rows)


@triton.jit
def _chunks_down(q_cur, a, lo, qs, ss, Eb, kb, vb, dkb, dvb, dGb, Gb, do_a, lse_a, delta_a, Grow, T0, L, o_c, o_k,
                 o_v, m_k, m_v, scale, scale2, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr,
                 PREC: tl.constexpr, UP: tl.constexpr):
    """Pass 1 across the chunks j = a - 1 down to lo, one product each (the batch*head's E at Eb, its keys, values
    and their gradients at kb, vb, dkb, dvb, dGb): chunk j's query Q_{a,j} and dS stored in the scratch at slot
    j - lo (qs, ss), dV, dK^ and the gates' column sums added atomically. Returns (Q_{a,lo-1}, the rows' dS sums)."""
    dgr = tl.zeros([C], dtype=tl.float32)
    for i in range(0, a - lo):
        j = a - 1 - i
        cols = j * C + o_c
        kj = tl.load(kb + cols[:, None] * K + o_k[None, :], mask=m_k[None, :], other=0.0)
        vj = tl.load(vb + cols[:, None] * V + o_v[None, :], mask=m_v[None, :], other=0.0)
        qd = q_cur.to(kj.dtype)
        tl.store(qs + ((j - lo) * C + o_c[:, None]) * BK + o_k[None, :], qd)
        ds = _bwd_step(qd, kj, vj, do_a, lse_a, delta_a, Grow, Gb, T0 + j * C, T0 + cols, L, dvb + j * C * V,
                       dkb + j * C * K, dGb + T0 + j * C, o_c, o_k, o_v, m_k, m_v, scale, scale2, K, V, PREC, UP)
        tl.store(ss + ((j - lo) * C + o_c[:, None]) * C + o_c[None, :], ds.to(ss.dtype.element_ty))
        dgr += tl.sum(ds, axis=1)
        q_cur = _chain_step(q_cur, Eb + j * K * K, o_k, m_k, K, PREC, UP)
    return q_cur, dgr


@triton.jit
def _chunks_up(W, a, lo, qs, ss, Eb, dEb, kb, o_c, o_k, m_k, scale, K: tl.constexpr, C: tl.constexpr,
               BK: tl.constexpr, PREC: tl.constexpr, UP: tl.constexpr):
    """Pass 2 across the chunks j = lo up to a - 1 (what ``_chunks_down`` stored): dE_j -= Q_{a,j}^T W (atomic)
    and W <- W - W E_j^T + scale dS_{a,j} K^_j. Returns W."""
    for j in range(lo, a):
        Qj = tl.load(qs + ((j - lo) * C + o_c[:, None]) * BK + o_k[None, :])
        W = _adjoint_step(W, Qj, Eb + j * K * K, dEb + j * K * K, o_k, m_k, K, PREC, UP)
        dsj = tl.load(ss + ((j - lo) * C + o_c[:, None]) * C + o_c[None, :])
        kj = tl.load(kb + (j * C + o_c[:, None]) * K + o_k[None, :], mask=m_k[None, :], other=0.0)
        W += mm(dsj, kj, PREC, UP) * scale
    return W


@fast_launch
@triton.jit(do_not_specialize=["N", "T0", "BH", "NPROG"])
def path_bwd_kernel(qh, intra, E, kh, v, s0, v0, G, do, lse, delta, dqh, dintra, dE, dkh, dv, ds0, dv0, dG, qscr, sscr,
                    scale, N, T0, BH, NPROG, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BN: tl.constexpr,
                    BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr, UP: tl.constexpr):
    """Chunk by chunk (splits: ``split_backward_kernels.py``). Grid (NPROG,): every (query block, batch*head) in
    turn. Gradients (float32, zero-initialised, added to atomically where query blocks share them): dqh, dkh
    [B, H, N C, K]; dintra [B, H, N, C, C]; dE [B, H, N, K, K]; dv [B, H, N C, V]; ds0, dv0 like s0, v0;
    dG [B, H, T0 + N C]. The program's scratch, in qh's dtype (as the products read them): qscr [NPROG, N, C, BK]
    (the chain's queries Q_{a,j}), sscr [NPROG, N, C, C] (dS of every key block)."""
    pid = tl.program_id(0)
    NC = N * C
    L = T0 + NC
    o_c, o_k, o_v = tl.arange(0, C), tl.arange(0, BK), tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    scale2 = scale * 1.4426950408889634
    qs = qscr + pid.to(tl.int64) * N * C * BK
    ss = sscr + pid.to(tl.int64) * N * C * C
    for w in range(pid, N * BH, NPROG):
        a = w % N
        i_bh = (w // N).to(tl.int64)
        rows = a * C + o_c
        kb, vb = kh + i_bh * NC * K, v + i_bh * NC * V
        Gb = G + i_bh * L
        q_cur, do_a, lse_a, delta_a, Grow = _query_block(qh, intra, v, do, lse, delta, dintra, dv, Gb, i_bh, a, N,
                                                         NC, T0, o_c, o_k, o_v, m_k, m_v, K, V, C, PREC, UP)
        # pass 1, down the chain
        q_cur, dgr = _chunks_down(q_cur, a, 0, qs, ss, E + i_bh * N * K * K, kb, vb, dkh + i_bh * NC * K,
                                  dv + i_bh * NC * V, dG + i_bh * L, Gb, do_a, lse_a, delta_a, Grow, T0, L, o_c, o_k,
                                  o_v, m_k, m_v, scale, scale2, K, V, C, BK, PREC, UP)
        # the gradient of Q_{a,-1}
        W, dgr = _cache_bwd(q_cur.to(qh.dtype.element_ty), s0 + i_bh * T0 * K, v0 + i_bh * T0 * V, ds0 + i_bh * T0 * K,
                            dv0 + i_bh * T0 * V, dG + i_bh * L, do_a, lse_a, delta_a, Grow, Gb, dgr, T0, L, o_k, o_v,
                            m_k, m_v, scale, scale2, K, V, C, BN, BK, PREC, UP)
        tl.atomic_add(dG + i_bh * L + T0 + rows, dgr * scale, sem="relaxed")
        tl.debug_barrier()  # pass 2 reads what other threads of this program stored in pass 1
        # pass 2, up the chain's adjoint
        W = _chunks_up(W, a, 0, qs, ss, E + i_bh * N * K * K, dE + i_bh * N * K * K, kb, o_c, o_k, m_k, scale, K, C,
                       BK, PREC, UP)
        tl.store(dqh + (i_bh * NC + rows[:, None]) * K + o_k[None, :], W, mask=m_k[None, :])
        tl.debug_barrier()  # the next query block overwrites the scratch
