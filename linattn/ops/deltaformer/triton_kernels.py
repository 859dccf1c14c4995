"""DeltaFormer's triangular solve and its adjoint as Triton kernels (one sequential pass per batch*head).

With kappa_ts = exp(scale k_t.k_s - lse_t) for s < t (lse_t the log-normaliser of row t over all keys strictly
before it, cached ones included; computed beforehand by the flash kernel with strict visibility), the new
positions' pseudo-values solve

    u_t = v_t - b_t r_t,   r_t = sum_{s<t} kappa_ts u_s,

chunk by chunk (C rows, the cache first): r_c = kappa_{c,past} U_past + kappa_cc U_c, hence
U_c = (I + diag(b_c) kappa_cc)^-1 (V_c - diag(b_c) kappa_{c,past} U_past). A program per value block and
batch*head walks the chunks in order: the past part as a loop over key blocks (the flash pattern with known
normalisers), the in-chunk part with the in-kernel unit-lower inverse of ``common/triton_tril.py``. U (float32, the
recursion reads it back) and r are stored; nothing else is kept.

Blocked (``LAUNCH["panel"]`` = P > 0 chunks a panel): the one program per value block and batch*head does O(T^2)
work in order, a few programs for the whole GPU. In panels it walks only the P chunks of a panel, from the panel's
start, and after each panel ``deltaformer_update_kernel`` adds the panel's keys' share to the sums of every later
chunk (float32 [B, T, H, V]), a program per later chunk: T / (P C) panels, the same products in another order and
most of them in parallel. The adjoint runs the same way from the last panel (``deltaformer_psi_update_kernel``).

Adjoint: with dU the gradient of U from everything downstream, psi = (I + A)^-T dU (A = diag(b) tril(kappa, -1)),
from the last chunk back: psi_c = (I + A_cc)^-T (dU_c - sum_{t in later chunks} b_t kappa_tc^T psi_t). Then
dv = psi, db_t = -psi_t . r_t, and the kernel's logits get exactly an attention backward with queries and keys k,
values U, dO = -b psi and O = r (dkappa_ts = -b_t psi_t . u_s; rowsum(kappa dkappa) = -b_t psi_t . r_t), which the
caller runs through the flash backward kernels with strict visibility.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..common.triton_launch import fast_launch
from ..common.triton_masking import causal_dot_rest, is_finite
from ..common.triton_tril import unit_lower_inverse
from ..common.triton_utils import mm


@triton.jit
def _chunk_kernel_rows(kc, lse_c, scale2, C: tl.constexpr, PREC: tl.constexpr, UP: tl.constexpr):
    """kappa_cc [C, C] of one chunk (strictly lower; float32)."""
    o_c = tl.arange(0, C)
    s = mm(kc, tl.trans(kc), PREC, UP) * scale2
    return tl.where(o_c[:, None] > o_c[None, :], tl.exp2(s - lse_c[:, None]), 0.0)


@triton.jit
def _past_sum(acc, kb, ub, kc, lse_c, o_k, o_v, n0, n1, scale2, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
              BN: tl.constexpr, PREC: tl.constexpr, UP: tl.constexpr):
    """acc + sum over the key positions s in [n0, n1) of kappa_cs u_s for the rows of kc (the flash pattern with
    known normalisers lse_c)."""
    for n in range(n0, n1, BN):
        cols = n + tl.arange(0, BN)
        mc = cols < n1
        kt = tl.load(kb + cols[None, :] * (H * K) + o_k[:, None], mask=mc[None, :] & (o_k[:, None] < K), other=0.0)
        uc = tl.load(ub + cols[:, None] * (H * V) + o_v[None, :], mask=mc[:, None] & (o_v[None, :] < V), other=0.0)
        p = tl.where(mc[None, :], tl.exp2(mm(kc, kt, PREC, UP) * scale2 - lse_c[:, None]), 0.0)
        acc += mm(p.to(kc.dtype), uc.to(kc.dtype), PREC, UP)
    return acc


@triton.jit
def _later_sum(acc, kb, pb, beta, lse, kc, i_bh, i_b, i_h, T0, t0, t1, o_k, o_v, scale2, T, H: tl.constexpr,
               K: tl.constexpr, V: tl.constexpr, BM: tl.constexpr, PREC: tl.constexpr, UP: tl.constexpr):
    """acc + sum over the new rows t in [t0, t1) of b_t kappa_tc^T psi_t for the columns of kc."""
    for t in range(t0, t1, BM):
        tr = t + tl.arange(0, BM)
        mt = tr < t1
        kt = tl.load(kb + (T0 + tr)[:, None] * (H * K) + o_k[None, :], mask=mt[:, None] & (o_k[None, :] < K),
                     other=0.0)
        lse_t = tl.load(lse + i_bh * T + tr, mask=mt, other=float("inf"))
        b_t = tl.load(beta + (i_b * T + tr) * H + i_h, mask=mt, other=0.0).to(tl.float32)
        w = tl.load(pb + tr[:, None] * (H * V) + o_v[None, :], mask=mt[:, None] & (o_v[None, :] < V),
                    other=0.0) * b_t[:, None]
        p = tl.exp2(mm(kt, tl.trans(kc), PREC, UP) * scale2 - lse_t[:, None])  # [BM, C]; padding rows: 0
        acc += mm(tl.trans(p).to(kc.dtype), w.to(kc.dtype), PREC, UP)
    return acc


@triton.jit
def _acc_start(acc_in, rows, m, o_v, C: tl.constexpr, H: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
               i_b, i_h, T, HAS_ACC: tl.constexpr):
    """The rows' accumulated sums from earlier panels (acc_in [B, T, H, V] float32), or zeros."""
    acc = tl.zeros([C, BV], dtype=tl.float32)
    if HAS_ACC:
        acc = tl.load(acc_in + ((i_b * T + rows) * H + i_h)[:, None] * V + o_v[None, :],
                      mask=m[:, None] & (o_v[None, :] < V), other=0.0)
    return acc


