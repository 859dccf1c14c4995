"""Triton kernels (forward and backward) for the gated delta rule (and, with no gate, the delta rule),
in its generalisation with a separate read key p (Comba; p = k is the gated delta rule).

    S_t = exp(g_t) (I - b_t k_t p_t^T) S_{t-1} + b_t k_t v_t^T,        o_t = S_t^T (scale q_t)

Chunkwise in the WY / UT form. Per head, a chunk of C tokens entered with state S (b_t: log gate
summed from the chunk start to t, so every exponent below is <= 0; gamma_t = e^{b_t};
D_ts = e^{b_t - b_s} for s <= t; beta_t the step size; R the read keys p_t, R = K without p):

    A_ts = beta_t (p_t . k_s) D_ts  (s < t),   Tm = (I + A)^-1          (unit lower triangular)
    W = Tm diag(beta gamma) R,   U = Tm diag(beta) V                      (no dependence on S)
    delta = U - W S                                                       ("new values", [C, V])
    o = diag(gamma) (scale Q) S + P delta,   P = scale Q K^T ⊙ D ⊙ M     (M: causal, diagonal included)
    S' = gamma_C S + Khat^T delta,           Khat = diag(e^{b_C - b_s}) K

Backward, with dS' the gradient of the state leaving the chunk and do that of the outputs:

    ddelta = P^T do + Khat dS'
    dS     = scale (diag(gamma) Q)^T do + gamma_C dS' - W^T ddelta       (reverse scan over chunks)
    dU = ddelta,  dW = -ddelta S^T,  dTm = dU (diag(beta) V)^T + dW (diag(beta gamma) R)^T,
    dA = -(Tm^T dTm Tm^T) on the strict lower triangle,
    dR = diag(beta gamma) Tm^T dW + diag(beta) (dA ⊙ D) K   (the read keys enter W and A only),
    and A, W, U, P, Khat, gamma give dq, dk, dv, dbeta and db_t; dg is the reverse cumulative sum of
    db within each chunk (b_t = sum of g from the chunk start to t).

The read key is a compile-time flag (HAS_P): without p the kernels read k in its place, so the gated
delta rule's code is unchanged and does no extra loads; its dR is added to dk.

Kernels: "prepare" (a program per chunk and batch-head: A, Tm by common/triton_tril.py, W, U), the
state scan (a program per value block and batch-head, looping over chunks: stores the state entering
each chunk and delta), the output (simple_gla's output kernel with v = delta), the local value
gradient P^T do, the reverse scan of state gradients (stores dS' per chunk and ddelta), and the
per-chunk input gradients in two kernels (through o and S', a program per key block; then through W,
U and Tm, looping over key blocks; only "prepare" and this kernel read p). When a backward pass can follow, the
forward's "prepare" also stores Tm ([B, T, H, C], input dtype), which the backward's "prepare" (W and U only)
and the WY-gradient kernel read back, so neither forms A or inverts it; the states are recomputed, not kept.
Packed sequences (B = 1, cu_seqlens) are read where they lie: every kernel takes each chunk's first token and token
count from the layout's chunk rows (common/triton_chunk_output.py's chunk_span; a chunk never spans two sequences,
and the rows past its count, another sequence's, are masked), and the scans run each sequence's own chunks; nothing
is copied into a padded layout or back. The kernels' intermediates (W, U, Tm, delta) lie at the packed tokens too.
Block shapes depend on the head dims and the chunk size only, never on T (T is not specialised on).
Prepare, the scans and the output hold the whole key dimension in one block (K <= 128 intended).
Pointers are an int64 scalar base per chunk plus int32 tile offsets (64-bit offsets per element cost
a register pair each; see docs/triton.md for the register budget).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..common.checks import DELTA_TRITON_CHUNK_SIZES
from ..common.packed_call import chunk_layout, current_packing
from ..common.registered_ops import define_op
from ..common.side_stream import beside
from ..common.triton_chunk_output import (
    chunk_count,
    chunk_output_kernel,
    chunk_span,
    chunk_state_dtype,
    scan_chunk,
    scan_tokens,
)
from ..common.triton_launch import fast_launch
from ..common.triton_masking import causal_dot_rest, is_finite
from ..common.triton_ops import eager_backward, needs_backward, op_function
from ..common.triton_tril import unit_lower_inverse
from ..common.triton_utils import block as _block
from ..common.triton_utils import (
    block_and_index,
    cdiv,
    dot_precision,
    grid_slices,
    launch_options,
    launch_overrides,
    mm,
    upcast_dots,
)


@triton.jit
def _chunk_gate(g, row, m_t, o_c, C: tl.constexpr, USE_G: tl.constexpr):
    """(b, b_C): the log gate summed from the chunk start to each token, and to the chunk's end."""
    if USE_G:
        b = tl.cumsum(tl.load(g + row, mask=m_t, other=0.0).to(tl.float32), axis=0)
    else:
        b = tl.zeros([C], dtype=tl.float32)
    return b, tl.sum(tl.where(o_c == C - 1, b, 0.0), axis=0)


@triton.jit
def _decay(b, o_c, STRICT: tl.constexpr):
    """D_ts = e^{b_t - b_s} on the causal (STRICT: strictly lower) triangle, 0 above it."""
    if STRICT:
        keep = o_c[:, None] > o_c[None, :]
    else:
        keep = o_c[:, None] >= o_c[None, :]
    return tl.where(keep, tl.exp(tl.where(keep, b[:, None] - b[None, :], 0.0)), 0.0)


@triton.jit
def _read_key(p, kc, offs, mask, HAS_P: tl.constexpr):
    """The read keys of a tile: loaded from p, or the keys kc themselves (gated delta rule)."""
    if HAS_P:
        return tl.load(p + offs, mask=mask, other=0.0)
    else:
        return kc


