"""Flash-attention kernels (forward and backward) for softmax attention with a cumulative log-gate bias.

Per query head h, for query i at absolute position p_i = T0 + i (T0 = Tk - Tq cached keys before the queries)
and key j at position j,

    s_ij = scale q_i . k_j + G_{p_i} - G_j        for j <= p_i (and p_i - j < W with a sliding window W)
    o_i  = sum_j softmax_j(s_ij) v_j

with G = cumsum(g) over all Tk positions (the FoX bias). Without gates (HAS_GATE false: deltaformer's attention
passes) the kernels add no bias, read no G and leave dG alone: plain causal attention. Key/value head
h // (H / H_kv) serves query head h (grouped-query attention).

Online softmax over key blocks (memory linear in T: no Tq x Tk tile is stored). The forward keeps only o and the
per-row log-sum-exp (in base 2: the kernels exponentiate with exp2, the logits pre-multiplied by log2 e).

Backward (P the probabilities, recomputed from the log-sum-exp; delta_i = sum_v dO_iv O_iv = sum_j P_ij dP_ij):

    dP = dO V^T,   dS = P (dP - delta),   dQ = scale dS K,   dK = scale dS^T Q,   dV = P^T dO,
    dG_r = sum_l dS_il [query i at position r] - sum_i dS_ir      (row sums minus column sums)

The row sums vanish in exact arithmetic (a softmax does not change when a constant is added to a row) but are
kept: with delta from O rounded to bf16 they cancel the error that delta puts into the column sums, which the
reverse cumulative sum of dG (the caller's cumsum, differentiated by autograd, gives dg) would otherwise gather.

G is read in float64: for a tile of query rows and the key block starting at n, the bias is formed as
(G_{p_i} - G_n) - (G_j - G_n), each difference rounded to float32 once, so its error is relative to the
difference itself and not to |G| (which grows without bound with T: float32 G alone would lose ~1e-4 absolute at
|G| ~ 1e3). The column terms G_j - G_n are formed once per call for the whole sequence (fox_gate_columns_kernel)
and read as float32; the row terms take a [BM] float64 subtraction per tile; the [BM, BN] work stays float32. The
row term G_{p_i} - G_n is a constant of the row: it joins the row's running maximum (forward) or its log-sum-exp
(backward) as [BM] work, so each logit costs one fused multiply-add for the scale and the bias's column term.

Kernels: the forward (a program per query block and batch*query head), delta (rowsum(dO O), same grid), the dK/dV
kernel (a program per key block and batch*key/value head, looping over the query heads of its group and the query
blocks that see the key block, so dK and dV accumulate in registers without atomics; its tiles are transposed, keys
along the rows, see :func:`_dkv_blocks`), and the dQ kernel (a program per query block and batch*query head); before
the forward, two small ones: the bias's column terms (fox_gate_columns_kernel, also before dQ) and the cleaned values
the forward's masked blocks read (fox_clean_values_kernel). Each loop over blocks is split into the blocks that need
the causal / window / bounds mask and those that are entirely visible (no mask work there).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..common.triton_launch import fast_launch
from ..common.triton_masking import nonfinite_rows
from ..common.triton_utils import mm


@triton.jit
def _sees(pos, cols, Tk, W, HAS_WINDOW: tl.constexpr):
    """Whether queries at positions ``pos`` see keys ``cols`` (causal, window, keys that exist), for any two
    tensors that broadcast against each other."""
    vis = (cols <= pos) & (cols < Tk)
    if HAS_WINDOW:
        vis = vis & (pos - cols < W)
    return vis


@triton.jit
def _visible(pos, cols, Tk, W, HAS_WINDOW: tl.constexpr):
    """[rows, cols] mask of the keys each query row sees."""
    return _sees(pos[:, None], cols[None, :], Tk, W, HAS_WINDOW)


@triton.jit
def _offset(Tq, Tk, STRICT: tl.constexpr):
    """Position of query row 0 for the visibility rule key j <= position: T0 = Tk - Tq, or T0 - 1 with STRICT
    (keys strictly before the query, as DeltaFormer's kernel rows)."""
    if STRICT:
        return Tk - Tq - 1
    else:
        return Tk - Tq


@triton.jit
def _load(ptr, m_a, m_b, MASKED: tl.constexpr):
    """A tile load; the masks (zero fill) only where some element may lie outside (MASKED), so the blocks inside
    the visible band with whole head dims load without predicates."""
    if MASKED:
        return tl.load(ptr, mask=m_a & m_b, other=0.0)
    else:
        return tl.load(ptr)


@triton.jit
def _gate_cols(Gk, n, cols, Tk):
    """(G_n in float64, the bias's column term G_j - G_n [BN] of key block n in float32 log2 units)."""
    ref = tl.load(Gk + n)
    gc = tl.load(Gk + cols, mask=cols < Tk, other=ref)
    return ref, (gc - ref).to(tl.float32) * 1.4426950408889634


@fast_launch
@triton.jit(do_not_specialize=["Tk"])
def fox_gate_columns_kernel(G, Gc, Tk, BN: tl.constexpr):
    """Grid (cdiv(Tk, BN), B*H): Gc [B, H, Tk] float32, the bias's column term (G_j - G_n) log2 e of each key j
    against the first key n of its block of BN (:func:`_gate_cols`), as the forward and dQ kernels' key blocks of BN
    use it."""
    i_n, i_bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    cols = i_n * BN + tl.arange(0, BN)
    _, col = _gate_cols(G + i_bh * Tk, i_n * BN, cols, Tk)
    tl.store(Gc + i_bh * Tk + cols, col, mask=cols < Tk)


@triton.jit
def _gate_terms(Grow, Gk, Gck, n, cols, Tk, MASK: tl.constexpr):
    """The bias of key block n as its row and column terms, (G_{p_i} - G_n) [rows] and (G_j - G_n) [BN], in
    float32 log2 units: the tile's bias is row[:, None] - col[None, :]. The row term from G in float64; the column
    term read from Gck, :func:`fox_gate_columns_kernel`'s output for blocks of this size (the same numbers as
    forming it here, without a [BN] float64 load, subtraction and conversion per step: each thread holds its own
    columns of the tile, so that work was repeated in every thread's registers). MASK: the block may reach past
    Tk (those columns are masked out of the logits, so any finite value does)."""
    row = (Grow - tl.load(Gk + n)).to(tl.float32) * 1.4426950408889634
    if MASK:
        col = tl.load(Gck + cols, mask=cols < Tk, other=0.0)
    else:
        col = tl.load(Gck + cols)
    return row, col


@triton.jit
def _gate_rows(Gk, Tk, Tq, rows, m_rows, HAS_GATE: tl.constexpr):
    """G [rows] at the query rows' own positions (float64), or zeros without gates (G is then not read)."""
    if HAS_GATE:
        return tl.load(Gk + Tk - Tq + rows, mask=m_rows, other=0.0)
    else:
        return tl.zeros(rows.shape, dtype=tl.float64)


@triton.jit
def _fwd_blocks(acc, m_i, l_i, bad, qt, Grow, pos, kb, vb, vcb, flb, k0, Gk, Gck, start, end, Tk, W, scale2,
                KS: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                BV: tl.constexpr, MASK: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_GATE: tl.constexpr,
                PREC: tl.constexpr, UP: tl.constexpr):
    """Online softmax over key blocks [start, end) (steps of BN); MASK: apply the visibility mask.

    In a masked block a hidden key's probability is 0, but 0 x NaN = NaN inside P V: such blocks read the values
    from vcb, :func:`fox_clean_values_kernel`'s copy of the keys from k0 on with non-finite rows zeroed, and its
    flags flb of those rows; ``bad`` [BM] records which rows see a flagged value (their output is set to NaN at the
    end), so a non-finite value reaches no earlier query (common/triton_masking.py). In an unmasked block every row
    sees every value and the product propagates it. (Cleaning the value tile in registers here instead made Triton
    3.6 wait for each tensor-core product before issuing the next, in every loop of the kernel.)"""
    o_k, o_v = tl.arange(0, BK), tl.arange(0, BV)
    for n in range(start, end, BN):
        cols = n + tl.arange(0, BN)
        kt = _load(kb + cols[None, :] * (KS * K) + o_k[:, None], o_k[:, None] < K, cols[None, :] < Tk,
                   MASK or BK != K)
        if MASK:
            vt = _load(vcb + (cols - k0)[:, None] * (KS * V) + o_v[None, :], cols[:, None] < Tk, o_v[None, :] < V,
                       True)
        else:
            vt = _load(vb + cols[:, None] * (KS * V) + o_v[None, :], cols[:, None] < Tk, o_v[None, :] < V, BV != V)
        # s holds the logits less the bias's row term (one fused multiply-add per element): the row term is a
        # constant of the row, added to the [BM] maximum instead of to every element
        s = mm(qt, kt, PREC, UP) * scale2
        if HAS_GATE:
            row, col = _gate_terms(Grow, Gk, Gck, n, cols, Tk, MASK)
            s = s - col[None, :]
        if MASK:
            vis = _visible(pos, cols, Tk, W, HAS_WINDOW)
            s = tl.where(vis, s, float("-inf"))
            col_bad = tl.load(flb + cols - k0, mask=cols < Tk, other=0) != 0  # [BN]: the value row is not finite
            if HAS_WINDOW:
                bad = bad | (tl.max(tl.where(vis, col_bad[None, :].to(tl.int32), 0), axis=1) > 0)
            else:
                # causal alone: a row sees a flagged key of the block iff the block's first one is at or before
                # its position ([BM] work instead of a [BM, BN] reduction)
                first = tl.min(tl.where(col_bad, cols, 2147483647), axis=0)
                bad = bad | (pos >= first)
        if HAS_GATE:
            m_new = tl.maximum(m_i, tl.max(s, axis=1) + row)
            shift = m_new - row
        else:
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            shift = m_new
        p = tl.exp2(s - shift[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + mm(p.to(vt.dtype), vt, PREC, UP)
        m_i = m_new
    return acc, m_i, l_i, bad


@fast_launch
@triton.jit(do_not_specialize=["Tk", "k0"])
def fox_clean_values_kernel(v, vc, flags, Tk, k0, HKV: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                            BV: tl.constexpr):
    """Grid (cdiv(Tk - k0, BT), B*H_kv): for the keys j in [k0, Tk), flags [B, H_kv, Tk - k0] int8 = 1 where value row
    j holds a NaN or an infinity, and vc [B, Tk - k0, H_kv, V] the value rows with those rows zeroed: what the
    forward's masked blocks read (:func:`_fwd_blocks`)."""
    i_t, i_bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    i_b, i_h = i_bh // HKV, i_bh % HKV
    Tc = Tk - k0
    r = i_t * BT + tl.arange(0, BT)
    o_v = tl.arange(0, BV)
    m = (r[:, None] < Tc) & (o_v[None, :] < V)
    x = tl.load(v + ((i_b * Tk + k0 + r[:, None]) * HKV + i_h) * V + o_v[None, :], mask=m, other=0.0)
    row_bad = nonfinite_rows(x) > 0
    tl.store(vc + ((i_b * Tc + r[:, None]) * HKV + i_h) * V + o_v[None, :], tl.where(row_bad[:, None], 0.0, x), mask=m)
    tl.store(flags + i_bh * Tc + r, row_bad.to(tl.int8), mask=r < Tc)


@triton.jit
def _key_ranges(p_first, p_last, W, HAS_WINDOW: tl.constexpr, BN: tl.constexpr):
    """Key blocks of the query rows at positions p_first .. p_last: [lo, mid_lo) masked (window edge),
    [mid_lo, mid_hi) entirely visible, [mid_hi, hi) masked (diagonal); lo is a multiple of BN."""
    hi = p_last + 1
    if HAS_WINDOW:
        lo = (tl.maximum(p_first - W + 1, 0) // BN) * BN
        full_start = ((tl.maximum(p_last - W + 1, 0) + BN - 1) // BN) * BN
    else:
        lo = p_first * 0
        full_start = lo
    full_end = ((p_first + 1) // BN) * BN
    mid_lo = tl.minimum(full_start, hi)
    mid_hi = tl.maximum(full_end, mid_lo)
    return lo, mid_lo, mid_hi, hi


@fast_launch
@triton.jit(do_not_specialize=["Tq", "Tk", "W", "k0"])
def fox_fwd_kernel(q, k, v, vc, flags, G, Gc, o, lse, scale, Tq, Tk, W, k0, H: tl.constexpr, HKV: tl.constexpr,
                   K: tl.constexpr, V: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                   BV: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_GATE: tl.constexpr, STRICT: tl.constexpr,
                   PREC: tl.constexpr, UP: tl.constexpr):
    """Grid (cdiv(Tq, BM), B*H): o [B, Tq, H, V] and lse [B, H, Tq] (base 2) of one query block; a row that sees
    no key (STRICT, the first position) gets o = 0 and lse = +inf (its probabilities are 0 in backward). Gc: the
    bias's column terms for key blocks of BN (:func:`fox_gate_columns_kernel`); vc, flags: the values of the keys
    from k0 on (every key a masked block may reach) cleaned, and their flags (:func:`fox_clean_values_kernel`).
    Without HAS_GATE, G and Gc are not read (any pointers)."""
    # the last query blocks first: a causal program's work grows with its block's index, and the light ones left
    # for the end fill the last wave of programs
    i_m, i_bh = tl.num_programs(0) - 1 - tl.program_id(0), tl.program_id(1).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    i_hk = i_h // (H // HKV)
    T0 = _offset(Tq, Tk, STRICT)
    rows = i_m * BM + tl.arange(0, BM)
    m_rows = rows < Tq
    pos = T0 + rows
    o_k, o_v = tl.arange(0, BK), tl.arange(0, BV)
    qb = q + (i_b * Tq * H + i_h) * K
    qt = tl.load(qb + rows[:, None] * (H * K) + o_k[None, :], mask=m_rows[:, None] & (o_k[None, :] < K), other=0.0)
    Gk, Gck = G + i_bh * Tk, Gc + i_bh * Tk
    Grow = _gate_rows(Gk, Tk, Tq, rows, m_rows, HAS_GATE)
    kb = k + (i_b * Tk * HKV + i_hk) * K
    vb = v + (i_b * Tk * HKV + i_hk) * V
    vcb = vc + (i_b * (Tk - k0) * HKV + i_hk) * V
    flb = flags + (i_b * HKV + i_hk) * (Tk - k0)
    scale2 = scale * 1.4426950408889634
    p_first = T0 + i_m * BM
    p_last = tl.minimum(p_first + BM - 1, T0 + Tq - 1)
    lo, mid_lo, mid_hi, hi = _key_ranges(p_first, p_last, W, HAS_WINDOW, BN)
    acc = tl.zeros([BM, BV], dtype=tl.float32)
    # -1e30, not -inf: a row may see no key of a block (window edge), and exp2(-inf - -inf) would be NaN
    m_i = tl.full([BM], -1e30, dtype=tl.float32)
    l_i = tl.zeros([BM], dtype=tl.float32)
    bad = rows < 0  # [BM] all False: rows that see a non-finite value in a masked block
    acc, m_i, l_i, bad = _fwd_blocks(acc, m_i, l_i, bad, qt, Grow, pos, kb, vb, vcb, flb, k0, Gk, Gck, lo, mid_lo,
                                     Tk, W, scale2, HKV, K, V, BN, BK, BV, True, HAS_WINDOW, HAS_GATE, PREC, UP)
    acc, m_i, l_i, bad = _fwd_blocks(acc, m_i, l_i, bad, qt, Grow, pos, kb, vb, vcb, flb, k0, Gk, Gck, mid_lo, mid_hi,
                                     Tk, W, scale2, HKV, K, V, BN, BK, BV, False, HAS_WINDOW, HAS_GATE, PREC, UP)
    acc, m_i, l_i, bad = _fwd_blocks(acc, m_i, l_i, bad, qt, Grow, pos, kb, vb, vcb, flb, k0, Gk, Gck, mid_hi, hi,
                                     Tk, W, scale2, HKV, K, V, BN, BK, BV, True, HAS_WINDOW, HAS_GATE, PREC, UP)
    empty = l_i == 0.0  # padding rows (not stored), and with STRICT the first position
    l_safe = tl.where(empty, 1.0, l_i)
    out = tl.where(bad[:, None], float("nan"), acc / l_safe[:, None])
    tl.store(o + (i_b * Tq * H + i_h) * V + rows[:, None] * (H * V) + o_v[None, :], out.to(o.dtype.element_ty),
             mask=m_rows[:, None] & (o_v[None, :] < V))
    tl.store(lse + i_bh * Tq + rows, tl.where(empty, float("inf"), m_i + tl.log2(l_safe)), mask=m_rows)


@fast_launch
@triton.jit(do_not_specialize=["Tq"])
def fox_delta_kernel(o, do, delta, Tq, H: tl.constexpr, V: tl.constexpr, BM: tl.constexpr, BV: tl.constexpr):
    """Grid (cdiv(Tq, BM), B*H): delta [B, H, Tq] = rowsum(dO O) in float32."""
    i_m, i_bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    rows = i_m * BM + tl.arange(0, BM)
    o_v = tl.arange(0, BV)
    m = (rows[:, None] < Tq) & (o_v[None, :] < V)
    off = (i_b * Tq * H + i_h) * V + rows[:, None] * (H * V) + o_v[None, :]
    x = tl.load(o + off, mask=m, other=0.0).to(tl.float32) * tl.load(do + off, mask=m, other=0.0).to(tl.float32)
    tl.store(delta + i_bh * Tq + rows, tl.sum(x, axis=1), mask=rows < Tq)


@triton.jit
def _dkv_blocks(dk, dv, dGc, kt, vt, cols, ref, col, qb, dob, lseb, deltab, Gk, start, end, T0, Tq, Tk, W, scale2,
                H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
                BV: tl.constexpr, MASK: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_GATE: tl.constexpr,
                PREC: tl.constexpr, UP: tl.constexpr):
    """dK, dV and the column sums of dS of one key block over query blocks [start, end) (steps of BM).

    Computed transposed, keys along the tiles' rows (S^T = K Q^T, [BN, BM]): P^T and dS^T are then the left
    operands of dV += P^T dO and dK += dS^T Q as they come out of the products, with no transpose of a register
    tile between them, and the column sums of dS are sums along the tiles' rows. ``ref``, ``col``: the key block's
    G_n and bias column term (:func:`_gate_cols`), the same for every query block, so formed once by the caller."""
    o_k, o_v = tl.arange(0, BK), tl.arange(0, BV)
    for r in range(start, end, BM):
        rows = r + tl.arange(0, BM)
        m_rows = rows < Tq
        q_t = tl.load(qb + rows[None, :] * (H * K) + o_k[:, None], mask=m_rows[None, :] & (o_k[:, None] < K),
                      other=0.0)  # [BK, BM]
        dot_ = tl.load(dob + rows[:, None] * (H * V) + o_v[None, :], mask=m_rows[:, None] & (o_v[None, :] < V),
                       other=0.0)
        # padding rows: lse = +inf gives P = 0, so they add nothing
        lse_r = tl.load(lseb + rows, mask=m_rows, other=float("inf"))
        delta_r = tl.load(deltab + rows, mask=m_rows, other=0.0)
        pos = T0 + rows
        s = mm(kt, q_t, PREC, UP) * scale2  # [BN, BM]
        if HAS_GATE:  # the bias's row term joins the row's log-sum-exp ([BM] work), as in the forward
            row = (_gate_rows(Gk, Tk, Tq, rows, m_rows, HAS_GATE) - ref).to(tl.float32) * 1.4426950408889634
            s = s - col[:, None]
            lse_r = lse_r - row
        if MASK:
            s = tl.where(_sees(pos[None, :], cols[:, None], Tk, W, HAS_WINDOW), s, float("-inf"))
        p = tl.exp2(s - lse_r[None, :])  # P^T [BN, BM]
        dv += mm(p.to(dot_.dtype), dot_, PREC, UP)
        dp = mm(vt, tl.trans(dot_), PREC, UP)
        ds = p * (dp - delta_r[None, :])  # dS^T
        dk += mm(ds.to(q_t.dtype), tl.trans(q_t), PREC, UP)
        if HAS_GATE:
            dGc -= tl.sum(ds, axis=1)
    return dk, dv, dGc


@fast_launch
@triton.jit(do_not_specialize=["Tq", "Tk", "W"])
def fox_dkv_kernel(q, k, v, G, do, lse, delta, dk, dv, dG, scale, Tq, Tk, W, H: tl.constexpr, HKV: tl.constexpr,
                   K: tl.constexpr, V: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                   BV: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_GATE: tl.constexpr, STRICT: tl.constexpr,
                   PREC: tl.constexpr, UP: tl.constexpr):
    """Grid (cdiv(Tk, BN), B*H_kv): dk, dv of one key block (summed over the query heads of the group) and
    dG [B, H, Tk] = -(column sums of dS) per query head (the dQ kernel adds the row sums); without HAS_GATE,
    G and dG are neither read nor written."""
    i_n, i_bhk = tl.program_id(0), tl.program_id(1).to(tl.int64)
    i_b, i_hk = i_bhk // HKV, i_bhk % HKV
    GROUP: tl.constexpr = H // HKV
    T0 = _offset(Tq, Tk, STRICT)
    n = i_n * BN
    cols = n + tl.arange(0, BN)
    m_cols = cols < Tk
    o_k, o_v = tl.arange(0, BK), tl.arange(0, BV)
    kb = k + (i_b * Tk * HKV + i_hk) * K
    vb = v + (i_b * Tk * HKV + i_hk) * V
    kt = tl.load(kb + cols[:, None] * (HKV * K) + o_k[None, :], mask=m_cols[:, None] & (o_k[None, :] < K), other=0.0)
    vt = tl.load(vb + cols[:, None] * (HKV * V) + o_v[None, :], mask=m_cols[:, None] & (o_v[None, :] < V), other=0.0)
    scale2 = scale * 1.4426950408889634
    # query rows that see a key of this block: positions n .. last key (+ W - 1 with a window)
    n_last = tl.minimum(n + BN - 1, Tk - 1)
    r_lo = ((tl.maximum(n - T0, 0)) // BM) * BM
    if HAS_WINDOW:
        r_hi = tl.minimum(n_last + W - T0, Tq)
        reach = n + W - T0 - BM  # blocks starting at r <= reach have every row within the window of key n
        full_end = tl.where(reach >= 0, (reach // BM + 1) * BM, 0)
    else:
        r_hi = Tq
        full_end = ((Tq + BM - 1) // BM) * BM
    full_start = ((tl.maximum(n + BN - 1 - T0, 0) + BM - 1) // BM) * BM  # rows at or past every key of the block
    mid_lo = tl.minimum(tl.maximum(full_start, r_lo), r_hi)
    mid_hi = tl.maximum(tl.minimum(full_end, r_hi), mid_lo)
    dk_acc = tl.zeros([BN, BK], dtype=tl.float32)
    dv_acc = tl.zeros([BN, BV], dtype=tl.float32)
    for gi in range(GROUP):
        i_h = i_hk * GROUP + gi
        i_bh = i_b * H + i_h
        qb = q + (i_b * Tq * H + i_h) * K
        dob = do + (i_b * Tq * H + i_h) * V
        Gk = G + i_bh * Tk
        dGc = tl.zeros([BN], dtype=tl.float32)
        if HAS_GATE:
            ref, col = _gate_cols(Gk, n, cols, Tk)
        else:  # not read
            ref, col = 0.0, dGc
        dk_acc, dv_acc, dGc = _dkv_blocks(dk_acc, dv_acc, dGc, kt, vt, cols, ref, col, qb, dob, lse + i_bh * Tq,
                                          delta + i_bh * Tq, Gk, r_lo, mid_lo, T0, Tq, Tk, W, scale2, H, K, V, BM,
                                          BK, BV, True, HAS_WINDOW, HAS_GATE, PREC, UP)
        dk_acc, dv_acc, dGc = _dkv_blocks(dk_acc, dv_acc, dGc, kt, vt, cols, ref, col, qb, dob, lse + i_bh * Tq,
                                          delta + i_bh * Tq, Gk, mid_lo, mid_hi, T0, Tq, Tk, W, scale2, H, K, V, BM,
                                          BK, BV, False, HAS_WINDOW, HAS_GATE, PREC, UP)
        dk_acc, dv_acc, dGc = _dkv_blocks(dk_acc, dv_acc, dGc, kt, vt, cols, ref, col, qb, dob, lse + i_bh * Tq,
                                          delta + i_bh * Tq, Gk, mid_hi, r_hi, T0, Tq, Tk, W, scale2, H, K, V, BM,
                                          BK, BV, True, HAS_WINDOW, HAS_GATE, PREC, UP)
        if HAS_GATE:
            tl.store(dG + i_bh * Tk + cols, dGc.to(dG.dtype.element_ty), mask=m_cols)
    tl.store(dk + (i_b * Tk * HKV + i_hk) * K + cols[:, None] * (HKV * K) + o_k[None, :],
             (dk_acc * scale).to(dk.dtype.element_ty), mask=m_cols[:, None] & (o_k[None, :] < K))
    tl.store(dv + (i_b * Tk * HKV + i_hk) * V + cols[:, None] * (HKV * V) + o_v[None, :],
             dv_acc.to(dv.dtype.element_ty), mask=m_cols[:, None] & (o_v[None, :] < V))


@triton.jit
def _dq_blocks(dq, dGr, qt, dot_, lse_r, delta_r, Grow, pos, kb, vb, Gk, Gck, start, end, Tk, W, scale2,
               KS: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
               MASK: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_GATE: tl.constexpr, PREC: tl.constexpr,
               UP: tl.constexpr):
    """dQ (before the factor scale) and the row sums of dS of one query block over key blocks [start, end)."""
    o_k, o_v = tl.arange(0, BK), tl.arange(0, BV)
    for n in range(start, end, BN):
        cols = n + tl.arange(0, BN)
        kc = _load(kb + cols[:, None] * (KS * K) + o_k[None, :], cols[:, None] < Tk, o_k[None, :] < K,
                   MASK or BK != K)
        vt = _load(vb + cols[None, :] * (KS * V) + o_v[:, None], o_v[:, None] < V, cols[None, :] < Tk,
                   MASK or BV != V)
        s = mm(qt, tl.trans(kc), PREC, UP) * scale2
        shift = lse_r
        if HAS_GATE:
            row, col = _gate_terms(Grow, Gk, Gck, n, cols, Tk, MASK)
            s = s - col[None, :]
            shift = lse_r - row
        if MASK:
            s = tl.where(_visible(pos, cols, Tk, W, HAS_WINDOW), s, float("-inf"))
        p = tl.exp2(s - shift[:, None])
        dp = mm(dot_, vt, PREC, UP)
        ds = p * (dp - delta_r[:, None])
        dq += mm(ds.to(kc.dtype), kc, PREC, UP)
        if HAS_GATE:
            dGr += tl.sum(ds, axis=1)
    return dq, dGr


@fast_launch
@triton.jit(do_not_specialize=["Tq", "Tk", "W"])
def fox_dq_kernel(q, k, v, G, Gc, do, lse, delta, dq, dG, scale, Tq, Tk, W, H: tl.constexpr, HKV: tl.constexpr,
                  K: tl.constexpr, V: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                  BV: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_GATE: tl.constexpr, STRICT: tl.constexpr,
                  PREC: tl.constexpr, UP: tl.constexpr):
    """Grid (cdiv(Tq, BM), B*H): dq of one query block; adds the row sums of dS to dG at the query positions
    (with HAS_GATE). Gc: the bias's column terms for key blocks of BN, as in the forward."""
    # the last query blocks first, as in the forward
    i_m, i_bh = tl.num_programs(0) - 1 - tl.program_id(0), tl.program_id(1).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    i_hk = i_h // (H // HKV)
    T0 = _offset(Tq, Tk, STRICT)
    rows = i_m * BM + tl.arange(0, BM)
    m_rows = rows < Tq
    pos = T0 + rows
    o_k, o_v = tl.arange(0, BK), tl.arange(0, BV)
    m_qk = m_rows[:, None] & (o_k[None, :] < K)
    qt = tl.load(q + (i_b * Tq * H + i_h) * K + rows[:, None] * (H * K) + o_k[None, :], mask=m_qk, other=0.0)
    dot_ = tl.load(do + (i_b * Tq * H + i_h) * V + rows[:, None] * (H * V) + o_v[None, :],
                   mask=m_rows[:, None] & (o_v[None, :] < V), other=0.0)
    lse_r = tl.load(lse + i_bh * Tq + rows, mask=m_rows, other=float("inf"))
    delta_r = tl.load(delta + i_bh * Tq + rows, mask=m_rows, other=0.0)
    Gk, Gck = G + i_bh * Tk, Gc + i_bh * Tk
    Grow = _gate_rows(Gk, Tk, Tq, rows, m_rows, HAS_GATE)
    kb = k + (i_b * Tk * HKV + i_hk) * K
    vb = v + (i_b * Tk * HKV + i_hk) * V
    scale2 = scale * 1.4426950408889634
    p_first = T0 + i_m * BM
    p_last = tl.minimum(p_first + BM - 1, T0 + Tq - 1)
    lo, mid_lo, mid_hi, hi = _key_ranges(p_first, p_last, W, HAS_WINDOW, BN)
    acc = tl.zeros([BM, BK], dtype=tl.float32)
    dGr = tl.zeros([BM], dtype=tl.float32)
    acc, dGr = _dq_blocks(acc, dGr, qt, dot_, lse_r, delta_r, Grow, pos, kb, vb, Gk, Gck,
                          lo, mid_lo, Tk, W, scale2, HKV, K, V, BN, BK, BV, True, HAS_WINDOW,
                          HAS_GATE, PREC, UP)
    acc, dGr = _dq_blocks(acc, dGr, qt, dot_, lse_r, delta_r, Grow, pos, kb, vb, Gk, Gck,
                          mid_lo, mid_hi, Tk, W, scale2, HKV, K, V, BN, BK, BV, False,
                          HAS_WINDOW, HAS_GATE, PREC, UP)
    acc, dGr = _dq_blocks(acc, dGr, qt, dot_, lse_r, delta_r, Grow, pos, kb, vb, Gk, Gck,
                          mid_hi, hi, Tk, W, scale2, HKV, K, V, BN, BK, BV, True, HAS_WINDOW,
                          HAS_GATE, PREC, UP)
    tl.store(dq + (i_b * Tq * H + i_h) * K + rows[:, None] * (H * K) + o_k[None, :],
             (acc * scale).to(dq.dtype.element_ty), mask=m_qk)
    # dG = row sums - column sums: the column sums are there already (the dK/dV kernel ran first). The row sums
    # vanish in exact arithmetic; kept, they cancel the column sums' share of the error of delta (from O rounded
    # to bf16), which the reverse cumulative sum of dG would otherwise gather (sum_r dG_r = 0 exactly)
    if HAS_GATE:
        dG_old = tl.load(dG + i_bh * Tk + Tk - Tq + rows, mask=m_rows, other=0.0)
        tl.store(dG + i_bh * Tk + Tk - Tq + rows, dG_old + dGr.to(dG.dtype.element_ty), mask=m_rows)