@fast_launch
@triton.jit(do_not_specialize=["T", "Tk", "c0", "c1", "past0"])
def deltaformer_solve_kernel(k, v, beta, lse, u, r, acc_in, scale, T, Tk, c0, c1, past0, H: tl.constexpr,
                             K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                             BV: tl.constexpr, PREC: tl.constexpr, UP: tl.constexpr, HAS_ACC: tl.constexpr):
    """Grid (cdiv(V, BV), B*H): chunks c0 .. c1-1 in order. k [B, Tk, H, K] (cached keys, then the T new ones);
    v [B, T, H, V]; beta [B, T, H]; lse [B, H, T] (base 2, +inf for a row with no past); u [B, Tk, H, V] float32
    (rows < Tk - T hold the cache's u's; the new rows are written here); r [B, T, H, V] float32 out. The past of a
    chunk is read from key position past0 on; HAS_ACC: acc_in [B, T, H, V] float32 holds each row's sum over the
    positions before past0 (a panel of the blocked solve)."""
    i_v, i_bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    T0 = Tk - T
    o_c, o_k = tl.arange(0, C), tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    kb = k + (i_b * Tk * H + i_h) * K
    ub = u + (i_b * Tk * H + i_h) * V
    vb = v + (i_b * T * H + i_h) * V
    rb = r + (i_b * T * H + i_h) * V
    scale2 = scale * 1.4426950408889634
    for c in range(c0, c1):
        rows = c * C + o_c
        m = rows < T
        kc = tl.load(kb + (T0 + rows)[:, None] * (H * K) + o_k[None, :], mask=m[:, None] & (o_k[None, :] < K),
                     other=0.0)
        lse_c = tl.load(lse + i_bh * T + rows, mask=m, other=float("inf"))
        b_c = tl.load(beta + (i_b * T + rows) * H + i_h, mask=m, other=0.0).to(tl.float32)
        acc = _acc_start(acc_in, rows, m, o_v, C, H, V, BV, i_b, i_h, T, HAS_ACC)
        # every position before the chunk is in its past
        acc = _past_sum(acc, kb, ub, kc, lse_c, o_k, o_v, past0, T0 + c * C, scale2, H, K, V, BN, PREC, UP)
        # rows from the first one with a non-finite key or beta or a NaN normaliser (+inf: no past) on see it:
        # they are NaN, and the in-chunk products read only the rows before it (triton_masking.py)
        bad = (tl.sum(tl.where(is_finite(kc), 0, 1), axis=1) > 0) | ~is_finite(b_c) | (lse_c != lse_c)
        seen = (tl.cumsum(bad.to(tl.int32), axis=0) > 0)[:, None]
        L = tl.where(seen, 0.0, _chunk_kernel_rows(kc, lse_c, scale2, C, PREC, UP))
        inv = unit_lower_inverse(tl.where(seen, 0.0, b_c[:, None] * L), C, PREC)
        m_cv = m[:, None] & (o_v[None, :] < V)
        vc = tl.load(vb + rows[:, None] * (H * V) + o_v[None, :], mask=m_cv, other=0.0).to(tl.float32)
        rhs_fin, rhs_rest = causal_dot_rest(tl.where(seen, 0.0, vc - b_c[:, None] * acc))
        uc_new = tl.where(seen, float("nan"), mm(inv, rhs_fin, PREC, False) + rhs_rest)
        tl.store(ub + (T0 + rows)[:, None] * (H * V) + o_v[None, :], uc_new, mask=m_cv)
        u_fin, u_rest = causal_dot_rest(uc_new)
        tl.store(rb + rows[:, None] * (H * V) + o_v[None, :], acc + mm(L, u_fin, PREC, False) + u_rest, mask=m_cv)
        tl.debug_barrier()  # the next chunk reads these u's (written by other threads of this program)