@fast_launch
@triton.jit(do_not_specialize=["T"])
def _prepare_kernel(k, p, v, beta, g, tm, w, u, rows, T, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                    C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, USE_G: tl.constexpr, HAS_P: tl.constexpr,
                    TM_MODE: tl.constexpr, PREC: tl.constexpr, UP: tl.constexpr, PACKED: tl.constexpr):
    """Grid (N, B*H): Tm = (I + A)^-1, W = Tm diag(beta gamma) R, U = Tm diag(beta) V of one chunk.
    TM_MODE 0: Tm computed; 1: computed and stored to tm [B, T, H, C]; 2: loaded from tm (no A, no inverse)."""
    n, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    o_k, o_c = tl.arange(0, BK), tl.arange(0, C)
    first, count = chunk_span(rows, n, i_b, T, C, PACKED)
    m_t = o_c < count
    r0 = first * H + i_h  # row of the chunk's first token
    row = o_c * H
    m_ck = m_t[:, None] & (o_k[None, :] < K)
    b, b_last = _chunk_gate(g + r0, row, m_t, o_c, C, USE_G)
    bet = tl.load(beta + r0 + row, mask=m_t, other=0.0).to(tl.float32)
    kc = tl.load(k + r0 * K + row[:, None] * K + o_k[None, :], mask=m_ck, other=0.0)
    pc = _read_key(p, kc, r0 * K + row[:, None] * K + o_k[None, :], m_ck, HAS_P)
    # rows from the first token with a non-finite k, p, beta or gate (NaN, +inf) on see it; the products below
    # read only rows before it and the rows from it on are NaN (triton_masking.py), so no earlier row sees it
    bad = (tl.sum(tl.where(is_finite(kc) & is_finite(pc), 0, 1), axis=1) > 0) | ~is_finite(bet)
    if USE_G:
        bad = bad | ~(tl.load(g + r0 + row, mask=m_t, other=0.0).to(tl.float32) < float("inf"))
    seen = tl.cumsum(bad.to(tl.int32), axis=0) > 0
    tc = r0 * C + row[:, None] * C + o_c[None, :]
    if TM_MODE == 2:
        Tq = tl.load(tm + tc, mask=m_t[:, None], other=0.0)
    else:
        A = mm(pc, tl.trans(kc), PREC, UP) * _decay(b, o_c, True) * bet[:, None]
        Tq = unit_lower_inverse(tl.where(seen[:, None], 0.0, A), C, PREC).to(kc.dtype)
        if TM_MODE == 1:
            tl.store(tm + tc, Tq.to(tm.dtype.element_ty), mask=m_t[:, None])
    kb = tl.where(seen[:, None], 0.0, pc.to(tl.float32) * (bet * tl.exp(b))[:, None]).to(kc.dtype)
    wc = tl.where(seen[:, None], float("nan"), mm(Tq, kb, PREC, UP))
    tl.store(w + r0 * K + row[:, None] * K + o_k[None, :], wc.to(w.dtype.element_ty), mask=m_ck)
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_cv = m_t[:, None] & (o_v[None, :] < V)
        vc = tl.load(v + r0 * V + row[:, None] * V + o_v[None, :], mask=m_cv, other=0.0)
        vb_fin, vb_rest = causal_dot_rest(tl.where(seen[:, None], 0.0, vc.to(tl.float32) * bet[:, None]))
        uc = tl.where(seen[:, None], float("nan"), mm(Tq, vb_fin.to(kc.dtype), PREC, UP) + vb_rest)
        tl.store(u + r0 * V + row[:, None] * V + o_v[None, :], uc.to(u.dtype.element_ty), mask=m_cv)


