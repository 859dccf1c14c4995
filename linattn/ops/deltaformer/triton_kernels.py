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


@fast_launch
@triton.jit(do_not_specialize=["T", "Tk"])
def deltaformer_solve_kernel(k, v, beta, lse, u, r, scale, T, Tk, H: tl.constexpr, K: tl.constexpr,
                             V: tl.constexpr, C: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                             BV: tl.constexpr, PREC: tl.constexpr, UP: tl.constexpr):
    """Grid (cdiv(V, BV), B*H). k [B, Tk, H, K] (cached keys, then the T new ones); v [B, T, H, V]; beta [B, T, H];
    lse [B, H, T] (base 2, +inf for a row with no past); u [B, Tk, H, V] float32 (rows < Tk - T hold the cache's
    u's; the new rows are written here); r [B, T, H, V] float32 out."""
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
    for c in range(0, tl.cdiv(T, C)):
        rows = c * C + o_c
        m = rows < T
        kc = tl.load(kb + (T0 + rows)[:, None] * (H * K) + o_k[None, :], mask=m[:, None] & (o_k[None, :] < K),
                     other=0.0)
        lse_c = tl.load(lse + i_bh * T + rows, mask=m, other=float("inf"))
        b_c = tl.load(beta + (i_b * T + rows) * H + i_h, mask=m, other=0.0).to(tl.float32)
        acc = tl.zeros([C, BV], dtype=tl.float32)
        start = T0 + c * C  # every position before the chunk is in its past
        for n in range(0, start, BN):
            cols = n + tl.arange(0, BN)
            mc = cols < start
            kt = tl.load(kb + cols[None, :] * (H * K) + o_k[:, None], mask=mc[None, :] & (o_k[:, None] < K),
                         other=0.0)
            uc = tl.load(ub + cols[:, None] * (H * V) + o_v[None, :], mask=mc[:, None] & (o_v[None, :] < V),
                         other=0.0)
            p = tl.where(mc[None, :], tl.exp2(mm(kc, kt, PREC, UP) * scale2 - lse_c[:, None]), 0.0)
            acc += mm(p.to(kc.dtype), uc.to(kc.dtype), PREC, UP)
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
@triton.jit(do_not_specialize=["T", "Tk"])
def deltaformer_psi_kernel(k, beta, lse, du, psi, scale, T, Tk, H: tl.constexpr, K: tl.constexpr,
                           V: tl.constexpr, C: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
                           BV: tl.constexpr, PREC: tl.constexpr, UP: tl.constexpr):
    """Grid (cdiv(V, BV), B*H): psi [B, T, H, V] float32 = (I + A)^-T dU of the new positions (du [B, T, H, V]
    float32), chunk by chunk from the last one."""
    i_v, i_bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    T0 = Tk - T
    o_c, o_k = tl.arange(0, C), tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    kb = k + (i_b * Tk * H + i_h) * K
    pb = psi + (i_b * T * H + i_h) * V
    db = du + (i_b * T * H + i_h) * V
    scale2 = scale * 1.4426950408889634
    NC = tl.cdiv(T, C)
    for i in range(0, NC):
        c = NC - 1 - i
        rows = c * C + o_c
        m = rows < T
        kc = tl.load(kb + (T0 + rows)[:, None] * (H * K) + o_k[None, :], mask=m[:, None] & (o_k[None, :] < K),
                     other=0.0)
        lse_c = tl.load(lse + i_bh * T + rows, mask=m, other=float("inf"))
        b_c = tl.load(beta + (i_b * T + rows) * H + i_h, mask=m, other=0.0).to(tl.float32)
        acc = tl.zeros([C, BV], dtype=tl.float32)  # sum over later rows t of b_t kappa_tc^T psi_t
        for t0 in range((c + 1) * C, T, BM):
            tr = t0 + tl.arange(0, BM)
            mt = tr < T
            kt = tl.load(kb + (T0 + tr)[:, None] * (H * K) + o_k[None, :], mask=mt[:, None] & (o_k[None, :] < K),
                         other=0.0)
            lse_t = tl.load(lse + i_bh * T + tr, mask=mt, other=float("inf"))
            b_t = tl.load(beta + (i_b * T + tr) * H + i_h, mask=mt, other=0.0).to(tl.float32)
            w = tl.load(pb + tr[:, None] * (H * V) + o_v[None, :], mask=mt[:, None] & (o_v[None, :] < V),
                        other=0.0) * b_t[:, None]
            p = tl.exp2(mm(kt, tl.trans(kc), PREC, UP) * scale2 - lse_t[:, None])  # [BM, C]; padding rows: 0
            acc += mm(tl.trans(p).to(kc.dtype), w.to(kc.dtype), PREC, UP)
        L = _chunk_kernel_rows(kc, lse_c, scale2, C, PREC, UP)
        inv = unit_lower_inverse(b_c[:, None] * L, C, PREC)
        m_cv = m[:, None] & (o_v[None, :] < V)
        rhs = tl.load(db + rows[:, None] * (H * V) + o_v[None, :], mask=m_cv, other=0.0) - acc
        tl.store(pb + rows[:, None] * (H * V) + o_v[None, :], mm(tl.trans(inv), rhs, PREC, False), mask=m_cv)
        tl.debug_barrier()  # earlier chunks read these psi's (written by other threads of this program)