@fast_launch
@triton.jit(do_not_specialize=["T", "Tk", "c0", "c1", "t_end"])
def deltaformer_psi_kernel(k, beta, lse, du, psi, acc_in, scale, T, Tk, c0, c1, t_end, H: tl.constexpr,
                           K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
                           BV: tl.constexpr, PREC: tl.constexpr, UP: tl.constexpr, HAS_ACC: tl.constexpr):
    """Grid (cdiv(V, BV), B*H): psi [B, T, H, V] float32 = (I + A)^-T dU of the new positions (du [B, T, H, V]
    float32), chunks c1-1 down to c0. Later rows are read up to t_end; HAS_ACC: acc_in [B, T, H, V] float32 holds
    each row's sum over the rows from t_end on (a panel of the blocked solve)."""
    i_v, i_bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    T0 = Tk - T
    o_c, o_k = tl.arange(0, C), tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    kb = k + (i_b * Tk * H + i_h) * K
    pb = psi + (i_b * T * H + i_h) * V
    db = du + (i_b * T * H + i_h) * V
    scale2 = scale * 1.4426950408889634
    for i in range(0, c1 - c0):
        c = c1 - 1 - i
        rows = c * C + o_c
        m = rows < T
        kc = tl.load(kb + (T0 + rows)[:, None] * (H * K) + o_k[None, :], mask=m[:, None] & (o_k[None, :] < K),
                     other=0.0)
        lse_c = tl.load(lse + i_bh * T + rows, mask=m, other=float("inf"))
        b_c = tl.load(beta + (i_b * T + rows) * H + i_h, mask=m, other=0.0).to(tl.float32)
        # sum over later rows t of b_t kappa_tc^T psi_t
        acc = _acc_start(acc_in, rows, m, o_v, C, H, V, BV, i_b, i_h, T, HAS_ACC)
        acc = _later_sum(acc, kb, pb, beta, lse, kc, i_bh, i_b, i_h, T0, (c + 1) * C, t_end, o_k, o_v, scale2, T, H,
                         K, V, BM, PREC, UP)
        L = _chunk_kernel_rows(kc, lse_c, scale2, C, PREC, UP)
        inv = unit_lower_inverse(b_c[:, None] * L, C, PREC)
        m_cv = m[:, None] & (o_v[None, :] < V)
        rhs = tl.load(db + rows[:, None] * (H * V) + o_v[None, :], mask=m_cv, other=0.0) - acc
        tl.store(pb + rows[:, None] * (H * V) + o_v[None, :], mm(tl.trans(inv), rhs, PREC, False), mask=m_cv)
        tl.debug_barrier()  # earlier chunks read these psi's (written by other threads of this program)