@fast_launch
@triton.jit(do_not_specialize=["T", "NC", "BASE"])
def _state_fwd_kernel(k, w, u, g, h, dlt, h0, ht, cu, rows, T, NC, BASE, H: tl.constexpr, K: tl.constexpr,
                      V: tl.constexpr,
                      C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, USE_G: tl.constexpr,
                      HAS_H0: tl.constexpr, PACKED: tl.constexpr, PREC: tl.constexpr, UP: tl.constexpr):
    """Grid (cdiv(V, BV), B*H; packed: S*H): h[b, h, n] = state entering chunk n (NC chunks a row), delta = U - W S;
    ht = final state. PACKED (packed sequences where they lie, chunk n's tokens from ``rows``: chunk_span): program
    s*H + h scans sequence s's chunks [cu[s], cu[s + 1]), from its initial state h0[s, h] to its final state
    ht[s, h]. BASE: added to the program index along axis 1 (launches cut at the grid's limit, grid_slices)."""
    i_v, i_bh = tl.program_id(0), tl.program_id(1) + BASE
    i_h = i_bh % H
    N = NC
    if PACKED:  # sequence i_bh // H: its chunks of the one batch row, its states at row i_h of h
        c0 = tl.load(cu + i_bh // H).to(tl.int64)
        c1 = tl.load(cu + i_bh // H + 1).to(tl.int64)
        i_b, i_hb = i_bh * 0, i_h
    else:
        c0, c1, i_b, i_hb = 0, N, i_bh // H, i_bh
    o_k, o_c = tl.arange(0, BK), tl.arange(0, C)
    o_v = i_v * BV + tl.arange(0, BV)
    kv = o_k[:, None] * V + o_v[None, :]
    m_kv = (o_k[:, None] < K) & (o_v[None, :] < V)
    S = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_H0:
        S += tl.load(h0 + i_bh.to(tl.int64) * K * V + kv, mask=m_kv, other=0.0).to(tl.float32)
    t_start, t_end = scan_tokens(rows, c0, c1, PACKED)  # the run's tokens, read once
    for n in range(c0, c1):
        tl.store(h + (i_hb.to(tl.int64) * N + n) * K * V + kv, S.to(h.dtype.element_ty), mask=m_kv)
        first, count = scan_chunk(rows, n, c0, t_start, t_end, i_b, T, C, PACKED)
        m_t = o_c < count
        r0 = first * H + i_h  # row of the chunk's first token
        row = o_c * H
        m_cv = m_t[:, None] & (o_v[None, :] < V)
        b, b_last = _chunk_gate(g + r0, row, m_t, o_c, C, USE_G)
        m_ck = m_t[:, None] & (o_k[None, :] < K)
        wc = tl.load(w + r0 * K + row[:, None] * K + o_k[None, :], mask=m_ck, other=0.0)
        uc = tl.load(u + r0 * V + row[:, None] * V + o_v[None, :], mask=m_cv, other=0.0)
        kt = tl.trans(tl.load(k + r0 * K + row[:, None] * K + o_k[None, :], mask=m_ck, other=0.0))
        d = uc.to(tl.float32) - mm(wc, S.to(wc.dtype), PREC, UP)
        tl.store(dlt + r0 * V + row[:, None] * V + o_v[None, :], d.to(dlt.dtype.element_ty), mask=m_cv)
        dw = (d * tl.exp(b_last - b)[:, None]).to(kt.dtype)
        S = S * tl.exp(b_last) + mm(kt, dw, PREC, UP)
    tl.store(ht + i_bh.to(tl.int64) * K * V + kv, S, mask=m_kv)


@fast_launch
@triton.jit(do_not_specialize=["T"])
def _dv_local_kernel(q, k, g, do, dd, rows, scale, T, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                     C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, USE_G: tl.constexpr,
                     PREC: tl.constexpr, UP: tl.constexpr, PACKED: tl.constexpr):
    """Grid (cdiv(V, BV) * N, B*H) (common/triton_utils.py's block_and_index): dd = P^T do, the in-chunk part of the
    gradient of delta."""
    i_v, n = block_and_index(tl.cdiv(V, BV))
    i_bh = tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    o_k, o_c = tl.arange(0, BK), tl.arange(0, C)
    o_v = i_v * BV + tl.arange(0, BV)
    first, count = chunk_span(rows, n, i_b, T, C, PACKED)
    m_t = o_c < count
    r0 = first * H + i_h  # row of the chunk's first token
    row = o_c * H
    m_ck = m_t[:, None] & (o_k[None, :] < K)
    m_cv = m_t[:, None] & (o_v[None, :] < V)
    b, b_last = _chunk_gate(g + r0, row, m_t, o_c, C, USE_G)
    qc = tl.load(q + r0 * K + row[:, None] * K + o_k[None, :], mask=m_ck, other=0.0)
    kc = tl.load(k + r0 * K + row[:, None] * K + o_k[None, :], mask=m_ck, other=0.0)
    doc = tl.load(do + r0 * V + row[:, None] * V + o_v[None, :], mask=m_cv, other=0.0)
    Pt = mm(kc, tl.trans(qc), PREC, UP) * tl.trans(_decay(b, o_c, False)) * scale  # P^T [s, t]
    tl.store(dd + r0 * V + row[:, None] * V + o_v[None, :], mm(Pt.to(doc.dtype), doc, PREC, UP).to(dd.dtype.element_ty),
             mask=m_cv)


@fast_launch
@triton.jit(do_not_specialize=["T", "NC", "BASE"])
def _state_bwd_kernel(q, k, w, g, do, dd, dh, dht, dh0, cu, rows, scale, T, NC, BASE, H: tl.constexpr, K: tl.constexpr,
                      V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, USE_G: tl.constexpr,
                      HAS_DHT: tl.constexpr, PACKED: tl.constexpr, TLOAD: tl.constexpr, PREC: tl.constexpr,
                      UP: tl.constexpr):
    """Grid (cdiv(V, BV), B*H; packed: S*H): dh[b, h, n] = gradient of the state leaving chunk n,
    dd += Khat dh (= ddelta); dh0 = gradient of the initial state (PACKED: program s*H + h runs sequence s's chunks
    in reverse, from dht[s, h] to dh0[s, h]). TLOAD: Q^T and W^T are read transposed from memory (strided loads)
    instead of being transposed in registers. BASE: as in _state_fwd_kernel."""
    i_v, i_bh = tl.program_id(0), tl.program_id(1) + BASE
    i_h = i_bh % H
    N = NC
    if PACKED:  # sequence i_bh // H: its chunks of the one batch row, its states at row i_h of h
        c0 = tl.load(cu + i_bh // H).to(tl.int64)
        c1 = tl.load(cu + i_bh // H + 1).to(tl.int64)
        i_b, i_hb = i_bh * 0, i_h
    else:
        c0, c1, i_b, i_hb = 0, N, i_bh // H, i_bh
    o_k, o_c = tl.arange(0, BK), tl.arange(0, C)
    o_v = i_v * BV + tl.arange(0, BV)
    kv = o_k[:, None] * V + o_v[None, :]
    m_kv = (o_k[:, None] < K) & (o_v[None, :] < V)
    dS = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_DHT:
        dS += tl.load(dht + i_bh.to(tl.int64) * K * V + kv, mask=m_kv, other=0.0).to(tl.float32)
    t_start, t_end = scan_tokens(rows, c0, c1, PACKED)  # the run's tokens, read once
    for i in range(c1 - c0):
        n = c1 - 1 - i
        tl.store(dh + (i_hb.to(tl.int64) * N + n) * K * V + kv, dS.to(dh.dtype.element_ty), mask=m_kv)
        first, count = scan_chunk(rows, n, c0, t_start, t_end, i_b, T, C, PACKED)
        m_t = o_c < count
        r0 = first * H + i_h  # row of the chunk's first token
        row = o_c * H
        m_ck = m_t[:, None] & (o_k[None, :] < K)
        m_cv = m_t[:, None] & (o_v[None, :] < V)
        b, b_last = _chunk_gate(g + r0, row, m_t, o_c, C, USE_G)
        kc = tl.load(k + r0 * K + row[:, None] * K + o_k[None, :], mask=m_ck, other=0.0)
        if TLOAD:
            m_kc = (o_k[:, None] < K) & m_t[None, :]
            qt = tl.load(q + r0 * K + row[None, :] * K + o_k[:, None], mask=m_kc, other=0.0)
            wt = tl.load(w + r0 * K + row[None, :] * K + o_k[:, None], mask=m_kc, other=0.0)
        else:
            qt = tl.trans(tl.load(q + r0 * K + row[:, None] * K + o_k[None, :], mask=m_ck, other=0.0))
            wt = tl.trans(tl.load(w + r0 * K + row[:, None] * K + o_k[None, :], mask=m_ck, other=0.0))
        doc = tl.load(do + r0 * V + row[:, None] * V + o_v[None, :], mask=m_cv, other=0.0)
        ddl = tl.load(dd + r0 * V + row[:, None] * V + o_v[None, :], mask=m_cv, other=0.0).to(tl.float32)
        if USE_G:
            khat = (kc.to(tl.float32) * tl.exp(b_last - b)[:, None]).to(kc.dtype)
            ddl += mm(khat, dS.to(kc.dtype), PREC, UP)
            q_dec = (qt.to(tl.float32) * (scale * tl.exp(b))[None, :]).to(doc.dtype)
            dS = dS * tl.exp(b_last) + mm(q_dec, doc, PREC, UP)
        else:  # no decay: the tiles enter the products as loaded
            ddl += mm(kc, dS.to(kc.dtype), PREC, UP)
            dS += mm(qt, doc, PREC, UP) * scale
        tl.store(dd + r0 * V + row[:, None] * V + o_v[None, :], ddl.to(dd.dtype.element_ty), mask=m_cv)
        dS -= mm(wt, ddl.to(wt.dtype), PREC, UP)
    tl.store(dh0 + i_bh.to(tl.int64) * K * V + kv, dS, mask=m_kv)


@fast_launch
@triton.jit(do_not_specialize=["T", "NC", "sdb"])
def _grads_qk_kernel(q, k, g, h, dlt, dd, do, dh, dq, dk, dw, db, rows, scale, T, NC, sdb, H: tl.constexpr,
                     K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                     USE_G: tl.constexpr, PREC: tl.constexpr, UP: tl.constexpr, PACKED: tl.constexpr):
    """Grid (cdiv(K, BK) * N, B*H) (block_and_index), looping over value blocks: for one key block, dq, the part of
    dk from o and S' (written to dk), dW = -ddelta S^T, and this key block's share of the part of db_t from o and S'
    (written to db[i_k], at db + i_k * sdb: the shares are linear in sums over keys and add up)."""
    i_k, n = block_and_index(tl.cdiv(K, BK))
    i_bh = tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    N = NC
    o_k, o_c = i_k * BK + tl.arange(0, BK), tl.arange(0, C)
    first, count = chunk_span(rows, n, i_b, T, C, PACKED)
    m_t = o_c < count
    r0 = first * H + i_h  # row of the chunk's first token
    row = o_c * H
    m_ck = m_t[:, None] & (o_k[None, :] < K)
    ck = row[:, None] * K + o_k[None, :]
    dPr = tl.zeros([C, C], dtype=tl.float32)  # do delta^T
    dq_acc = tl.zeros([C, BK], dtype=tl.float32)  # do S^T
    dkh = tl.zeros([C, BK], dtype=tl.float32)  # delta dS'^T (gradient of Khat)
    dW = tl.zeros([C, BK], dtype=tl.float32)  # -ddelta S^T
    sds = tl.zeros([BK], dtype=tl.float32)  # <S, dS'> by key row
    base = (i_bh.to(tl.int64) * N + n) * K * V
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_cv = m_t[:, None] & (o_v[None, :] < V)
        m_kv = (o_k[:, None] < K) & (o_v[None, :] < V)
        cv = row[:, None] * V + o_v[None, :]
        doc = tl.load(do + r0 * V + cv, mask=m_cv, other=0.0)
        dl = tl.load(dlt + r0 * V + cv, mask=m_cv, other=0.0)
        ddl = tl.load(dd + r0 * V + cv, mask=m_cv, other=0.0)
        S = tl.load(h + base + o_k[:, None] * V + o_v[None, :], mask=m_kv, other=0.0)
        dS = tl.load(dh + base + o_k[:, None] * V + o_v[None, :], mask=m_kv, other=0.0)
        St = tl.trans(S)
        dPr += mm(doc, tl.trans(dl.to(doc.dtype)), PREC, UP)
        dq_acc += mm(doc.to(S.dtype), St, PREC, UP)
        dkh += mm(dl.to(dS.dtype), tl.trans(dS), PREC, UP)
        dW -= mm(ddl.to(S.dtype), St, PREC, UP)
        sds += tl.sum(S.to(tl.float32) * dS.to(tl.float32), axis=1)
    tl.store(dw + r0 * K + ck, dW.to(dw.dtype.element_ty), mask=m_ck)
    b, b_last = _chunk_gate(g + r0, row, m_t, o_c, C, USE_G)
    qc = tl.load(q + r0 * K + ck, mask=m_ck, other=0.0)
    kc = tl.load(k + r0 * K + ck, mask=m_ck, other=0.0)
    # o = diag(gamma) (scale Q) S + P delta
    dqv = dq_acc * (scale * tl.exp(b))[:, None]
    dbv = tl.sum(qc.to(tl.float32) * dqv, axis=1)
    dPD = dPr * _decay(b, o_c, False) * scale
    dqv += mm(dPD.to(kc.dtype), kc, PREC, UP)
    tl.store(dq + r0 * K + ck, dqv.to(dq.dtype.element_ty), mask=m_ck)
    # S' = gamma_C S + Khat^T delta
    cc = tl.exp(b_last - b)
    dkv = mm(tl.trans(dPD).to(qc.dtype), qc, PREC, UP) + dkh * cc[:, None]
    tl.store(dk + r0 * K + ck, dkv.to(dk.dtype.element_ty), mask=m_ck)
    if USE_G:
        PP = dPD * mm(qc, tl.trans(kc), PREC, UP)
        x = cc * tl.sum(kc.to(tl.float32) * dkh, axis=1)
        dbv += tl.sum(PP, axis=1) - tl.sum(PP, axis=0) - x
        # the chunk-end terms (through b_C) go to the last token of the chunk that exists
        dbv += tl.where(o_c == count - 1, tl.sum(x, axis=0) + tl.exp(b_last) * tl.sum(sds, axis=0), 0.0)
        tl.store(db + sdb.to(tl.int64) * i_k + r0 + row, dbv, mask=m_t)


@fast_launch
@triton.jit(do_not_specialize=["T", "sdb"])
def _grads_wy_kernel(k, p, v, beta, g, tm, dd, dw, dk, dp, dv, dbeta, db, dg, rows, T, sdb, H: tl.constexpr,
                     K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                     NKQ: tl.constexpr, USE_G: tl.constexpr, HAS_P: tl.constexpr, PREC: tl.constexpr,
                     UP: tl.constexpr, PACKED: tl.constexpr):
    """Grid (N, B*H), looping over value and key blocks: the gradients through W = Tm diag(beta gamma) R,
    U = Tm diag(beta) V and Tm = (I + A)^-1 (Tm read from tm, kept by the forward pass): dv, dbeta, dp (HAS_P;
    else added to dk), the rest of dk (added to dk), and dg = reverse cumulative sum within the chunk of db_t
    (db: NKQ shares of the part from o and S'). The terms of A's gradient in beta and the gate,
    sum_s dA_ts D_ts (p_t . k_s), are formed from the products (dA ⊙ D) K and (dA ⊙ D)^T diag(beta) R that dp
    and dk need anyway."""
    n, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    o_c = tl.arange(0, C)
    first, count = chunk_span(rows, n, i_b, T, C, PACKED)
    m_t = o_c < count
    r0 = first * H + i_h  # row of the chunk's first token
    row = o_c * H
    bet = tl.load(beta + r0 + row, mask=m_t, other=0.0).to(tl.float32)
    b, b_last = _chunk_gate(g + r0, row, m_t, o_c, C, USE_G)
    gam = tl.exp(b)
    bg = bet * gam
    Tq = tl.load(tm + r0 * C + row[:, None] * C + o_c[None, :], mask=m_t[:, None], other=0.0)
    dTm = tl.zeros([C, C], dtype=tl.float32)
    dbet = tl.zeros([C], dtype=tl.float32)
    for i_v in range(tl.cdiv(V, BV)):  # U = Tm diag(beta) V
        o_v = i_v * BV + tl.arange(0, BV)
        m_cv = m_t[:, None] & (o_v[None, :] < V)
        cv = row[:, None] * V + o_v[None, :]
        vc = tl.load(v + r0 * V + cv, mask=m_cv, other=0.0)
        ddl = tl.load(dd + r0 * V + cv, mask=m_cv, other=0.0)
        dTm += mm(ddl.to(vc.dtype), tl.trans((vc.to(tl.float32) * bet[:, None]).to(vc.dtype)), PREC, UP)
        TdU = mm(tl.trans(Tq), ddl.to(Tq.dtype), PREC, UP)
        tl.store(dv + r0 * V + cv, (TdU * bet[:, None]).to(dv.dtype.element_ty), mask=m_cv)
        dbet += tl.sum(vc.to(tl.float32) * TdU, axis=1)
    y = tl.zeros([C], dtype=tl.float32)
    for i_k in range(tl.cdiv(K, BK)):  # W = Tm diag(beta gamma) R: dTm and the beta, gate terms
        o_k = i_k * BK + tl.arange(0, BK)
        ck = row[:, None] * K + o_k[None, :]
        m_ck = m_t[:, None] & (o_k[None, :] < K)
        if HAS_P:
            pc = tl.load(p + r0 * K + ck, mask=m_ck, other=0.0)
        else:
            pc = tl.load(k + r0 * K + ck, mask=m_ck, other=0.0)
        dW = tl.load(dw + r0 * K + ck, mask=m_ck, other=0.0)
        dTm += mm(dW.to(pc.dtype), tl.trans((pc.to(tl.float32) * bg[:, None]).to(pc.dtype)), PREC, UP)
        y += tl.sum(pc.to(tl.float32) * mm(tl.trans(Tq), dW.to(Tq.dtype), PREC, UP), axis=1)
    y = gam * y
    dbet += y
    # Tm = (I + A)^-1 with A_ts = beta_t (p_t . k_s) D_ts (s < t)
    dA = -mm(mm(tl.trans(Tq), dTm.to(Tq.dtype), PREC, UP).to(Tq.dtype), tl.trans(Tq), PREC, UP)
    dAD = dA * _decay(b, o_c, True)
    dAl = dAD.to(Tq.dtype)
    dAt = tl.trans(dAD).to(Tq.dtype)
    a_row = tl.zeros([C], dtype=tl.float32)  # sum_s dAD_ts (p_t . k_s)
    a_col = tl.zeros([C], dtype=tl.float32)  # sum_t dAD_ts beta_t (p_t . k_s)
    for i_k in range(tl.cdiv(K, BK)):  # dp: through W (Tm^T dW, recomputed) and A; dk: through A
        o_k = i_k * BK + tl.arange(0, BK)
        ck = row[:, None] * K + o_k[None, :]
        m_ck = m_t[:, None] & (o_k[None, :] < K)
        kc = tl.load(k + r0 * K + ck, mask=m_ck, other=0.0)
        pc = _read_key(p, kc, r0 * K + ck, m_ck, HAS_P)
        dW = tl.load(dw + r0 * K + ck, mask=m_ck, other=0.0)
        dAk = mm(dAl, kc, PREC, UP)  # (dA ⊙ D) K
        a_row += tl.sum(pc.to(tl.float32) * dAk, axis=1)
        dkv = mm(tl.trans(Tq), dW.to(Tq.dtype), PREC, UP) * bg[:, None] + dAk * bet[:, None]  # dp
        if HAS_P:
            tl.store(dp + r0 * K + ck, dkv.to(dp.dtype.element_ty), mask=m_ck)
            dkv = tl.zeros([C, BK], dtype=tl.float32)
        dAp = mm(dAt, (pc.to(tl.float32) * bet[:, None]).to(pc.dtype), PREC, UP)  # (dA ⊙ D)^T diag(beta) R
        a_col += tl.sum(kc.to(tl.float32) * dAp, axis=1)
        dkv += dAp + tl.load(dk + r0 * K + ck, mask=m_ck, other=0.0).to(tl.float32)
        tl.store(dk + r0 * K + ck, dkv.to(dk.dtype.element_ty), mask=m_ck)
    dbet += a_row
    tl.store(dbeta + r0 + row, dbet, mask=m_t)
    if USE_G:
        dbv = bet * y + bet * a_row - a_col
        for i_k in range(NKQ):
            dbv += tl.load(db + sdb.to(tl.int64) * i_k + r0 + row, mask=m_t, other=0.0)
        tl.store(dg + r0 + row, tl.cumsum(dbv, axis=0, reverse=True), mask=m_t)


# Launch settings: fixed per head size (never tuned per sequence length). Timed kernel by kernel on an H100
# (bf16, B=4, T=16384, H=16, K=V=128; `python -m linattn.bench.triton_tune --family gated_delta_rule [--op delta_rule]`,
# docs/benchmarks.md). "<kernel>_stages" is the software-pipelining depth of bf16/fp16 inputs (float32 always runs
# with 1); "scan" is the forward state scan, "bscan" the reverse one; bscan_tload reads Q^T and W^T transposed from
# memory. The reverse scan and the o/S' gradients use the settings best for the delta rule (no gate); the gated
# kernels would take ~0.1 ms less with bscan 4 warps, BV 32 (1.19 vs 1.30 ms).
# WY gradient: before Tm was kept from the forward pass, this kernel also inverted (I + A) and, on the H100 with
# Triton 3.6, compiled with 4 or 8 warps it made an illegal memory access (bf16, K = 32) and NaN gradients (the Hopper
# miscompilation FLA reports in fla-org/flash-linear-attention#984). Without the inverse, 2, 4 and 8 warps all agree
# with the float32 recurrence on the H100 (`python -m linattn.bench.launch_check --family gated_delta_rule
# --configs '[{}, {"wy_warps": 8}]'`: bf16 <= 6.3e-3, float32 strong decay 9.2e-6); 4 warps is the fastest.
LAUNCH = {"prep_BV": 64, "prep_warps": 4, "prep_stages": 3, "scan_BV": 64, "scan_warps": 4, "scan_stages": 3,
          "out_BV": 128, "out_warps": 4, "out_stages": 2, "dv_BV": 128, "dv_warps": 4, "dv_stages": 3,
          "bscan_BV": 64, "bscan_warps": 8, "bscan_stages": 3, "bscan_tload": 1, "grads_BK": 64, "grads_BV": 64,
          "grads_warps": 4, "grads_stages": 2, "wy_BK": 64, "wy_BV": 32, "wy_warps": 4, "wy_stages": 3,
          "overlap_scans": 1}
launch_overrides("gated_delta_rule", LAUNCH)


def _launch_args(x: torch.Tensor) -> dict[str, str | bool]:
    """The kernels' dot-product precision flags for inputs of x's dtype, by parameter name."""
    return {"PREC": dot_precision(x.dtype), "UP": upcast_dots(x.dtype)}


def _options(x: torch.Tensor, kernel: str) -> dict[str, int]:
    """num_warps and num_stages of ``kernel`` from LAUNCH; float32 loops are not software-pipelined (three stages
    of the backward scan's float32 tiles would exceed an H100's shared memory at K = V = 128)."""
    return launch_options(LAUNCH, kernel, x.dtype, float32_stages=1)


def _prepare_upcasts(k: torch.Tensor, BV: int) -> bool:
    """Whether the prepare kernel multiplies in float32 instead of bf16/fp16 tensor-core products: always under the
    interpreter (:func:`upcast_dots`), and on a GPU when a key or value block is 16 wide. Triton 3.6 miscompiles
    the half-precision products Tm @ (beta gamma K) and Tm @ (beta V) with 16-wide outputs at 4 warps on the H100
    (sm_90): W and U came out wrong, or the kernel read out of bounds (illegal address), while Tm was right; the
    float32 products are correct and cost little at such small K and V."""
    return upcast_dots(k.dtype) or (k.dtype != torch.float32 and min(_block(k.shape[-1]), BV) < 32)


class Chunks(NamedTuple):
    """The chunks the kernels run: ``n`` a batch row; packed sequences (B = 1, read where they lie) add ``rows``
    ([n, 2] int64: each chunk's first token and token count) and ``cu`` ([S + 1] int32: each sequence's first chunk,
    then n), from common/packed_call.py's ChunkLayout."""

    n: int
    rows: torch.Tensor | None = None
    cu: torch.Tensor | None = None

    @property
    def packed(self) -> bool:
        return self.rows is not None


def _chunks(T: int, C: int, cu_chunks: torch.Tensor | None, chunk_rows: torch.Tensor | None) -> Chunks:
    return Chunks(chunk_count(T, C, chunk_rows), chunk_rows, None if chunk_rows is None else cu_chunks)


def _prepare(k, v, beta, g, C, chunks: Chunks, p=None, tm=None, keep_tm=False):
    """W [B, T, H, K] and U [B, T, H, V] in the input dtype (p None: read key = k), and Tm [B, T, H, C] (input
    dtype) when ``keep_tm`` (else None). With ``tm`` given, Tm is read from it instead of being recomputed."""
    B, T, H, K = k.shape
    V = v.shape[-1]
    w, u = torch.empty_like(k), torch.empty_like(v)
    mode = 2 if tm is not None else 1 if keep_tm else 0
    if keep_tm:
        tm = torch.empty(B, T, H, C, device=k.device, dtype=k.dtype)
    BV = min(LAUNCH["prep_BV"], _block(V))
    _prepare_kernel[(chunks.n, B * H)](
        k=k, p=k if p is None else p, v=v, beta=beta, g=w if g is None else g, tm=w if tm is None else tm, w=w, u=u,
        rows=beta if chunks.rows is None else chunks.rows, T=T, H=H, K=K, V=V, C=C, BK=_block(K), BV=BV,
        USE_G=g is not None, HAS_P=p is not None, TM_MODE=mode, PREC=dot_precision(k.dtype),
        UP=_prepare_upcasts(k, BV), PACKED=chunks.packed, **_options(k, "prep"))
    return w, u, (tm if keep_tm else None)


def _states(k, w, u, g, initial_state, C, chunks: Chunks, side: bool = False):
    """(h [B, H, N, K, V]: states entering the chunks, delta [B, T, H, V], final state float32, the scan's handle).
    Packed ``chunks``: the initial and final states have a row per sequence [S, H, K, V]. ``side``: the scan runs
    on a side stream (common/side_stream.py) and the caller joins the handle before reading h or delta."""
    B, T, H, K = k.shape
    V = u.shape[-1]
    rows = B if chunks.cu is None else chunks.cu.shape[0] - 1
    h = torch.empty(B, H, chunks.n, K, V, device=k.device, dtype=chunk_state_dtype(k))
    dlt = torch.empty_like(u)
    ht = torch.empty(rows, H, K, V, device=k.device, dtype=torch.float32)
    BV = min(LAUNCH["scan_BV"], _block(V))

    def scan() -> None:
        for base, count in grid_slices(rows * H):
            _state_fwd_kernel[(cdiv(V, BV), count)](
                k=k, w=w, u=u, g=ht if g is None else g, h=h, dlt=dlt,
                h0=ht if initial_state is None else initial_state, ht=ht, cu=ht if chunks.cu is None else chunks.cu,
                rows=ht if chunks.rows is None else chunks.rows, T=T, NC=chunks.n, BASE=base, H=H, K=K, V=V, C=C,
                BK=_block(K), BV=BV, USE_G=g is not None, HAS_H0=initial_state is not None, PACKED=chunks.packed,
                **_launch_args(k), **_options(k, "scan"))

    return h, dlt, ht, beside(scan, k.device, keep=(k, w, u, g, initial_state, chunks.cu, chunks.rows, h, dlt, ht),
                              enabled=side)


def _output(q, k, dlt, g, h, scale, C, chunks: Chunks):
    B, T, H, K = q.shape
    V = dlt.shape[-1]
    o = torch.empty_like(dlt)
    BV = min(LAUNCH["out_BV"], _block(V))
    chunk_output_kernel[(cdiv(V, BV) * chunks.n, B * H)](
        q=q, k=k, v=dlt, g=o if g is None else g, h=h, o=o, rows=o if chunks.rows is None else chunks.rows,
        scale=scale, T=T, NC=chunks.n, H=H, K=K, V=V, C=C, BK=_block(K), BV=BV, USE_G=g is not None,
        PACKED=chunks.packed, **_launch_args(q), **_options(q, "out"))
    return o


def gated_delta_triton_forward(q, k, v, g, beta, scale, initial_state, C, p=None, keep_tm=False, cu_chunks=None,
                               chunk_rows=None):
    """Forward pass: (o, final state float32, Tm [B, T, H, C] for the backward pass, or None unless ``keep_tm``).
    Inputs contiguous [B, T, H, *]; g (or None), beta [B, T, H] (bf16, fp16 or float32); p (or None: p = k) like k.
    ``cu_chunks`` and ``chunk_rows``: packed sequences (B = 1) by chunk (:class:`Chunks`)."""
    chunks = _chunks(q.shape[1], C, cu_chunks, chunk_rows)
    w, u, tm = _prepare(k, v, beta, g, C, chunks, p, keep_tm=keep_tm)
    h, dlt, ht, _ = _states(k, w, u, g, initial_state, C, chunks)
    return _output(q, k, dlt, g, h, scale, C, chunks), ht, tm


def gated_delta_triton_backward(q, k, v, g, beta, scale, initial_state, C, do, dht, p=None, tm=None, cu_chunks=None,
                                chunk_rows=None):
    """Backward pass: (dq, dk, dv, dg (None when g is None), dbeta, d_initial_state, dp (None when p is None:
    the read key's gradient is then part of dk)). ``tm``: the forward pass's Tm (recomputed when None);
    ``cu_chunks``, ``chunk_rows``: as in :func:`gated_delta_triton_forward`."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    chunks = _chunks(T, C, cu_chunks, chunk_rows)
    N = chunks.n
    BK = _block(K)
    gp = beta if g is None else g  # pointer placeholder when there is no gate
    rp = beta if chunks.rows is None else chunks.rows  # likewise for the chunks' tokens
    if tm is None:
        w, u, tm = _prepare(k, v, beta, g, C, chunks, p, keep_tm=True)
    else:
        w, u, _ = _prepare(k, v, beta, g, C, chunks, p, tm=tm)
    # the states' recomputation and the reverse scan of their gradients read neither's output: the first runs on
    # a side stream while the local value gradient and the reverse scan run here (joined before grads_qk)
    h, dlt, _, states_done = _states(k, w, u, g, initial_state, C, chunks, side=bool(LAUNCH["overlap_scans"]))
    dd = torch.empty_like(dlt)
    BV = min(LAUNCH["dv_BV"], _block(V))
    _dv_local_kernel[(cdiv(V, BV) * N, B * H)](
        q=q, k=k, g=gp, do=do, dd=dd, rows=rp, scale=scale, T=T, H=H, K=K, V=V, C=C, BK=BK, BV=BV,
        USE_G=g is not None, PACKED=chunks.packed, **_launch_args(q), **_options(q, "dv"))
    dh = torch.empty_like(h)
    rows = B if chunks.cu is None else chunks.cu.shape[0] - 1
    dh0 = torch.empty(rows, H, K, V, device=q.device, dtype=torch.float32)
    BV = min(LAUNCH["bscan_BV"], _block(V))
    for base, count in grid_slices(rows * H):
        _state_bwd_kernel[(cdiv(V, BV), count)](
            q=q, k=k, w=w, g=gp, do=do, dd=dd, dh=dh, dht=dh0 if dht is None else dht, dh0=dh0,
            cu=dh0 if chunks.cu is None else chunks.cu, rows=rp, scale=scale, T=T, NC=N, BASE=base, H=H, K=K, V=V,
            C=C, BK=BK, BV=BV, USE_G=g is not None, HAS_DHT=dht is not None, PACKED=chunks.packed,
            TLOAD=bool(LAUNCH["bscan_tload"]), **_launch_args(q), **_options(q, "bscan"))
    dq, dk, dv, dw = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(w)
    dbeta = torch.empty_like(beta)
    dg = dbeta if g is None else torch.empty_like(g)  # without a gate a pointer the kernels never write
    BKQ = min(LAUNCH["grads_BK"], BK)
    NKQ = cdiv(K, BKQ)
    # shares of the part of db_t from o and S', one per key block (unused without a gate); the kernels place share
    # i at i * sdb, as the tensor lays it out (not as any launch grid happens to be shaped)
    db = dg if g is None else torch.empty(NKQ, *g.shape, device=g.device, dtype=torch.float32)
    sdb = db.stride(0) if g is not None else 0
    BV = min(LAUNCH["grads_BV"], _block(V))
    states_done.join()
    _grads_qk_kernel[(NKQ * N, B * H)](
        q=q, k=k, g=gp, h=h, dlt=dlt, dd=dd, do=do, dh=dh, dq=dq, dk=dk, dw=dw, db=db, rows=rp, scale=scale, T=T,
        NC=N, sdb=sdb, H=H, K=K, V=V, C=C, BK=BKQ, BV=BV, USE_G=g is not None, PACKED=chunks.packed, **_launch_args(q),
        **_options(q, "grads"))
    dp = None if p is None else torch.empty_like(p)
    _grads_wy_kernel[(N, B * H)](
        k=k, p=k if p is None else p, v=v, beta=beta, g=gp, tm=tm, dd=dd, dw=dw, dk=dk, dp=dk if p is None else dp,
        dv=dv, dbeta=dbeta, db=db, dg=dg, rows=rp, T=T, sdb=sdb, H=H, K=K, V=V, C=C, BK=min(LAUNCH["wy_BK"], BK),
        BV=min(LAUNCH["wy_BV"], _block(V)), NKQ=NKQ, USE_G=g is not None, HAS_P=p is not None, PACKED=chunks.packed,
        **_launch_args(q), **_options(q, "wy"))
    return dq, dk, dv, (None if g is None else dg), dbeta, dh0, dp


def _fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor | None, beta: torch.Tensor,
            initial_state: torch.Tensor | None, scale: float, chunk_size: int, p: torch.Tensor | None = None,
            keep_tm: bool = False, cu_chunks: torch.Tensor | None = None, chunk_rows: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(o, final state, Tm [B, T, H, C] kept for the backward pass when ``keep_tm``, else an empty tensor).
    ``cu_chunks`` [S + 1] int32 and ``chunk_rows`` [chunks, 2] int64: packed sequences (:class:`Chunks`; states
    [S, H, K, V])."""
    o, ht, tm = gated_delta_triton_forward(q, k, v, g, beta, scale, initial_state, chunk_size, p, keep_tm,
                                            cu_chunks=cu_chunks, chunk_rows=chunk_rows)
    return o, ht, (q.new_empty(0) if tm is None else tm)


def _state_rows(q: torch.Tensor, cu_chunks: torch.Tensor | None) -> int:
    return q.shape[0] if cu_chunks is None else cu_chunks.shape[0] - 1


def _fwd_fake(q, k, v, g, beta, initial_state, scale, chunk_size, p=None, keep_tm=False, cu_chunks=None,
              chunk_rows=None):
    B, T, H, K = q.shape
    tm = q.new_empty(B, T, H, chunk_size) if keep_tm else q.new_empty(0)
    return (torch.empty_like(v), q.new_empty(_state_rows(q, cu_chunks), H, K, v.shape[-1], dtype=torch.float32),
            tm)


_fwd_op = define_op("gated_delta_rule_triton_fwd", _fwd, _fwd_fake)


def _bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor | None, beta: torch.Tensor,
            initial_state: torch.Tensor | None, scale: float, chunk_size: int, do: torch.Tensor,
            dht: torch.Tensor | None, p: torch.Tensor | None = None, tm: torch.Tensor | None = None,
            cu_chunks: torch.Tensor | None = None, chunk_rows: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                       torch.Tensor]:
    """The gradients of _fwd_op's tensors; dg is an empty tensor when g is None, dp when p is None (its part is in
    dk). ``tm``: the forward pass's Tm (None or empty: recomputed)."""
    tm = None if tm is None or tm.numel() == 0 else tm
    dq, dk, dv, dg, dbeta, dh0, dp = gated_delta_triton_backward(q, k, v, g, beta, scale, initial_state, chunk_size,
                                                                 do, dht, p, tm, cu_chunks=cu_chunks,
                                                                 chunk_rows=chunk_rows)
    return (dq, dk, dv, (q.new_empty(0) if dg is None else dg), dbeta, dh0,
            (q.new_empty(0) if dp is None else dp))


def _bwd_fake(q, k, v, g, beta, initial_state, scale, chunk_size, do, dht, p=None, tm=None, cu_chunks=None,
              chunk_rows=None):
    B, T, H, K = q.shape
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
            q.new_empty(0) if g is None else torch.empty_like(g), torch.empty_like(beta),
            q.new_empty(_state_rows(q, cu_chunks), H, K, v.shape[-1], dtype=torch.float32),
            q.new_empty(0) if p is None else torch.empty_like(p))


_bwd_op = define_op("gated_delta_rule_triton_bwd", _bwd, _bwd_fake)


def _setup_context(ctx, inputs, output):
    q, k, v, g, beta, initial_state, scale, chunk_size, p, keep_tm, cu_chunks, chunk_rows = inputs
    ctx.save_for_backward(q, k, v, g, beta, initial_state, p, output[2], cu_chunks, chunk_rows)
    ctx.scale, ctx.chunk_size = scale, chunk_size


def _backward(ctx, do, dht, dtm):
    q, k, v, g, beta, initial_state, p, tm, cu_chunks, chunk_rows = ctx.saved_tensors
    run_bwd = _bwd if eager_backward(ctx) else _bwd_op
    do = torch.zeros_like(v) if do is None else do.contiguous()
    dq, dk, dv, dg, dbeta, dh0, dp = run_bwd(q, k, v, g, beta, initial_state, ctx.scale, ctx.chunk_size, do,
                                             None if dht is None else dht.contiguous(), p, tm, cu_chunks, chunk_rows)
    return (dq, dk, dv, (dg if g is not None else None), dbeta, (dh0 if initial_state is not None else None),
            None, None, (dp if p is not None else None), None, None, None)


_differentiable = op_function("GatedDeltaTriton", _fwd, _fwd_op, _setup_context, _backward, non_differentiable=(2,))


def _own_dtype(x: torch.Tensor) -> torch.Tensor:
    """A gate as the kernels read it: bf16, fp16 or float32 as given (float64 as float32), contiguous."""
    return x.contiguous() if x.dtype in (torch.bfloat16, torch.float16, torch.float32) else x.float().contiguous()


def gated_delta_triton(
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
    """The ``backend="triton"`` implementation (inputs validated by ``gated_delta_rule`` or ``comba``; g None:
    no decay; p None: the read key is k).

    S_t = exp(g_t) (I - b_t k_t p_t^T) S_{t-1} + b_t k_t v_t^T,  o_t = S_t^T (scale q_t).
    """
    if chunk_size not in DELTA_TRITON_CHUNK_SIZES:
        sizes = ", ".join(map(str, DELTA_TRITON_CHUNK_SIZES[:-1])) + f" or {DELTA_TRITON_CHUNK_SIZES[-1]}"
        raise ValueError(f"chunk_size must be {sizes} for the delta-rule family's backend='triton', got "
                         f"{chunk_size} (128-token chunks need [128, 128] float32 tiles that spill registers: on an "
                         "H100 one such kernel took minutes to compile; use 64, or backend='chunk')")
    in_dtype = q.dtype  # float64 runs in float32 and returns float64
    dtype = in_dtype if in_dtype in (torch.bfloat16, torch.float16, torch.float32) else torch.float32
    q, k, v = (x.to(dtype).contiguous() for x in (q, k, v))
    p = None if p is None else p.to(dtype).contiguous()
    # the kernels read g and beta in their own dtype and compute in float32 (bf16 gates from a layer under autocast
    # need no conversion kernels; their gradients come back in the same dtype)
    g = None if g is None else _own_dtype(g)
    beta = _own_dtype(beta)
    s0 = None if initial_state is None else initial_state.float().contiguous()
    packing, cu_chunks, chunk_rows = current_packing(), None, None
    if packing is not None:  # packed sequences, read where they lie: the kernels take each chunk's tokens
        layout = chunk_layout(packing, chunk_size, q.device)
        cu_chunks, chunk_rows = layout.cu_chunks, layout.chunk_rows
    # Tm (a [C]-row per token, the input dtype) is kept for the backward pass only when one will follow
    keep_tm = needs_backward(q, k, v, g, beta, s0, p)
    o, ht, _ = _differentiable(q, k, v, g, beta, s0, float(scale), chunk_size, p, keep_tm, cu_chunks, chunk_rows)
    state_dtype = torch.float64 if in_dtype == torch.float64 else torch.float32
    return o.to(in_dtype), (ht.to(state_dtype) if output_final_state else None)


gated_delta_triton.native_cu_seqlens = True  # packed sequences run where they lie, chunk by chunk
TRITON_BACKENDS = {"gated_delta_rule": gated_delta_triton}
