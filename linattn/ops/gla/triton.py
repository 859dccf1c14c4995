"""Triton kernels (forward and backward) for gated linear attention (a decay per key channel).

    S_t = diag(exp(g_t)) S_{t-1} + k_t v_t^T,        o_t = S_t^T (scale q_t),      g_t in R^K, g <= 0

Forward, chunkwise. b_t in R^K is the cumulative log gate restarted at each chunk (b <= 0), L = b of
the chunk's last token, S the state entering the chunk, q~ = scale q:

    o_t  = (q~_t ⊙ e^{b_t})^T S + sum_{s<=t} A_ts v_s,       A_ts = sum_k q~_tk k_sk e^{b_tk - b_sk}
    S'   = e^{L} ⊙ S + sum_s (k_s ⊙ e^{L - b_s}) v_s^T          (e^{L} ⊙ S scales row k by e^{L_k})

Intra-chunk scores, stable for any gate: e^{b_t - b_s} cannot be split as e^{b_t} e^{-b_s} (e^{-b_s}
overflows at strong decay). Each chunk is cut into sub-chunks of 16 tokens; with r the last token
before sub-chunk i (b_r = 0 for i = 0), for t in sub-chunk i and s <= r

    e^{b_t - b_s} = e^{b_t - b_r} e^{b_r - b_s},

two factors <= 1, so each 16 x 16 block of A is one matmul (q~_t e^{b_t - b_r}) (k_s e^{b_r - b_s})^T
(the key blocks are visited from the nearest back, carrying b_r - b_s as a running sum of g). The
diagonal blocks (s, t in the same sub-chunk) are the same matmul when the sub-chunk's gate spread
max_k (b_r - b_last) is <= FACTOR_LIMIT = 30 (then e^{b_r - b_s} <= e^30, finite; typical gates);
otherwise (e.g. g = -20) they are summed explicitly over the key channels with e^{b_t - b_s}, s <= t,
one key at a time. The choice is made per sub-chunk at run time (fp16, which cannot hold e^30 k,
always sums explicitly). Every other exponent is <= 0 (masked entries are replaced before exp), so
g = -20 and any T are safe.

Accuracy. Each exponent b_t - b_s is computed as a sum of g over the tokens between s and t
(cumulative sums from the reference token: forward ones for queries, reverse ones for keys, running
sums across sub-chunks and in the explicit diagonal loops), never as a difference of two in-chunk
cumulative sums: at g = -20 those reach ~1000 and their float32 difference is off by ~1e-4 absolute,
i.e. a weak decay after strong ones would carry ~1e-5 relative error (as the PyTorch chunk backend
does). Since g <= 0, every partial sum is bounded by the exponent itself, so its rounding error is
relative to the exponent.

Backward. dH: gradient of the state leaving the chunk; dA_ts = do_t . v_s for s <= t (0 above):

    dS     = e^{L} ⊙ dH + sum_t (q~_t ⊙ e^{b_t}) do_t^T                        (state scan, reversed)
    dv_s   = sum_{t>=s} A_ts do_t + dH^T (k_s ⊙ e^{L - b_s})
    dq_t   = scale [ e^{b_t} ⊙ (S do_t) + sum_{s<=t} dA_ts k_s ⊙ e^{b_t - b_s} ]
    dk_s   = e^{L - b_s} ⊙ (dH v_s) + sum_{t>=s} dA_ts q~_t ⊙ e^{b_t - b_s}

(the intra sums use the same sub-chunk split and the same choice for the diagonal blocks: for dk,
with e the last token of the key's sub-chunk and t > e, e^{b_t - b_s} = e^{b_t - b_e} e^{b_e - b_s}).

Gate gradient. The chunk's outputs and S' depend on g only through b (g of a chunk moves only that
chunk's b), and b_t = sum_{u<=t} g_u, so dg_t = sum_{u>=t in chunk} db_u. Differentiating the forward
equations channel by channel: every term e^{b_tk - b_sk} q_tk k_sk (and e^{b_tk} q_tk S_k.) contributes
its own value times +1 to db_t and -1 to db_s, and those values are exactly the summands of q_tk dq_tk
and k_sk dk_sk. The chunk end L = b_{C} appears in e^{L} ⊙ S and e^{L - b_s}; hence

    db_t = q_t ⊙ dq_t - k_t ⊙ dk_t   (+ dL at the chunk's last token),
    dL   = e^{L} ⊙ rowsum(S ⊙ dH) + sum_s k_s ⊙ dk_s^inter,   dk_s^inter = e^{L - b_s} ⊙ (dH v_s),

and dg is the reverse cumulative sum of db inside every chunk (the padded tail of the last chunk has
g = 0, so its b equals the last real token's and dL may sit on any row at or after it).

Kernels (each reads g and forms the cumulative gates it needs in registers): the state scan (a
program per key block, value block and batch-head, looping over chunks); the intra-chunk scores A (a
program per sub-chunk, chunk and batch-head, block by block); the output (a program per value block, chunk and
batch-head); the reverse scan of state gradients; the inter-chunk gradients (dv, dA, the inter parts
of dq and dk, dL; a program per chunk and batch-head, looping over value blocks); the intra-chunk
gradients (dq, dk and dg; a program per key block, chunk and batch-head, looping over its sub-chunks
backwards, each against the other sub-chunks block by block).
When a backward pass can follow, the forward keeps A for it (recomputed otherwise); the chunk states are
recomputed by the backward pass (one state scan): kept, they would be the largest tensor of a layer's activations
(B*H*N*K*V, twice q's size for K = V = 128 and chunks of 64), held in every layer until its backward pass. Block
shapes depend on the head dims and the chunk size only, never on T (T is not specialised on).
Packed sequences (B = 1) are read where they lie: every kernel takes its chunk's first token and token count from
the chunks' rows (common/triton_chunk_output.py's chunk_span, masking the rows past the count) and the state scans
run each sequence's own chunks."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common.scan_segments import Segments, plan_segments, segment_buffers, segment_ints, segment_table
from ..common.triton_chunk_output import chunk_count, chunk_span, chunk_state_dtype, scan_chunk, scan_tokens
from ..common.triton_launch import fast_launch
from ..common.triton_masking import causal_dot_rest
from ..common.triton_ops import gated_rnn_backend
from ..common.triton_scan_segments import fix_segments, scan_slices, scan_span
from ..common.triton_utils import block as _block
from ..common.triton_utils import (
    block_and_index,
    cdiv,
    dot_precision,
    launch_choice,
    launch_options,
    launch_overrides,
    mm,
    upcast_dots,
)

SUB = 16  # sub-chunk length of the intra-chunk scores
FACTOR_LIMIT = 30.0  # largest in-sub-chunk gate spread for which the diagonal blocks are factored


def _factor_limit(x: torch.Tensor) -> float:
    """fp16 cannot hold k e^{30} (max 65504): its diagonal blocks are always summed explicitly."""
    return -1.0 if x.dtype == torch.float16 else FACTOR_LIMIT


@triton.jit
def _rows(first, count, i_h, j, H: tl.constexpr):
    """Flat row index in a [B, T, H, *] tensor of head i_h's tokens at offsets j of a chunk that starts at token
    ``first`` (of all B * T) and holds ``count`` tokens (common/triton_chunk_output.py's chunk_span), and j < count."""
    return (first + j) * H + i_h, j < count


@triton.jit
def _load_rows(x, row, m_t, o_k, K: tl.constexpr):
    """x[rows, o_k] as float32 [len(row), BK]; 0 outside (so padded tokens have g = 0)."""
    return tl.load(x + row[:, None] * K + o_k[None, :], mask=m_t[:, None] & (o_k[None, :] < K), other=0.0
                   ).to(tl.float32)


@triton.jit
def _spread(m, offsets):
    """A scalar mask as a block shaped like ``offsets`` (Triton 3.9's interpreter rejects scalar masks
    on block loads, and scalar & block masks)."""
    return (offsets * 0 + m.to(tl.int32)) > 0


@triton.jit
def _load_row(x, row, m_t, o_k, K: tl.constexpr):
    """x[row, o_k] as float32 [BK] for one token; 0 outside."""
    return tl.load(x + row * K + o_k, mask=_spread(m_t, o_k) & (o_k < K), other=0.0).to(tl.float32)


@triton.jit
def _suffix(x):
    """sum over the rows after each row (exclusive reverse cumulative sum along axis 0)."""
    return tl.cumsum(x, axis=0, reverse=True) - x


@fast_launch
@triton.jit(do_not_specialize=["T", "NC", "PER_ROW", "LEN", "BASE"])
def _state_fwd_kernel(k, v, g, h, h0, ht, cu, rows, seg, lam, Lam, T, NC, PER_ROW, LEN, BASE, H: tl.constexpr,
                      K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                      HAS_H0: tl.constexpr, PACKED: tl.constexpr, SEGMENTED: tl.constexpr, PREC: tl.constexpr,
                      UP: tl.constexpr):
    """Grid (cdiv(V, BV), cdiv(K, BK), B*H; packed: S*H; segmented: segments*H): h[b, h, n] = state entering chunk n
    (NC chunks a row); ht = the final state. PACKED (packed sequences where they lie, chunk n's tokens from ``rows``:
    chunk_span): program s*H + h scans sequence s's chunks [cu[s], cu[s + 1]), from its initial state h0[s, h] to
    its final state ht[s, h]. SEGMENTED (common/scan_segments.py): program s*H + h scans segment s from zero (from
    h0 at its sequence's start) and stores its end state to ht[s, h] (E), its summed log decay to Lam[s, h] and each
    chunk's log decay from the segment's start to lam[.., h, n]: common/triton_scan_segments.py completes h. BASE: added
    to the program index along axis 2 (launches cut at the grid's limit, grid_slices)."""
    i_v, i_k, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64) + BASE
    i_h = i_bh % H
    N = NC
    c0, c1, i_b, i_hb, i_0, starts, _ = scan_span(cu, seg, i_bh, N, PER_ROW, LEN, H, PACKED, SEGMENTED)
    o_c = tl.arange(0, C)
    o_k, o_v = i_k * BK + tl.arange(0, BK), i_v * BV + tl.arange(0, BV)
    kv = o_k[:, None] * V + o_v[None, :]
    m_kv = (o_k[:, None] < K) & (o_v[None, :] < V)
    m_dec = (o_k < K) & (o_k * 0 + i_v == 0)  # one value block's programs store the decays
    S = tl.zeros([BK, BV], dtype=tl.float32)
    dec = tl.zeros([BK], dtype=tl.float32)  # SEGMENTED: the log decay since the segment's start
    if HAS_H0:
        if starts:
            S += tl.load(h0 + i_0 * K * V + kv, mask=m_kv, other=0.0).to(tl.float32)
    t_start, t_end = scan_tokens(rows, c0, c1, PACKED)  # the run's tokens, read once
    for n in range(c0, c1):
        tl.store(h + (i_hb * N + n) * K * V + kv, S.to(h.dtype.element_ty), mask=m_kv)
        first, count = scan_chunk(rows, n, c0, t_start, t_end, i_b, T, C, PACKED)
        row, m_t = _rows(first, count, i_h, o_c, H)
        gc = _load_rows(g, row, m_t, o_k, K)
        kc = tl.load(k + row[:, None] * K + o_k[None, :], mask=m_t[:, None] & (o_k[None, :] < K), other=0.0)
        vc = tl.load(v + row[:, None] * V + o_v[None, :], mask=m_t[:, None] & (o_v[None, :] < V), other=0.0)
        kw = (kc.to(tl.float32) * tl.exp(_suffix(gc))).to(vc.dtype)  # k_s e^{L - b_s}
        total = tl.sum(gc, axis=0)
        S = S * tl.exp(total)[:, None] + mm(tl.trans(kw), vc, PREC, UP)
        if SEGMENTED:
            tl.store(lam + (i_hb * N + n) * K + o_k, dec, mask=m_dec)
            dec += total
    tl.store(ht + i_bh * K * V + kv, S, mask=m_kv)
    if SEGMENTED:
        tl.store(Lam + i_bh * K + o_k, dec, mask=m_dec)


