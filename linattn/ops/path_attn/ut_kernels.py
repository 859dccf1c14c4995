"""PaTH's UT transform as Triton kernels: a program per chunk and batch*head, forward and backward.

Per chunk of C positions (W the Householder directions, b = beta, S / M the strictly / non-strictly lower
triangle; see ``chunk.py``):

    Ti = (I + b tril(W W^T, -1))^-1,   Tw = Ti (b W),   Tk = Ti (b tril(W K^T, -1))
    QW = tril(Q W^T),   Q^ = Q - QW Tw,   K^ = K - Tk^T W
    intra = scale (tril(Q K^T) - QW Tk + Gl_t - Gl_s)   (-inf above the diagonal; Gl the chunk-local sum of g)

The forward stores Q^, K^, Tw, intra and W by chunks; the chunk's K x K product term E = W^T Tw is left to the
caller (a batched matrix product: a [K, K] tile here would not fit in a program's registers and shared memory). The
backward recomputes Ti, Tw, Tk and QW from the inputs and takes the adjoint of each line in reverse order: with
dI = scale dintra (lower triangle) and dTw_in = W dE, dW_in = Tw dE^T the gradients reaching Tw and W through E,

    dQ  = dQ^ + dI K + dQW W,               dQW = -(dQ^ Tw^T + dI Tk^T) masked to M
    dTw = dTw_in - QW^T dQ^,                dTk = -QW^T dI - W dK^^T
    dRw = Ti^T dTw,  dRk = Ti^T dTk,        dA  = -(dRw Tw^T + dRk Tk^T) masked to S
    dW  = dW_in + dQW^T Q - Tk dK^ + b dRw + dWK K + dWW W + dWW^T W,
    dK  = dK^ + dI^T Q + dWK^T W,           dWK = b dRk masked to S,  dWW = b dA masked to S
    db  = rowsum(dRw W + dRk WK + dA WW),   dg_t = sum_{t' >= t in the chunk} (rowsum - colsum of dI)_t'

where Rw = b W, Rk = b tril(W K^T, -1), A = b tril(W W^T, -1), Tw = Ti Rw, Tk = Ti Rk (the solve's adjoint:
dR = Ti^T dT, dA = -dR T^T). Inputs are read in their [B, T, H, *] layout and computed on in float32.

Every [C, K] quantity is handled BJ columns at a time (a [C, K] float32 tile per operand would not fit a program's
registers and shared memory): a first sweep over the columns sums the [C, C] products (W W^T, W K^T, Q W^T, ...),
a second produces the outputs' columns from them (Tw's columns are Ti (b W)'s, recomputed where needed).

A non-finite input at position t of a chunk reaches its rows >= t only: the forward zeroes the rows from the first
non-finite one on (every row < t depends on earlier rows alone: Ti is lower triangular), computes, and writes NaN
to those rows of Q^ and intra (its lower triangle), and to all of K^ and Tw (which only later chunks read).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..common.triton_launch import fast_launch
from ..common.triton_masking import is_finite, nonfinite_rows
from ..common.triton_tril import unit_lower_inverse
from ..common.triton_utils import mm


@triton.jit
def _cols(x, i_b, i_h, rows, j0, T, H: tl.constexpr, K: tl.constexpr, BJ: tl.constexpr):
    """Columns j0 .. j0 + BJ of rows ``rows`` of head i_h of x [B, T, H, K], float32 [len(rows), BJ] (0 past T, K)."""
    o_j = j0 + tl.arange(0, BJ)
    ptr = x + ((i_b * T + rows[:, None]) * H + i_h) * K + o_j[None, :]
    return tl.load(ptr, mask=(rows[:, None] < T) & (o_j[None, :] < K), other=0.0).to(tl.float32)


@triton.jit
def _chunk_cols(x, i_bh, rows, j0, NC, K: tl.constexpr, BJ: tl.constexpr):
    """Columns j0 .. j0 + BJ of rows ``rows`` of batch*head i_bh of x [B, H, NC, K], float32 (0 past K)."""
    o_j = j0 + tl.arange(0, BJ)
    ptr = x + (i_bh * NC + rows[:, None]) * K + o_j[None, :]
    return tl.load(ptr, mask=o_j[None, :] < K, other=0.0).to(tl.float32)


@triton.jit
def _scalars(x, i_b, i_h, rows, T, H: tl.constexpr):
    """Rows ``rows`` of head i_h of x [B, T, H] in float32 (0 past T)."""
    return tl.load(x + (i_b * T + rows) * H + i_h, mask=rows < T, other=0.0).to(tl.float32)


@triton.jit
def _program(H: tl.constexpr, C: tl.constexpr):
    """This program's chunk n and batch*head (batch i_b, head i_h), the chunk's positions o_c and rows (its token
    indices), and the masks M (lower) and S (strict) of the [C, C] tiles."""
    n, i_bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    o_c = tl.arange(0, C)
    return n, i_bh, i_bh // H, i_bh % H, o_c, n * C + o_c, o_c[:, None] >= o_c[None, :], o_c[:, None] > o_c[None, :]


@triton.jit
def _solve(WW, WK, b, C: tl.constexpr, PREC: tl.constexpr):
    """(Ti, Tk) from W W^T and W K^T (both masked to S)."""
    Ti = unit_lower_inverse(b[:, None] * WW, C, PREC)
    return Ti, mm(Ti, b[:, None] * WK, PREC, False)


@fast_launch
@triton.jit(do_not_specialize=["T", "N"])
def ut_fwd_kernel(q, k, w, beta, g, qh, kh, intra, tw, wc, scale, T, N, H: tl.constexpr, K: tl.constexpr,
                  C: tl.constexpr, BJ: tl.constexpr, PREC: tl.constexpr):
    """Grid (N, B*H). q, k, w [B, T, H, K]; beta, g [B, T, H]; qh, kh, tw, wc [B, H, N C, K]; intra [B, H, N, C, C]
    float32. wc: w by chunks, heads first (0 past T), for E's product and the backward."""
    n, i_bh, i_b, i_h, o_c, rows, lower, strict = _program(H, C)
    b = _scalars(beta, i_b, i_h, rows, T, H)
    gg = _scalars(g, i_b, i_h, rows, T, H)
    bad = tl.where(is_finite(b) & is_finite(gg), 0.0, 1.0)
    WW = tl.zeros([C, C], dtype=tl.float32)
    WK = tl.zeros([C, C], dtype=tl.float32)
    QW = tl.zeros([C, C], dtype=tl.float32)
    QK = tl.zeros([C, C], dtype=tl.float32)
    for j0 in range(0, K, BJ):
        Q = _cols(q, i_b, i_h, rows, j0, T, H, K, BJ)
        Kc = _cols(k, i_b, i_h, rows, j0, T, H, K, BJ)
        W = _cols(w, i_b, i_h, rows, j0, T, H, K, BJ)
        bad = tl.maximum(bad, tl.maximum(tl.maximum(nonfinite_rows(Q), nonfinite_rows(Kc)), nonfinite_rows(W)))
        WW += mm(W, tl.trans(W), PREC, False)
        WK += mm(W, tl.trans(Kc), PREC, False)
        QW += mm(Q, tl.trans(W), PREC, False)
        QK += mm(Q, tl.trans(Kc), PREC, False)
    # entry (i, j) of a product reads rows i and j alone: zeroing the rows and columns of the rows from the first
    # non-finite one on leaves the others exact
    seen = tl.cumsum(bad, axis=0) > 0
    any_bad = tl.max(bad, axis=0) > 0
    clean = ~(seen[:, None] | seen[None, :])
    b, gg = tl.where(seen, 0.0, b), tl.where(seen, 0.0, gg)
    WW = tl.where(clean & strict, WW, 0.0)
    WK = tl.where(clean & strict, WK, 0.0)
    QW = tl.where(clean & lower, QW, 0.0)
    Ti, Tk = _solve(WW, WK, b, C, PREC)
    Gl = tl.cumsum(gg, axis=0)
    s = tl.where(clean, QK, 0.0) - mm(QW, Tk, PREC, False) + (Gl[:, None] - Gl[None, :])
    s = tl.where(lower, s * scale, float("-inf"))
    s = tl.where(seen[:, None] & lower, float("nan"), s)
    tl.store(intra + (i_bh * N + n) * C * C + o_c[:, None] * C + o_c[None, :], s)

    for j0 in range(0, K, BJ):
        o_j = j0 + tl.arange(0, BJ)
        Q = tl.where(seen[:, None], 0.0, _cols(q, i_b, i_h, rows, j0, T, H, K, BJ))
        Kc = tl.where(seen[:, None], 0.0, _cols(k, i_b, i_h, rows, j0, T, H, K, BJ))
        W = tl.where(seen[:, None], 0.0, _cols(w, i_b, i_h, rows, j0, T, H, K, BJ))
        Tw = mm(Ti, b[:, None] * W, PREC, False)
        out = (i_bh * N * C + rows[:, None]) * K + o_j[None, :]
        m_j = o_j[None, :] < K
        Qh = tl.where(seen[:, None], float("nan"), Q - mm(QW, Tw, PREC, False))
        tl.store(qh + out, Qh.to(qh.dtype.element_ty), mask=m_j)
        Kh = tl.where(any_bad, float("nan"), Kc - mm(tl.trans(Tk), W, PREC, False))
        tl.store(kh + out, Kh.to(kh.dtype.element_ty), mask=m_j)
        tl.store(tw + out, tl.where(any_bad, float("nan"), Tw).to(tw.dtype.element_ty), mask=m_j)
        tl.store(wc + out, W.to(wc.dtype.element_ty), mask=m_j)