@fast_launch
@triton.jit(do_not_specialize=["T", "Tk", "m0", "n0", "n1"])
def deltaformer_update_kernel(k, u, lse, acc, scale, T, Tk, m0, n0, n1, H: tl.constexpr, K: tl.constexpr,
                              V: tl.constexpr, C: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                              PREC: tl.constexpr, UP: tl.constexpr, HAS_ACC: tl.constexpr):
    """Grid (target chunks, cdiv(V, BV), B*H): the blocked solve's update after a panel. acc [B, T, H, V] float32
    rows of chunk m0 + pid(0) += sum over the key positions s in [n0, n1) of kappa_ts u_s (HAS_ACC False: acc
    starts at 0)."""
    i_m, i_v, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    T0 = Tk - T
    o_c, o_k = tl.arange(0, C), tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    rows = (m0 + i_m) * C + o_c
    m = rows < T
    kb = k + (i_b * Tk * H + i_h) * K
    kc = tl.load(kb + (T0 + rows)[:, None] * (H * K) + o_k[None, :], mask=m[:, None] & (o_k[None, :] < K), other=0.0)
    lse_c = tl.load(lse + i_bh * T + rows, mask=m, other=float("inf"))
    a = _acc_start(acc, rows, m, o_v, C, H, V, BV, i_b, i_h, T, HAS_ACC)
    a = _past_sum(a, kb, u + (i_b * Tk * H + i_h) * V, kc, lse_c, o_k, o_v, n0, n1, scale * 1.4426950408889634, H, K,
                  V, BN, PREC, UP)
    tl.store(acc + ((i_b * T + rows) * H + i_h)[:, None] * V + o_v[None, :], a, mask=m[:, None] & (o_v[None, :] < V))


@fast_launch
@triton.jit(do_not_specialize=["T", "Tk", "t0", "t1"])
def deltaformer_psi_update_kernel(k, beta, lse, psi, acc, scale, T, Tk, t0, t1, H: tl.constexpr, K: tl.constexpr,
                                  V: tl.constexpr, C: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
                                  BV: tl.constexpr, PREC: tl.constexpr, UP: tl.constexpr, HAS_ACC: tl.constexpr):
    """Grid (target chunks 0 .., cdiv(V, BV), B*H): the adjoint's update after a panel. acc rows of chunk pid(0)
    += sum over the new rows t in [t0, t1) of b_t kappa_tc^T psi_t (HAS_ACC False: acc starts at 0)."""
    i_c, i_v, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    T0 = Tk - T
    o_c, o_k = tl.arange(0, C), tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    rows = i_c * C + o_c
    m = rows < T
    kb = k + (i_b * Tk * H + i_h) * K
    kc = tl.load(kb + (T0 + rows)[:, None] * (H * K) + o_k[None, :], mask=m[:, None] & (o_k[None, :] < K), other=0.0)
    a = _acc_start(acc, rows, m, o_v, C, H, V, BV, i_b, i_h, T, HAS_ACC)
    a = _later_sum(a, kb, psi + (i_b * T * H + i_h) * V, beta, lse, kc, i_bh, i_b, i_h, T0, t0, t1, o_k, o_v,
                   scale * 1.4426950408889634, T, H, K, V, BM, PREC, UP)
    tl.store(acc + ((i_b * T + rows) * H + i_h)[:, None] * V + o_v[None, :], a, mask=m[:, None] & (o_v[None, :] < V))