@fast_launch
@triton.jit(do_not_specialize=["T"])
def _scores_kernel(q, k, g, A, rows, scale, T, H: tl.constexpr, K: tl.constexpr, C: tl.constexpr, BK: tl.constexpr,
                   SUBC: tl.constexpr, LIMIT: tl.constexpr, PREC: tl.constexpr, UP: tl.constexpr,
                   PACKED: tl.constexpr):
    """Grid (C // SUBC * N, B*H) (common/triton_utils.py's block_and_index): the rows of sub-chunk i of A[t, s] (s, t
    in one chunk; 0 for s > t), one SUBC x SUBC block at a time."""
    i, n = block_and_index(C // SUBC)
    i_bh = tl.program_id(1).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    first, count = chunk_span(rows, n, i_b, T, C, PACKED)
    o_k, o_c = tl.arange(0, BK), tl.arange(0, SUBC)
    row_i, m_i = _rows(first, count, i_h, i * SUBC + o_c, H)
    qi = tl.load(q + row_i[:, None] * K + o_k[None, :], mask=m_i[:, None] & (o_k[None, :] < K), other=0.0)
    gi = _load_rows(g, row_i, m_i, o_k, K)
    ci = tl.cumsum(gi, axis=0)  # b_t - b_r, r = the token before the sub-chunk
    explicit = tl.max(-tl.sum(gi, axis=0), axis=0) > LIMIT  # the sub-chunk's gate spread
    qf = (qi.to(tl.float32) * tl.exp(ci)).to(qi.dtype)
    a_ptr = A + row_i[:, None] * C + o_c[None, :]
    # diagonal block: factored through r (e^{b_r - b_s} <= e^LIMIT) or one key s at a time
    ki = _load_rows(k, row_i, m_i, o_k, K)
    kd = tl.where(explicit, 0.0, ki * tl.exp(tl.where(explicit, 0.0, -ci)))
    acc = mm(qf, tl.trans(kd.to(qi.dtype)), PREC, UP)
    if explicit:
        d = tl.zeros([SUBC, BK], dtype=tl.float32)  # b_t - b_s = sum_{s < u <= t} g_u, accumulated
        for jj in range(SUBC):
            j = SUBC - 1 - jj
            row_s, m_s = _rows(first, count, i_h, i * SUBC + j, H)
            lower = (o_c >= j)[:, None]
            e = tl.where(lower, tl.exp(d), 0.0)
            col = tl.sum(qi.to(tl.float32) * _load_row(k, row_s, m_s, o_k, K)[None, :] * e, axis=1)
            acc += tl.where(o_c[None, :] == j, col[:, None], 0.0)
            d += tl.where(lower, _load_row(g, row_s, m_s, o_k, K)[None, :], 0.0)
    acc = tl.where(o_c[None, :] <= o_c[:, None], acc, 0.0)
    tl.store(a_ptr + i * SUBC, (acc * scale).to(A.dtype.element_ty), mask=m_i[:, None])
    # earlier sub-chunks, nearest first: both factors e^{b_t - b_r}, e^{b_r - b_s} <= 1
    to_r = tl.zeros([BK], dtype=tl.float32)  # b_r - (b at the end of sub-chunk j), a sum of g
    for jj in range(i):
        j = i - 1 - jj
        row_j, m_j = _rows(first, count, i_h, j * SUBC + o_c, H)
        gj = _load_rows(g, row_j, m_j, o_k, K)
        kj = tl.load(k + row_j[:, None] * K + o_k[None, :], mask=m_j[:, None] & (o_k[None, :] < K), other=0.0)
        kf = (kj.to(tl.float32) * tl.exp(_suffix(gj) + to_r[None, :])).to(kj.dtype)
        tl.store(a_ptr + j * SUBC, (mm(qf, tl.trans(kf), PREC, UP) * scale).to(A.dtype.element_ty),
                 mask=m_i[:, None])
        to_r += tl.sum(gj, axis=0)
    for j in range(i + 1, C // SUBC):
        tl.store(a_ptr + j * SUBC, tl.zeros([SUBC, SUBC], dtype=A.dtype.element_ty), mask=m_i[:, None])


@fast_launch
@triton.jit(do_not_specialize=["T", "NC"])
def _output_kernel(q, v, g, h, A, o, rows, scale, T, NC, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                   C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr, UP: tl.constexpr,
                   PACKED: tl.constexpr):
    """Grid (cdiv(V, BV) * N, B*H) (block_and_index): o = (q~ ⊙ e^b) S + A v for one chunk and value block."""
    i_v, n = block_and_index(tl.cdiv(V, BV))
    i_bh = tl.program_id(1).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    first, count = chunk_span(rows, n, i_b, T, C, PACKED)
    N = NC
    o_k, o_c = tl.arange(0, BK), tl.arange(0, C)
    o_v = i_v * BV + tl.arange(0, BV)
    row, m_t = _rows(first, count, i_h, o_c, H)
    m_cv = m_t[:, None] & (o_v[None, :] < V)
    qc = tl.load(q + row[:, None] * K + o_k[None, :], mask=m_t[:, None] & (o_k[None, :] < K), other=0.0)
    bc = tl.cumsum(_load_rows(g, row, m_t, o_k, K), axis=0)
    S = tl.load(h + (i_bh * N + n) * K * V + o_k[:, None] * V + o_v[None, :],
                mask=(o_k[:, None] < K) & (o_v[None, :] < V), other=0.0)
    Ac = tl.load(A + row[:, None] * C + o_c[None, :], mask=m_t[:, None], other=0.0)
    vc = tl.load(v + row[:, None] * V + o_v[None, :], mask=m_cv, other=0.0)
    acc = mm((qc.to(tl.float32) * tl.exp(bc) * scale).to(S.dtype), S, PREC, UP)
    v_fin, v_rest = causal_dot_rest(vc)  # row t reads v rows <= t only (triton_masking.py)
    acc += mm(Ac.to(vc.dtype), v_fin, PREC, UP) + v_rest
    tl.store(o + row[:, None] * V + o_v[None, :], acc.to(o.dtype.element_ty), mask=m_cv)


@fast_launch
@triton.jit(do_not_specialize=["T", "NC", "PER_ROW", "LEN", "BASE"])
def _state_bwd_kernel(q, g, do, dh, dht, dh0, cu, rows, seg, lam, Lam, scale, T, NC, PER_ROW, LEN, BASE,
                      H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr,
                      BV: tl.constexpr, HAS_DHT: tl.constexpr, PACKED: tl.constexpr, SEGMENTED: tl.constexpr,
                      PREC: tl.constexpr, UP: tl.constexpr):
    """Grid (cdiv(V, BV), cdiv(K, BK), B*H; packed: S*H; segmented: segments*H): dh[b, h, n] = gradient of the state
    leaving chunk n; dh0 (PACKED: program s*H + h runs sequence s's chunks in reverse, from dht[s, h] to dh0[s, h]).
    SEGMENTED: segment s in reverse from zero (from dht at its sequence's end), its gradient at the segment's start
    to dh0[s, h], the decays as in _state_fwd_kernel (lam: from the chunk's end to the segment's). BASE: added to the
    program index along axis 2 (launches cut at the grid's limit, grid_slices)."""
    i_v, i_k, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64) + BASE
    i_h = i_bh % H
    N = NC
    c0, c1, i_b, i_hb, i_0, _, ends = scan_span(cu, seg, i_bh, N, PER_ROW, LEN, H, PACKED, SEGMENTED)
    o_c = tl.arange(0, C)
    o_k, o_v = i_k * BK + tl.arange(0, BK), i_v * BV + tl.arange(0, BV)
    kv = o_k[:, None] * V + o_v[None, :]
    m_kv = (o_k[:, None] < K) & (o_v[None, :] < V)
    m_dec = (o_k < K) & (o_k * 0 + i_v == 0)
    dS = tl.zeros([BK, BV], dtype=tl.float32)
    dec = tl.zeros([BK], dtype=tl.float32)
    if HAS_DHT:
        if ends:
            dS += tl.load(dht + i_0 * K * V + kv, mask=m_kv, other=0.0).to(tl.float32)
    t_start, t_end = scan_tokens(rows, c0, c1, PACKED)  # the run's tokens, read once
    for i in range(c1 - c0):
        n = c1 - 1 - i
        tl.store(dh + (i_hb * N + n) * K * V + kv, dS.to(dh.dtype.element_ty), mask=m_kv)
        first, count = scan_chunk(rows, n, c0, t_start, t_end, i_b, T, C, PACKED)
        row, m_t = _rows(first, count, i_h, o_c, H)
        gc = _load_rows(g, row, m_t, o_k, K)
        qc = tl.load(q + row[:, None] * K + o_k[None, :], mask=m_t[:, None] & (o_k[None, :] < K), other=0.0)
        doc = tl.load(do + row[:, None] * V + o_v[None, :], mask=m_t[:, None] & (o_v[None, :] < V), other=0.0)
        qw = (qc.to(tl.float32) * tl.exp(tl.cumsum(gc, axis=0)) * scale).to(doc.dtype)
        total = tl.sum(gc, axis=0)
        dS = dS * tl.exp(total)[:, None] + mm(tl.trans(qw), doc, PREC, UP)
        if SEGMENTED:
            tl.store(lam + (i_hb * N + n) * K + o_k, dec, mask=m_dec)
            dec += total
    tl.store(dh0 + i_bh * K * V + kv, dS, mask=m_kv)
    if SEGMENTED:
        tl.store(Lam + i_bh * K + o_k, dec, mask=m_dec)


@fast_launch
@triton.jit(do_not_specialize=["T", "NC"])
def _inter_bwd_kernel(q, k, v, g, h, A, do, dh, dv, dA, dq, dk, dL, rows, scale, T, NC, H: tl.constexpr,
                      K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                      PREC: tl.constexpr, UP: tl.constexpr, PACKED: tl.constexpr):
    """Grid (N, B*H), looping over value blocks: dv; dA (masked); the inter parts of dq, dk (float32); dL."""
    n, i_bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    first, count = chunk_span(rows, n, i_b, T, C, PACKED)
    N = NC
    o_k, o_c = tl.arange(0, BK), tl.arange(0, C)
    row, m_t = _rows(first, count, i_h, o_c, H)
    m_ck = m_t[:, None] & (o_k[None, :] < K)
    kc = tl.load(k + row[:, None] * K + o_k[None, :], mask=m_ck, other=0.0)
    k_tail = (kc.to(tl.float32) * tl.exp(_suffix(_load_rows(g, row, m_t, o_k, K)))).to(kc.dtype)  # k e^{L - b}
    dA_acc = tl.zeros([C, C], dtype=tl.float32)
    dq_acc = tl.zeros([C, BK], dtype=tl.float32)
    dk_acc = tl.zeros([C, BK], dtype=tl.float32)
    sdh = tl.zeros([BK], dtype=tl.float32)
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_cv = m_t[:, None] & (o_v[None, :] < V)
        m_kv = (o_k[:, None] < K) & (o_v[None, :] < V)
        vc = tl.load(v + row[:, None] * V + o_v[None, :], mask=m_cv, other=0.0)
        doc = tl.load(do + row[:, None] * V + o_v[None, :], mask=m_cv, other=0.0)
        S = tl.load(h + (i_bh * N + n) * K * V + o_k[:, None] * V + o_v[None, :], mask=m_kv, other=0.0)
        dS = tl.load(dh + (i_bh * N + n) * K * V + o_k[:, None] * V + o_v[None, :], mask=m_kv, other=0.0)
        Ac = tl.load(A + row[:, None] * C + o_c[None, :], mask=m_t[:, None], other=0.0)
        dA_acc += mm(doc, tl.trans(vc), PREC, UP)
        dq_acc += mm(doc.to(S.dtype), tl.trans(S), PREC, UP)
        dk_acc += mm(vc.to(dS.dtype), tl.trans(dS), PREC, UP)
        sdh += tl.sum(S.to(tl.float32) * dS.to(tl.float32), axis=1)
        dv_blk = mm(tl.trans(Ac).to(doc.dtype), doc, PREC, UP)
        dv_blk += mm(k_tail.to(dS.dtype), dS, PREC, UP)
        tl.store(dv + row[:, None] * V + o_v[None, :], dv_blk.to(dv.dtype.element_ty), mask=m_cv)
    dA_acc = tl.where(o_c[:, None] >= o_c[None, :], dA_acc, 0.0)
    tl.store(dA + row[:, None] * C + o_c[None, :], dA_acc, mask=m_t[:, None])
    gc = _load_rows(g, row, m_t, o_k, K)  # reloaded: fewer live tiles during the loop
    tl.store(dq + row[:, None] * K + o_k[None, :], dq_acc * tl.exp(tl.cumsum(gc, axis=0)) * scale, mask=m_ck)
    dk_inter = dk_acc * tl.exp(_suffix(gc))
    tl.store(dk + row[:, None] * K + o_k[None, :], dk_inter, mask=m_ck)
    kc = tl.load(k + row[:, None] * K + o_k[None, :], mask=m_ck, other=0.0).to(tl.float32)
    dL_n = tl.exp(tl.sum(gc, axis=0)) * sdh + tl.sum(kc * dk_inter, axis=0)
    tl.store(dL + (i_bh * N + n) * K + o_k, dL_n, mask=o_k < K)


@fast_launch
@triton.jit(do_not_specialize=["T", "NC"])
def _intra_bwd_kernel(q, k, g, dA, dq_in, dk_in, dL, dq, dk, dg, rows, scale, T, NC, H: tl.constexpr,
                      K: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, SUBC: tl.constexpr, LIMIT: tl.constexpr,
                      LOW: tl.constexpr, PREC: tl.constexpr, UP: tl.constexpr, PACKED: tl.constexpr):
    """Grid (cdiv(K, BK) * N, B*H) (block_and_index): dq, dk (inter parts from dq_in, dk_in plus the intra sums) and
    dg of one key block, sub-chunk by sub-chunk from the chunk's end (dg is the reverse cumulative sum of db, carried
    across sub-chunks). Given dA every quantity here is per key channel, so key blocks are independent programs.
    LOW: the products' operands (dA and the decayed keys and queries) rounded to q's dtype (LAUNCH["intra_dots"])."""
    i_k, n = block_and_index(tl.cdiv(K, BK))
    i_bh = tl.program_id(1).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    first, count = chunk_span(rows, n, i_b, T, C, PACKED)
    N = NC
    M: tl.constexpr = C // SUBC
    o_k, o_c = i_k * BK + tl.arange(0, BK), tl.arange(0, SUBC)
    m_k = o_k < K
    DT: tl.constexpr = q.dtype.element_ty if LOW else tl.float32
    carry = tl.load(dL + (i_bh * N + n) * K + o_k, mask=m_k, other=0.0)
    for ii in tl.static_range(M):
        i = M - 1 - ii
        row_i, m_i = _rows(first, count, i_h, i * SUBC + o_c, H)
        m_ik = m_i[:, None] & m_k[None, :]
        qi = _load_rows(q, row_i, m_i, o_k, K)
        ki = _load_rows(k, row_i, m_i, o_k, K)
        gi = _load_rows(g, row_i, m_i, o_k, K)
        ci, si = tl.cumsum(gi, axis=0), _suffix(gi)  # b_t - b_r (r before the sub-chunk), b_e - b_t (e its last)
        explicit = tl.max(-tl.sum(gi, axis=0), axis=0) > LIMIT
        dA_ii = tl.load(dA + row_i[:, None] * C + i * SUBC + o_c[None, :], mask=m_i[:, None], other=0.0)
        # dq_t = e^{b_t - b_r} sum_s dA_ts k_s e^{b_r - b_s}: the diagonal block when factored, then the
        # keys of earlier sub-chunks, nearest first
        kd = tl.where(explicit, 0.0, ki * tl.exp(tl.where(explicit, 0.0, -ci)))
        dqs = mm(dA_ii.to(DT), kd.to(DT), PREC, UP)
        to_r = tl.zeros([BK], dtype=tl.float32)
        for jj in range(i):
            j = i - 1 - jj
            row_j, m_j = _rows(first, count, i_h, j * SUBC + o_c, H)
            gj = _load_rows(g, row_j, m_j, o_k, K)
            kf = _load_rows(k, row_j, m_j, o_k, K) * tl.exp(_suffix(gj) + to_r[None, :])
            dA_ij = tl.load(dA + row_i[:, None] * C + j * SUBC + o_c[None, :], mask=m_i[:, None], other=0.0)
            dqs += mm(dA_ij.to(DT), kf.to(DT), PREC, UP)
            to_r += tl.sum(gj, axis=0)
        dqi = dqs * tl.exp(ci)
        # dk_s = e^{b_e - b_s} sum_t dA_ts q_t e^{b_t - b_e}: the diagonal block when factored, then the
        # queries of later sub-chunks, nearest first
        qd = tl.where(explicit, 0.0, qi * tl.exp(tl.where(explicit, 0.0, -si)))
        dks = mm(tl.trans(dA_ii).to(DT), qd.to(DT), PREC, UP)
        from_e = tl.zeros([BK], dtype=tl.float32)
        for j in range(i + 1, M):
            row_j, m_j = _rows(first, count, i_h, j * SUBC + o_c, H)
            gj = _load_rows(g, row_j, m_j, o_k, K)
            qf = _load_rows(q, row_j, m_j, o_k, K) * tl.exp(tl.cumsum(gj, axis=0) + from_e[None, :])
            dA_ji = tl.load(dA + row_j[None, :] * C + i * SUBC + o_c[:, None], mask=m_j[None, :], other=0.0)  # [s, t]
            dks += mm(dA_ji.to(DT), qf.to(DT), PREC, UP)
            from_e += tl.sum(gj, axis=0)
        dki = dks * tl.exp(si)
        if explicit:  # diagonal block: token SUBC-1-jj as a key (for dq), token jj as a query (for dk)
            d_q = tl.zeros([SUBC, BK], dtype=tl.float32)  # b_t - b_s, s = SUBC-1-jj, as a sum of g
            d_k = tl.zeros([SUBC, BK], dtype=tl.float32)  # b_t - b_s, t = jj, as a sum of g
            for jj in range(SUBC):
                j = SUBC - 1 - jj
                row_s, m_s = _rows(first, count, i_h, i * SUBC + j, H)
                row_t, m_t = _rows(first, count, i_h, i * SUBC + jj, H)
                d_k += tl.where((o_c < jj)[:, None], _load_row(g, row_t, m_t, o_k, K)[None, :], 0.0)
                dA_col = tl.load(dA + row_i * C + i * SUBC + j, mask=m_i, other=0.0)  # dA[t in i, s]
                dA_row = tl.load(dA + row_t * C + i * SUBC + o_c, mask=_spread(m_t, o_c), other=0.0)  # dA[t, s in i]
                lower = (o_c >= j)[:, None]
                dqi += tl.where(lower, dA_col[:, None] * _load_row(k, row_s, m_s, o_k, K)[None, :] * tl.exp(d_q), 0.0)
                upper = (o_c <= jj)[:, None]
                dki += tl.where(upper, dA_row[:, None] * _load_row(q, row_t, m_t, o_k, K)[None, :] * tl.exp(d_k), 0.0)
                d_q += tl.where(lower, _load_row(g, row_s, m_s, o_k, K)[None, :], 0.0)
        ptr = row_i[:, None] * K + o_k[None, :]
        dqi = dqi * scale + tl.load(dq_in + ptr, mask=m_ik, other=0.0)
        dki = dki * scale + tl.load(dk_in + ptr, mask=m_ik, other=0.0)
        tl.store(dq + ptr, dqi.to(dq.dtype.element_ty), mask=m_ik)
        tl.store(dk + ptr, dki.to(dk.dtype.element_ty), mask=m_ik)
        db = qi * dqi - ki * dki
        tl.store(dg + ptr, tl.cumsum(db, axis=0, reverse=True) + carry[None, :], mask=m_ik)
        carry += tl.sum(db, axis=0)


# Launch settings: fixed per head size (never tuned per sequence length).
# "BV" is the value block of the state scans and the output; "<kernel>_stages" the software-pipelining depth of
# bf16/fp16 inputs (float32 keeps Triton's default); "scan" is the forward state scan, "bscan" the reverse one.
# "intra_dots": the intra-chunk gradient products' operands: "input" rounds them to the inputs' dtype (bf16/fp16
# tensor-core products, as FLA's chunk_gla multiplies), "tf32" keeps them float32 (tf32 products: half the
# tensor-core rate). The gates' gradient is a per-channel reverse sum of q dq - k dk whose terms cancel: with
# bf16 operands it is 1.1e-2 from the float32 reference where the other gradients are 3.3e-3 (bf16, K = 32,
# T = 1024, CPU emulation of the GPU's rounding), with tf32 ones 2.5e-3-3e-3. On an H200 (bf16, B 1, H 4,
# K = V = 128, T = 16384) dg was 1.02e-2 with "input" and 2.87e-3 with "tf32"; the op's forward and backward
# (B 4, H 16) took, with "tf32" against "input", 2.11 against 2.14 ms at T = 2048 and 15.00 against 14.74 at
# T = 16384, the model's step at 8 x 2048 0.93x against 0.94x the Transformer's: noise-level cost, so "tf32" is
# the default.
# Swept on an H200 at the benchmark model's layer (B 8, T 2048, H 8, K = V = 128, bf16; each setting alone, the rest
# as here): the intra-chunk gradient kernel at 2 warps without software pipelining brought the backward pass from
# 1.35 to 1.22 ms (4 warps, 3 stages before; 8 warps 1.67), the scores kernel at 2 warps the forward from 0.54 to
# 0.48 ms; the scans' and the inter-chunk kernel's settings were already the fastest of those tried.
# "segments" and "seg_min": the state scans cut long sequences into segments (docs/triton.md, "Segmented state
# scans"): "auto", "always" or "never", and the shortest segment in chunks.
INTRA_DOTS = ("input", "tf32")
LAUNCH = {"BV": 64, "scan_BK": 64, "scan_warps": 4, "scan_stages": 3, "bscan_BK": 64, "bscan_warps": 4,
          "bscan_stages": 3, "scores_warps": 2, "scores_stages": 2, "out_warps": 4, "out_stages": 3, "inter_BV": 64,
          "inter_warps": 8, "inter_stages": 3, "intra_BK": 32, "intra_warps": 2, "intra_stages": 1,
          "intra_dots": "tf32", "segments": "auto", "seg_min": 8}
launch_overrides("gla", LAUNCH)


def _intra_dots() -> str:
    return launch_choice(LAUNCH, "gla", "intra_dots", INTRA_DOTS)


def _options(x: torch.Tensor, kernel: str) -> dict[str, int]:
    """num_warps and num_stages of ``kernel``; float32 inputs are not software-pipelined (with Triton's default three
    stages the inter-chunk gradient kernel's float32 tiles need 272 KiB of shared memory at K = V = 128, more than an
    H100's or H200's 227)."""
    return launch_options(LAUNCH, kernel, x.dtype, float32_stages=1)


def _prec(x: torch.Tensor) -> dict[str, str | bool]:
    """The kernels' dot-product precision flags for inputs of x's dtype, by parameter name."""
    return {"PREC": dot_precision(x.dtype), "UP": upcast_dots(x.dtype)}


def _segments(B: int, N: int, H: int, K: int, V: int, C: int, device: torch.device,
              cu_chunks: torch.Tensor | None) -> Segments | None:
    """How the state scans are cut (common/scan_segments.py), the same for the forward and the backward pass: per
    chunk column a scan runs H programs per key block and value block."""
    programs = H * cdiv(K, min(LAUNCH["scan_BK"], _block(K))) * cdiv(V, min(LAUNCH["BV"], _block(V)))
    return plan_segments(B, N, C, programs, device, cu_chunks, LAUNCH, "gla")


def _states(k, v, g, initial_state, C, cu_chunks=None, chunk_rows=None, segments=None):
    """(h [B, H, N, K, V]: the states entering the chunks, the final state float32 [rows, H, K, V]); ``segments``:
    the scan cut as :func:`_segments` says."""
    B, T, H, K = k.shape
    V = v.shape[-1]
    N = chunk_count(T, C, chunk_rows)
    rows = B if cu_chunks is None else cu_chunks.shape[0] - 1
    BK, BV = min(LAUNCH["scan_BK"], _block(K)), min(LAUNCH["BV"], _block(V))
    h = torch.empty(B, H, N, K, V, device=k.device, dtype=chunk_state_dtype(k))
    ht = torch.empty(rows, H, K, V, device=k.device, dtype=torch.float32)
    h0 = initial_state if initial_state is not None else ht  # unused pointer when HAS_H0 is False
    ends, Lam, lam = segment_buffers(segments, ht, B, N, H, K, V, per_key=True)
    for base, count in scan_slices(rows, H, segments):
        _state_fwd_kernel[(cdiv(V, BV), cdiv(K, BK), count)](
            k=k, v=v, g=g, h=h, h0=h0, ht=ends, cu=ht if cu_chunks is None else cu_chunks,
            rows=ht if chunk_rows is None else chunk_rows, seg=segment_table(segments, ht), lam=lam, Lam=Lam, T=T,
            NC=N, **segment_ints(segments), BASE=base, H=H, K=K, V=V, C=C, BK=BK, BV=BV,
            HAS_H0=initial_state is not None, PACKED=chunk_rows is not None, SEGMENTED=segments is not None,
            **_prec(k), **_options(k, "scan"))
    if segments is not None:
        fix_segments(h, ends, lam, Lam, ht, segments, reverse=False, BK=BK, BV=BV)
    return h, ht


def _scores(q, k, g, scale, C, chunk_rows=None):
    B, T, H, K = q.shape
    # every use casts A to the input dtype first, so bf16/fp16 inputs keep it in that dtype (half the traffic)
    A = torch.empty(B, T, H, C, device=q.device, dtype=q.dtype)
    _scores_kernel[(C // SUB * chunk_count(T, C, chunk_rows), B * H)](
        q=q, k=k, g=g, A=A, rows=A if chunk_rows is None else chunk_rows, scale=scale, T=T, H=H, K=K, C=C,
        BK=_block(K), SUBC=SUB, LIMIT=_factor_limit(q), PACKED=chunk_rows is not None, **_prec(q),
        **_options(q, "scores"))
    return A


def gla_triton_forward(q, k, v, g, scale, initial_state, C, keep=False, cu_chunks=None, chunk_rows=None):
    """Forward pass: (o, final state float32), and with ``keep`` also (None, the intra-chunk scores A) for the
    backward pass (A in the input dtype, B*T*H*C: reading it back is cheaper than the kernel that recomputes it).
    The chunk states h are not kept: B*H*N*K*V is V / C times q's size, held from the forward pass to the backward
    pass in every layer, and the backward pass recomputes them with one state scan (as simple_gla's does).
    Inputs contiguous [B, T, H, *]; g [B, T, H, K] float32, bf16 or fp16. ``cu_chunks`` and ``chunk_rows``: packed
    sequences (B = 1) read where they lie (common/packed_call.py's ChunkLayout): every kernel takes each chunk's
    tokens from ``chunk_rows``, and the state scans run each sequence's chunks (the chunk-local gate gradient needs
    no change)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    N = chunk_count(T, C, chunk_rows)
    _intra_dots()  # read by the backward pass: a bad setting is named before any compute
    segments = _segments(B, N, H, K, V, C, q.device, cu_chunks)
    h, ht = _states(k, v, g, initial_state, C, cu_chunks, chunk_rows, segments)
    A = _scores(q, k, g, scale, C, chunk_rows)
    o = torch.empty_like(v)
    BV = min(LAUNCH["BV"], _block(V))
    _output_kernel[(cdiv(V, BV) * N, B * H)](
        q=q, v=v, g=g, h=h, A=A, o=o, rows=o if chunk_rows is None else chunk_rows, scale=scale, T=T, NC=N, H=H,
        K=K, V=V, C=C, BK=_block(K), BV=BV, PACKED=chunk_rows is not None, **_prec(q), **_options(q, "out"))
    return (o, ht, None, A) if keep else (o, ht)


def gla_triton_backward(q, k, v, g, scale, initial_state, C, do, dht, saved=(None, None), cu_chunks=None,
                        chunk_rows=None):
    """Backward pass: (dq, dk, dv, dg, d_initial_state). ``saved``: the forward's (h, A), recomputed where None."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    N = chunk_count(T, C, chunk_rows)
    rows = B if cu_chunks is None else cu_chunks.shape[0] - 1
    rp, packed = (q, False) if chunk_rows is None else (chunk_rows, True)  # (a pointer placeholder unpacked)
    h, A = saved
    segments = _segments(B, N, H, K, V, C, q.device, cu_chunks)
    h = _states(k, v, g, initial_state, C, cu_chunks, chunk_rows, segments)[0] if h is None else h
    A = _scores(q, k, g, scale, C, chunk_rows) if A is None else A
    BK, BV = min(LAUNCH["bscan_BK"], _block(K)), min(LAUNCH["BV"], _block(V))
    dh = torch.empty_like(h)
    dh0 = torch.empty(rows, H, K, V, device=q.device, dtype=torch.float32)
    starts, Lam, lam = segment_buffers(segments, dh0, B, N, H, K, V, per_key=True)
    for base, count in scan_slices(rows, H, segments):
        _state_bwd_kernel[(cdiv(V, BV), cdiv(K, BK), count)](
            q=q, g=g, do=do, dh=dh, dht=dht if dht is not None else dh0, dh0=starts,
            cu=dh0 if cu_chunks is None else cu_chunks, rows=rp, seg=segment_table(segments, dh0), lam=lam, Lam=Lam,
            scale=scale, T=T, NC=N, **segment_ints(segments), BASE=base, H=H, K=K, V=V, C=C, BK=BK, BV=BV,
            HAS_DHT=dht is not None, PACKED=packed, SEGMENTED=segments is not None, **_prec(q),
            **_options(q, "bscan"))
    if segments is not None:
        fix_segments(dh, starts, lam, Lam, dh0, segments, reverse=True, BK=BK, BV=BV)
    dv = torch.empty_like(v)
    dA = torch.empty(B, T, H, C, device=q.device, dtype=torch.float32)
    dq_inter = torch.empty(B, T, H, K, device=q.device, dtype=torch.float32)
    dk_inter = torch.empty_like(dq_inter)
    dL = torch.empty(B, H, N, K, device=q.device, dtype=torch.float32)
    _inter_bwd_kernel[(N, B * H)](
        q=q, k=k, v=v, g=g, h=h, A=A, do=do, dh=dh, dv=dv, dA=dA, dq=dq_inter, dk=dk_inter, dL=dL, rows=rp,
        scale=scale, T=T, NC=N, H=H, K=K, V=V, C=C, BK=_block(K), BV=min(LAUNCH["inter_BV"], _block(V)),
        PACKED=packed, **_prec(q), **_options(q, "inter"))
    dq, dk = torch.empty_like(q), torch.empty_like(k)
    dg = torch.empty_like(g)  # in g's dtype; computed in float32
    BKI = min(LAUNCH["intra_BK"], _block(K))
    _intra_bwd_kernel[(cdiv(K, BKI) * N, B * H)](
        q=q, k=k, g=g, dA=dA, dq_in=dq_inter, dk_in=dk_inter, dL=dL, dq=dq, dk=dk, dg=dg, rows=rp, scale=scale, T=T,
        NC=N, H=H, K=K, C=C, BK=BKI, SUBC=SUB, LIMIT=_factor_limit(q), LOW=_intra_dots() == "input",
        PACKED=packed, **_prec(q), **_options(q, "intra"))
    return dq, dk, dv, dg, dh0


def _saved_like(q, k, v, g, C):
    """Empty tensors shaped like the forward's kept (h, A), for tracing: h is not kept (an empty tensor)."""
    B, T, H, K = q.shape
    return (q.new_empty(0), q.new_empty(B, T, H, C))


gla_triton = gated_rnn_backend("gla_triton", gla_triton_forward, gla_triton_backward, _saved_like)


TRITON_BACKENDS = {"gla": gla_triton}