@fast_launch
@triton.jit(do_not_specialize=["T", "N"])
def ut_bwd_kernel(q, k, wc, beta, dqh, dkh, dintra, dtw, dwe, dq, dk, dw, dbeta, dg, scale, T, N, H: tl.constexpr,
                  K: tl.constexpr, C: tl.constexpr, BJ: tl.constexpr, PREC: tl.constexpr):
    """Grid (N, B*H). q, k [B, T, H, K], wc (the forward's) [B, H, N C, K], beta [B, T, H]; dqh, dkh, dtw,
    dwe [B, H, N C, K], dintra [B, H, N, C, C] (dtw, dwe: E's gradient through Tw and W); out: dq, dk, dw
    [B, T, H, K], dbeta, dg [B, T, H], each in its buffer's dtype."""
    n, i_bh, i_b, i_h, o_c, rows, lower, strict = _program(H, C)
    b = _scalars(beta, i_b, i_h, rows, T, H)
    WW = tl.zeros([C, C], dtype=tl.float32)
    WK = tl.zeros([C, C], dtype=tl.float32)
    QW = tl.zeros([C, C], dtype=tl.float32)
    for j0 in range(0, K, BJ):
        W = _chunk_cols(wc, i_bh, rows, j0, N * C, K, BJ)
        WW += mm(W, tl.trans(W), PREC, False)
        WK += mm(W, tl.trans(_cols(k, i_b, i_h, rows, j0, T, H, K, BJ)), PREC, False)
        QW += mm(_cols(q, i_b, i_h, rows, j0, T, H, K, BJ), tl.trans(W), PREC, False)
    WW = tl.where(strict, WW, 0.0)
    WK = tl.where(strict, WK, 0.0)
    QW = tl.where(lower, QW, 0.0)
    Ti, Tk = _solve(WW, WK, b, C, PREC)
    dI = tl.load(dintra + (i_bh * N + n) * C * C + o_c[:, None] * C + o_c[None, :]).to(tl.float32)
    dI = tl.where(lower, dI * scale, 0.0)
    dGl = tl.sum(dI, axis=1) - tl.sum(dI, axis=0)
    dgg = tl.sum(tl.where(o_c[:, None] <= o_c[None, :], dGl[None, :], 0.0), axis=1)  # suffix sums in the chunk
    tl.store(dg + (i_b * T + rows) * H + i_h, dgg.to(dg.dtype.element_ty), mask=rows < T)

    # the [C, C] sums over K: dQ^ Tw^T, W dK^^T, dRw Tw^T, and b's gradient through Rw
    dQhTw = tl.zeros([C, C], dtype=tl.float32)
    WdKh = tl.zeros([C, C], dtype=tl.float32)
    dRwTw = tl.zeros([C, C], dtype=tl.float32)
    db = tl.zeros([C], dtype=tl.float32)
    for j0 in range(0, K, BJ):
        o_j = j0 + tl.arange(0, BJ)
        own = (i_bh * N * C + rows[:, None]) * K + o_j[None, :]
        m_j = o_j[None, :] < K
        W = _chunk_cols(wc, i_bh, rows, j0, N * C, K, BJ)
        Tw = mm(Ti, b[:, None] * W, PREC, False)
        dQh = tl.load(dqh + own, mask=m_j, other=0.0).to(tl.float32)
        dKh = tl.load(dkh + own, mask=m_j, other=0.0).to(tl.float32)
        dTw = tl.load(dtw + own, mask=m_j, other=0.0).to(tl.float32) - mm(tl.trans(QW), dQh, PREC, False)
        dRw = mm(tl.trans(Ti), dTw, PREC, False)
        dQhTw += mm(dQh, tl.trans(Tw), PREC, False)
        WdKh += mm(W, tl.trans(dKh), PREC, False)
        dRwTw += mm(dRw, tl.trans(Tw), PREC, False)
        db += tl.sum(dRw * W, axis=1)
    dQW = tl.where(lower, -dQhTw - mm(dI, tl.trans(Tk), PREC, False), 0.0)
    dTk = -mm(tl.trans(QW), dI, PREC, False) - WdKh
    dRk = mm(tl.trans(Ti), dTk, PREC, False)
    dA = tl.where(strict, -dRwTw - mm(dRk, tl.trans(Tk), PREC, False), 0.0)
    db += tl.sum(dRk * WK, axis=1) + tl.sum(dA * WW, axis=1)
    tl.store(dbeta + (i_b * T + rows) * H + i_h, db.to(dbeta.dtype.element_ty), mask=rows < T)
    dWK = tl.where(strict, b[:, None] * dRk, 0.0)
    dWW = b[:, None] * dA
    dWW = dWW + tl.trans(dWW)

    for j0 in range(0, K, BJ):
        o_j = j0 + tl.arange(0, BJ)
        own = (i_bh * N * C + rows[:, None]) * K + o_j[None, :]
        m_j = o_j[None, :] < K
        W = _chunk_cols(wc, i_bh, rows, j0, N * C, K, BJ)
        Kc = _cols(k, i_b, i_h, rows, j0, T, H, K, BJ)
        Q = _cols(q, i_b, i_h, rows, j0, T, H, K, BJ)
        dQh = tl.load(dqh + own, mask=m_j, other=0.0).to(tl.float32)
        dKh = tl.load(dkh + own, mask=m_j, other=0.0).to(tl.float32)
        dTw = tl.load(dtw + own, mask=m_j, other=0.0).to(tl.float32) - mm(tl.trans(QW), dQh, PREC, False)
        dRw = mm(tl.trans(Ti), dTw, PREC, False)
        at = ((i_b * T + rows[:, None]) * H + i_h) * K + o_j[None, :]
        m_at = (rows[:, None] < T) & m_j
        dQ = dQh + mm(dI, Kc, PREC, False) + mm(dQW, W, PREC, False)
        tl.store(dq + at, dQ.to(dq.dtype.element_ty), mask=m_at)
        dK = dKh + mm(tl.trans(dI), Q, PREC, False) + mm(tl.trans(dWK), W, PREC, False)
        tl.store(dk + at, dK.to(dk.dtype.element_ty), mask=m_at)
        dW = mm(tl.trans(dQW), Q, PREC, False) - mm(Tk, dKh, PREC, False) + b[:, None] * dRw \
            + mm(dWK, Kc, PREC, False) + mm(dWW, W, PREC, False) \
            + tl.load(dwe + own, mask=m_j, other=0.0).to(tl.float32)
        tl.store(dw + at, dW.to(dw.dtype.element_ty), mask=m_at)
