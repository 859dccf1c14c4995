"""mesa_net's solver "cg" on its own Triton kernels (head dims up to 128): the inputs read as they are (bf16, fp16 or
float32; computed in float32), beta, the query scale and the transposes folded into the kernels; no PyTorch pass over
[B, T, H, K] tensors (only lamb's sum over chunks).

    G_t = exp(g_t) G_{t-1} + beta_t k_t k_t^T,   H_t = exp(g_t) H_{t-1} + beta_t k_t v_t^T,
    o_t = H_t^T x_t,   (G_t + diag(lamb)) x_t = scale q_t

The algorithm is composed.py's (the scan S_t = exp(g_t) S_{t-1} + k_t w_t^T with w = beta k and S_0 = G_0^T has
S_t = G_t^T; backward by implicit differentiation), each step one kernel:

forward (3 launches)
  1. ``_states_kernel``: the chunk-entry states of both scans, S_n (G's, transposed) and H_n, float32, in one launch
     (a program per column block of either), and the final G_T, H_T.
  2. ``_chunk_cg_kernel`` (triton_cg.py): all CG steps of every token, x float32.
  3. ``_readout_kernel``: o_t from H_n, x_t and the chunk's keys and values, in q's dtype.
  Kept for the backward pass: x [B, T, H, K] float32 and the inputs as given.
backward (6 launches; dx_t = H_t do_t, u_t = (G_t + diag(lamb))^-T dx_t)
  1. ``_states_kernel`` again (the states are recomputed, not kept: G's and H's float32 states per chunk of 64 would be
     four times the size of x at K = V = 128).
  2. ``_dstates_kernel``: the reverse scan of H's state gradients dH_{n-1} = exp(b_C) dH_n + sum_t exp(b_t) x_t do_t^T.
  3. ``_read_grads_kernel``: per chunk, the read-out's gradients: dx (float32, the solve's right-hand side), k's
     (float32, partial), v's (final: beta_t times the scan's value gradient), beta's and the gates' (partial).
  4. ``_chunk_cg_kernel`` on the transposed systems: S read transposed (S_n^T = G_n), right-hand side dx.
  5. ``_dstates_kernel`` for y_t = G_t x_t read with the cotangent -u_t (S's state gradients, from dG_T^T).
     Both reverse scans also give each chunk end's gate term <dS, S> (the state leaving the chunk, its gradient).
  6. ``_solve_grads_kernel``: per chunk, that read's gradients added to step 3's: k's and beta's final, q's
     (scale u_t), lamb's (-sum_t u_t x_t, per chunk; summed over batch and chunks after) and dg: the reverse
     cumulative sum of the gates' gradient within the chunk, with the chunk end's terms.

With y_t = S_t^T q_t a scan read with queries q, values w and cotangents c, the gradients (per chunk n of C tokens,
b the gates cumulated within it, D_ts = exp(b_t - b_s) for s <= t) are simple_gla's:

    dq_t = exp(b_t) S_n c_t + sum_{s <= t} D_ts (c_t . w_s) k_s
    dk_s = sum_{t >= s} D_ts (c_t . w_s) q_t + exp(b_C - b_s) dS_n w_s
    dw_s = sum_{t >= s} D_ts (q_t . k_s) c_t + exp(b_C - b_s) dS_n^T k_s
    dB_t = q_t . dq_t - k_t . dk_t   (+ <dS_n, S_n> at the chunk's last token, S_n the state leaving it)
    dg_t = sum_{s >= t in t's chunk} dB_s

(b_t cumulates the gates within the chunk, so g_t reaches the later b_s of its chunk and, through b_C, the whole
state leaving it. The same dg as one reverse sum over the sequence, ending at <dS_T, S_T>, would be exact too, but
its terms cancel over the whole sequence and tf32 products left it 1e-2 to 3e-2 off at T = 2048-16384.)

with w = beta v (H's read: q = x, c = do) or w = beta k (G's: q = x, c = -u), and dv = beta dw,
dbeta = dw . v (or . k).
The dots are tf32 for bf16/fp16 inputs and IEEE float32 for float32 ones, as on the composed path; states,
x, u and the partial gradients are float32. Under torch.compile (or for tensor subclasses) the forward and
backward are the registered ops ``linattn::mesa_net_cg_fwd`` and ``linattn::mesa_net_cg_bwd``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common.registered_ops import define_op
from ..common.triton_launch import fast_launch
from ..common.triton_masking import causal_dot_rest
from ..common.triton_ops import eager_backward, op_function
from ..common.triton_utils import block, block_and_index, cdiv, dot_precision, mm, next_power_of_2, upcast_dots
from .composed import check_cg_system
from .reference import MesaState
from .triton_cg import LAUNCH, _chunk_cg_kernel, cg_launch


@triton.jit
def _chunk_gates(g, row, m_t, C: tl.constexpr):
    """(b, b_C): the log gates of a chunk's rows cumulated within it, and their sum over the chunk (rows past its
    end read as 0)."""
    b = tl.cumsum(tl.load(g + row, mask=m_t, other=0.0).to(tl.float32), axis=0)
    return b, tl.sum(tl.where(tl.arange(0, C) == C - 1, b, 0.0), axis=0)


@triton.jit
def _state_offsets(o_k, cols, K: tl.constexpr, W: tl.constexpr, TRANS: tl.constexpr):
    """(offsets of rows o_k and columns cols of a [K, W] state, the same entries' offsets in an initial or final
    state stored transposed when TRANS (K = W), else the same)."""
    at = o_k[:, None] * W + cols[None, :]
    if TRANS:
        return at, cols[None, :] * K + o_k[:, None]
    return at, at


@triton.jit
def _scan_columns(k, src, g, beta, h, s0, sT, i_bh, i_b, i_h, cols, T, H: tl.constexpr, K: tl.constexpr,
                  W: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, HAS_S0: tl.constexpr,
                  TRANS: tl.constexpr, PREC: tl.constexpr, UP: tl.constexpr):
    """Columns ``cols`` of S_t = exp(g_t) S_{t-1} + k_t (beta_t src_t)^T [K, W] at every chunk entry into h
    [B, H, N, K, W], from s0 (TRANS: s0^T; the final state stored as S_T^T into sT, else S_T)."""
    N = tl.cdiv(T, C)
    o_k, o_c = tl.arange(0, BK), tl.arange(0, C)
    m = (o_k[:, None] < K) & (cols[None, :] < W)
    at, at_end = _state_offsets(o_k, cols, K, W, TRANS)
    S = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_S0:
        S += tl.load(s0 + i_bh * K * W + at_end, mask=m, other=0.0).to(tl.float32)
    for n in range(0, N):
        tl.store(h + (i_bh * N + n) * K * W + at, S, mask=m)
        m_t = n * C + o_c < T
        row = (i_b * T + n * C + o_c) * H + i_h
        b, b_last = _chunk_gates(g, row, m_t, C)
        kt = tl.load(k + row[None, :] * K + o_k[:, None], mask=(o_k[:, None] < K) & m_t[None, :], other=0.0)
        wc = tl.load(src + row[:, None] * W + cols[None, :], mask=m_t[:, None] & (cols[None, :] < W), other=0.0)
        bet = tl.load(beta + row, mask=m_t, other=0.0).to(tl.float32)
        wc = wc.to(tl.float32) * (bet * tl.exp(b_last - b))[:, None]
        S = S * tl.exp(b_last) + mm(kt.to(tl.float32), wc, PREC, UP)
    tl.store(sT + i_bh * K * W + at_end, S, mask=m)


@fast_launch
@triton.jit(do_not_specialize=["T"])
def _states_kernel(k, v, g, beta, hk, hv, g0, h0, gT, hT, T, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                   C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, HAS_G0: tl.constexpr, HAS_H0: tl.constexpr,
                   PREC: tl.constexpr, UP: tl.constexpr):
    """Grid (cdiv(K, BV) + cdiv(V, BV), B*H): the chunk-entry states of both scans in float32. The first cdiv(K, BV)
    programs: column blocks of S_t = exp(g_t) S_{t-1} + k_t (beta_t k_t)^T = G_t^T from S_0 = G_0^T (g0 read
    transposed) into hk [B, H, N, K, K], and G_T into gT; the others: column blocks of H_t = exp(g_t) H_{t-1} +
    k_t (beta_t v_t)^T from h0 into hv [B, H, N, K, V], and H_T into hT."""
    i_c, i_bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    NK = tl.cdiv(K, BV)
    if i_c < NK:
        _scan_columns(k, k, g, beta, hk, g0, gT, i_bh, i_b, i_h, i_c * BV + tl.arange(0, BV), T, H, K, K, C, BK,
                      BV, HAS_G0, True, PREC, UP)
    else:
        _scan_columns(k, v, g, beta, hv, h0, hT, i_bh, i_b, i_h, (i_c - NK) * BV + tl.arange(0, BV), T, H, K, V, C,
                      BK, BV, HAS_H0, False, PREC, UP)


@fast_launch
@triton.jit(do_not_specialize=["T"])
def _dstates_kernel(x, do, g, h, hT, dh, dht, dh0, ends, sign, T, H: tl.constexpr, K: tl.constexpr,
                    W: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, HAS_DHT: tl.constexpr,
                    TRANS: tl.constexpr, PREC: tl.constexpr, UP: tl.constexpr):
    """Grid (cdiv(W, BV), B*H): dh[b, h, n] = the gradient of the state leaving chunk n of the read y_t = S_t^T x_t
    (S [K, W]) with cotangents sign * do_t, float32:

        dS_{n-1} = exp(b_C) dS_n + sum_{t in chunk n} exp(b_t) x_t (sign do_t)^T

    from dS_N = dht (None: 0), to dh0 = dS_0; TRANS (K = W): dht read and dh0 stored transposed. And the gate term
    of each chunk's end, <dS_n, S_n> over this program's columns, into ends[b, h, n, pid(0)] (float32), with S_n
    the state leaving chunk n: h[b, h, n + 1] (the chunk-entry states), or the final state hT (TRANS: stored
    transposed, as dht) for the last chunk."""
    i_v, i_bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    N = tl.cdiv(T, C)
    o_k, o_c = tl.arange(0, BK), tl.arange(0, C)
    cols = i_v * BV + tl.arange(0, BV)
    m = (o_k[:, None] < K) & (cols[None, :] < W)
    at, at_end = _state_offsets(o_k, cols, K, W, TRANS)
    dS = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_DHT:
        dS += tl.load(dht + i_bh * K * W + at_end, mask=m, other=0.0).to(tl.float32)
    NB = tl.num_programs(0)
    for i in range(0, N):
        n = N - 1 - i
        tl.store(dh + (i_bh * N + n) * K * W + at, dS, mask=m)
        if i == 0:
            S_end = tl.load(hT + i_bh * K * W + at_end, mask=m, other=0.0)
        else:
            S_end = tl.load(h + (i_bh * N + n + 1) * K * W + at, mask=m, other=0.0)
        tl.store(ends + (i_bh * N + n) * NB + i_v, tl.sum(tl.sum(dS * S_end, axis=1), axis=0))
        m_t = n * C + o_c < T
        row = (i_b * T + n * C + o_c) * H + i_h
        b, b_last = _chunk_gates(g, row, m_t, C)
        xt = tl.load(x + row[None, :] * K + o_k[:, None], mask=(o_k[:, None] < K) & m_t[None, :], other=0.0)
        doc = tl.load(do + row[:, None] * W + cols[None, :], mask=m_t[:, None] & (cols[None, :] < W), other=0.0)
        x_dec = xt.to(tl.float32) * (sign * tl.exp(b))[None, :]
        dS = dS * tl.exp(b_last) + mm(x_dec, doc.to(tl.float32), PREC, UP)
    tl.store(dh0 + i_bh * K * W + at_end, dS, mask=m)


@fast_launch
@triton.jit(do_not_specialize=["T"])
def _readout_kernel(x, k, v, g, beta, h, o, T, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr,
                    BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr, UP: tl.constexpr):
    """Grid (cdiv(V, BV) * N, B*H) (common/triton_utils.py's block_and_index): o for one chunk n and value block from
    H's chunk-entry state h[b, h, n] [K, V]:

        o_t = exp(b_t) H_n^T x_t + sum_{s <= t in the chunk} exp(b_t - b_s) beta_s (x_t . k_s) v_s

    (b: the gates cumulated within the chunk; simple_gla's output with values beta v, read with the solve's x), in
    o's dtype. A non-finite key, strength or value
    reaches rows t >= s only (selection, and triton_masking.py's causal_dot_rest)."""
    i_v, n = block_and_index(tl.cdiv(V, BV))
    i_bh = tl.program_id(1).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    N = tl.cdiv(T, C)
    o_k, o_c = tl.arange(0, BK), tl.arange(0, C)
    o_v = i_v * BV + tl.arange(0, BV)
    m_t = n * C + o_c < T
    row = (i_b * T + n * C + o_c) * H + i_h
    m_cv = m_t[:, None] & (o_v[None, :] < V)
    b, _ = _chunk_gates(g, row, m_t, C)
    bet = tl.load(beta + row, mask=m_t, other=0.0).to(tl.float32)
    xc = tl.load(x + row[:, None] * K + o_k[None, :], mask=m_t[:, None] & (o_k[None, :] < K), other=0.0)
    kt = tl.load(k + row[None, :] * K + o_k[:, None], mask=(o_k[:, None] < K) & m_t[None, :], other=0.0)
    vc = tl.load(v + row[:, None] * V + o_v[None, :], mask=m_cv, other=0.0).to(tl.float32)
    Hn = tl.load(h + (i_bh * N + n) * K * V + o_k[:, None] * V + o_v[None, :],
                 mask=(o_k[:, None] < K) & (o_v[None, :] < V), other=0.0)
    acc = mm(xc * tl.exp(b)[:, None], Hn, PREC, UP)
    causal = o_c[:, None] >= o_c[None, :]
    D = tl.exp(tl.where(causal, b[:, None] - b[None, :], 0.0)) * bet[None, :]
    A = tl.where(causal, mm(xc, kt.to(tl.float32), PREC, UP) * D, 0.0)  # selected: a later NaN key must not leak
    v_fin, v_rest = causal_dot_rest(vc)  # row t reads v rows <= t only
    acc += mm(A, v_fin, PREC, UP) + v_rest
    tl.store(o + row[:, None] * V + o_v[None, :], acc.to(o.dtype.element_ty), mask=m_cv)


@triton.jit
def _chunk_tiles(x, k, beta, g, n, i_bh, T, H: tl.constexpr, K: tl.constexpr, C: tl.constexpr, BK: tl.constexpr):
    """A chunk's rows and tiles for its gradients: (row, m_t, m_ck, b (the gates cumulated within the chunk), b_C,
    beta, x [C, BK], k [C, BK]), float32."""
    i_b, i_h = i_bh // H, i_bh % H
    o_k, o_c = tl.arange(0, BK), tl.arange(0, C)
    m_t = n * C + o_c < T
    row = (i_b * T + n * C + o_c) * H + i_h
    m_ck = m_t[:, None] & (o_k[None, :] < K)
    b, b_last = _chunk_gates(g, row, m_t, C)
    bet = tl.load(beta + row, mask=m_t, other=0.0).to(tl.float32)
    xc = tl.load(x + row[:, None] * K + o_k[None, :], mask=m_ck, other=0.0).to(tl.float32)
    kc = tl.load(k + row[:, None] * K + o_k[None, :], mask=m_ck, other=0.0).to(tl.float32)
    return row, m_t, m_ck, b, b_last, bet, xc, kc


@triton.jit
def _decay(b, C: tl.constexpr):
    """D_ts = exp(b_t - b_s) for s <= t, else 0 [C, C] (cheap to recompute: kernels do rather than hold it)."""
    causal = tl.arange(0, C)[:, None] >= tl.arange(0, C)[None, :]
    return tl.where(causal, tl.exp(tl.where(causal, b[:, None] - b[None, :], 0.0)), 0.0)


@fast_launch
@triton.jit(do_not_specialize=["T"])
def _read_grads_kernel(x, k, v, beta, g, h, dh, do, dx, dk, dv, dbeta, dG, T, H: tl.constexpr, K: tl.constexpr,
                       V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BJ: tl.constexpr,
                       PREC: tl.constexpr, UP: tl.constexpr):
    """Grid (N, B*H): the gradients of o_t = H_t^T x_t in chunk n (module docstring, q = x, w = beta v, c = do):
    dv = beta dw (v's dtype) and dbeta = dw . v (float32) by value blocks of BV; then dx and dk (the key side of H's
    scan, float32) and dG = x . dx - k . dk by key blocks of BJ, each over the value blocks again (only [C, BV] and
    [C, BJ] accumulators, none of K columns: those spilled registers)."""
    n, i_bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    N = tl.cdiv(T, C)
    o_k = tl.arange(0, BK)
    base = (i_bh * N + n) * K * V
    row, m_t, m_ck, b, b_last, bet, xc, kc = _chunk_tiles(x, k, beta, g, n, i_bh, T, H, K, C, BK)
    D = _decay(b, C)
    A = mm(xc, tl.trans(kc), PREC, UP) * D  # (x_t . k_s) D_ts
    k_tail = kc * tl.exp(b_last - b)[:, None]
    dA = tl.zeros([C, C], dtype=tl.float32)
    dbeta_acc = tl.zeros([C], dtype=tl.float32)
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        at_v = row[:, None] * V + o_v[None, :]
        m_cv = m_t[:, None] & (o_v[None, :] < V)
        vc = tl.load(v + at_v, mask=m_cv, other=0.0).to(tl.float32)
        doc = tl.load(do + at_v, mask=m_cv, other=0.0).to(tl.float32)
        dS = tl.load(dh + base + o_k[:, None] * V + o_v[None, :], mask=(o_k[:, None] < K) & (o_v[None, :] < V),
                     other=0.0)
        dA += mm(doc, tl.trans(vc * bet[:, None]), PREC, UP)
        dw = mm(tl.trans(A), doc, PREC, UP) + mm(k_tail, dS, PREC, UP)
        dbeta_acc += tl.sum(dw * vc, axis=1)
        tl.store(dv + at_v, (dw * bet[:, None]).to(dv.dtype.element_ty), mask=m_cv)
    tl.store(dbeta + row, dbeta_acc, mask=m_t)
    dA = dA * D  # (do_t . b_s v_s) D_ts
    dB = tl.zeros([C], dtype=tl.float32)
    for j in range(tl.cdiv(K, BJ)):
        o_j = j * BJ + tl.arange(0, BJ)
        m_j = o_j < K
        at_j = row[:, None] * K + o_j[None, :]
        m_cj = m_t[:, None] & m_j[None, :]
        xj = tl.load(x + at_j, mask=m_cj, other=0.0)
        kj = tl.load(k + at_j, mask=m_cj, other=0.0).to(tl.float32)
        dS_acc = tl.zeros([C, BJ], dtype=tl.float32)  # sum over values of do_t . S_n rows j (then dH_n's)
        dH_acc = tl.zeros([C, BJ], dtype=tl.float32)
        for i_v in range(tl.cdiv(V, BV)):
            o_v = i_v * BV + tl.arange(0, BV)
            at_v = row[:, None] * V + o_v[None, :]
            m_cv = m_t[:, None] & (o_v[None, :] < V)
            m_jv = m_j[:, None] & (o_v[None, :] < V)
            doc = tl.load(do + at_v, mask=m_cv, other=0.0).to(tl.float32)
            vb = tl.load(v + at_v, mask=m_cv, other=0.0).to(tl.float32) * bet[:, None]
            S_j = tl.load(h + base + o_j[:, None] * V + o_v[None, :], mask=m_jv, other=0.0)
            dS_j = tl.load(dh + base + o_j[:, None] * V + o_v[None, :], mask=m_jv, other=0.0)
            dS_acc += mm(doc, tl.trans(S_j), PREC, UP)
            dH_acc += mm(vb, tl.trans(dS_j), PREC, UP)
        dx_j = dS_acc * tl.exp(b)[:, None] + mm(dA, kj, PREC, UP)
        dk_j = dH_acc * tl.exp(b_last - b)[:, None] + mm(tl.trans(dA), xj, PREC, UP)
        tl.store(dx + at_j, dx_j, mask=m_cj)
        tl.store(dk + at_j, dk_j, mask=m_cj)
        dB += tl.sum(xj * dx_j, axis=1) - tl.sum(kj * dk_j, axis=1)
    tl.store(dG + row, dB, mask=m_t)


@fast_launch
@triton.jit(do_not_specialize=["T"])
def _solve_grads_kernel(x, k, beta, g, h, dh, u, dk1, dbeta1, dG, ends_h, ends_g, dq, dk, dbeta, dlamb, dg, scale,
                        T, H: tl.constexpr, K: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BJ: tl.constexpr,
                        NE_H: tl.constexpr, NE_G: tl.constexpr, BE: tl.constexpr, PREC: tl.constexpr,
                        UP: tl.constexpr):
    """Grid (N, B*H): the gradients through the solve in chunk n: of y_t = G_t x_t read with the cotangent -u_t
    (module docstring, q = x, w = beta k, c = -u; S = G^T's states h and state gradients dh [B, H, N, K, K]), added
    to the read-out's (dk1, dbeta1, dG): dk = dk1 + dk + beta dw (k's dtype), dbeta = dbeta1 + dw . k (beta's
    dtype), dB = dG + x . dq - k . dk; and dq = scale u (dq's dtype), dlamb[b, h, n] = -sum_{t in chunk n}
    u_t * x_t (float32). k's columns in blocks of BJ: dk's and dw's columns j are both k's columns j, so a block's
    gradients are complete in its iteration (only [C, BJ] accumulators). Then the gates' gradient, chunk-local:
    dg_t = sum_{s >= t in the chunk} dB_s + <dS, S> at the chunk's end (both states' terms, from ends_h [N, NE_H]
    and ends_g [N, NE_G] per batch and head: _dstates_kernel's; BE a power of two >= both), in g's dtype."""
    n, i_bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    N = tl.cdiv(T, C)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    base = (i_bh * N + n) * K * K
    row, m_t, m_ck, b, b_last, bet, xc, kc = _chunk_tiles(x, k, beta, g, n, i_bh, T, H, K, C, BK)
    at = row[:, None] * K + o_k[None, :]
    uc = tl.load(u + at, mask=m_ck, other=0.0)
    tl.store(dq + at, (uc * scale).to(dq.dtype.element_ty), mask=m_ck)
    tl.store(dlamb + (i_bh * N + n) * K + o_k, -tl.sum(uc * xc, axis=0), mask=m_k)
    D = _decay(b, C)
    A = mm(xc, tl.trans(kc), PREC, UP) * D  # (x_t . k_s) D_ts
    kb = kc * bet[:, None]  # w
    dA = mm(uc, tl.trans(kb), PREC, UP) * D  # (u_t . w_s) D_ts = -(c_t . w_s) D_ts
    k_tail = kc * tl.exp(b_last - b)[:, None]
    dB = tl.zeros([C], dtype=tl.float32)
    dbeta_acc = tl.zeros([C], dtype=tl.float32)
    for j in range(tl.cdiv(K, BJ)):
        o_j = j * BJ + tl.arange(0, BJ)
        m_j = o_j < K
        m_cj = m_t[:, None] & m_j[None, :]
        at_j = row[:, None] * K + o_j[None, :]
        m_jk = m_j[:, None] & m_k[None, :]
        xj = tl.load(x + at_j, mask=m_cj, other=0.0)
        kj = tl.load(k + at_j, mask=m_cj, other=0.0).to(tl.float32)
        uj = tl.load(u + at_j, mask=m_cj, other=0.0)
        S_j = tl.load(h + base + o_j[:, None] * K + o_k[None, :], mask=m_jk, other=0.0)  # rows j of S
        dS_j = tl.load(dh + base + o_j[:, None] * K + o_k[None, :], mask=m_jk, other=0.0)  # rows j of dS
        dS_cols = tl.load(dh + base + o_k[:, None] * K + o_j[None, :], mask=m_jk.T, other=0.0)  # columns j
        dq_j = -mm(uc, tl.trans(S_j), PREC, UP) * tl.exp(b)[:, None] - mm(dA, kj, PREC, UP)  # x's gradient
        dk_j = mm(kb, tl.trans(dS_j), PREC, UP) * tl.exp(b_last - b)[:, None] - mm(tl.trans(dA), xj, PREC, UP)
        dw_j = mm(k_tail, dS_cols, PREC, UP) - mm(tl.trans(A), uj, PREC, UP)
        dB += tl.sum(xj * dq_j, axis=1) - tl.sum(kj * dk_j, axis=1)
        dbeta_acc += tl.sum(dw_j * kj, axis=1)
        dk_j += tl.load(dk1 + at_j, mask=m_cj, other=0.0) + bet[:, None] * dw_j
        tl.store(dk + at_j, dk_j.to(dk.dtype.element_ty), mask=m_cj)
    dbeta_acc += tl.load(dbeta1 + row, mask=m_t, other=0.0)
    tl.store(dbeta + row, dbeta_acc.to(dbeta.dtype.element_ty), mask=m_t)
    # b_t is the gates cumulated within the chunk, so g_t reaches b_s for s >= t in its chunk only: the reverse sum
    # stays in the chunk, and what lies past it enters as the chunk end's term (b_C scales the whole state leaving
    # the chunk). Summing dB over the whole sequence instead gives the same number in exact arithmetic, but its
    # terms cancel over thousands of tokens and tf32 products left the sum 1e-2 to 3e-2 off at T = 2048-16384.
    o_e = tl.arange(0, BE)
    end = tl.sum(tl.load(ends_h + (i_bh * N + n) * NE_H + o_e, mask=o_e < NE_H, other=0.0), axis=0)
    end += tl.sum(tl.load(ends_g + (i_bh * N + n) * NE_G + o_e, mask=o_e < NE_G, other=0.0), axis=0)
    last = tl.minimum(C, T - n * C) - 1
    dB += tl.load(dG + row, mask=m_t, other=0.0) + tl.where(tl.arange(0, C) == last, end, 0.0)
    tl.store(dg + row, tl.cumsum(dB, axis=0, reverse=True).to(dg.dtype.element_ty), mask=m_t)


def _options(kernel: str) -> dict:
    """num_warps and num_stages of ``kernel`` from LAUNCH."""
    return {"num_warps": LAUNCH[f"{kernel}_warps"], "num_stages": LAUNCH[f"{kernel}_stages"]}


def _chunk(chunk_size: int) -> int:
    """The kernels' chunk: chunk_size, at most LAUNCH["chunk"] tokens (the same sums in another order)."""
    return min(chunk_size, LAUNCH["chunk"])


def _states(k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, G0: torch.Tensor | None,
            H0: torch.Tensor | None, C: int, prec: str, up: bool
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(S_n = G_n^T [B, H, N, K, K], H_n [B, H, N, K, V], G_T, H_T), float32, in one launch."""
    B, T, H, K = k.shape
    V = v.shape[-1]
    N = cdiv(T, C)
    hk = k.new_empty(B, H, N, K, K, dtype=torch.float32)
    hv = k.new_empty(B, H, N, K, V, dtype=torch.float32)
    GT = k.new_empty(B, H, K, K, dtype=torch.float32)
    HT = k.new_empty(B, H, K, V, dtype=torch.float32)
    BV = min(LAUNCH["scan_BV"], block(K), block(V))
    # an absent initial state: any tensor as the pointer (never read: HAS_G0, HAS_H0), as elsewhere in the library
    _states_kernel[(cdiv(K, BV) + cdiv(V, BV), B * H)](
        k=k, v=v, g=g, beta=beta, hk=hk, hv=hv, g0=GT if G0 is None else G0, h0=HT if H0 is None else H0, gT=GT,
        hT=HT, T=T, H=H, K=K, V=V, C=C, BK=block(K), BV=BV, HAS_G0=G0 is not None, HAS_H0=H0 is not None, PREC=prec,
        UP=up, **_options("scan"))
    return hk, hv, GT, HT


def _dstates(x: torch.Tensor, do: torch.Tensor, g: torch.Tensor, h: torch.Tensor, hT: torch.Tensor,
             dht: torch.Tensor | None, sign: float, transpose: bool, C: int, prec: str, up: bool
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dh [B, H, N, K, W], dS_0 [B, H, K, W], the chunk ends' gate terms [B, H, N, column blocks]) of the read
    y_t = S_t^T x_t with cotangents sign * do, for the chunk-entry states h and the final state hT."""
    B, T, H, K = x.shape
    W = do.shape[-1]
    N = cdiv(T, C)
    dh = x.new_empty(B, H, N, K, W)
    dh0 = x.new_empty(B, H, K, W)
    BV = min(LAUNCH["bscan_BV"], block(W))
    ends = x.new_empty(B, H, N, cdiv(W, BV))
    _dstates_kernel[(cdiv(W, BV), B * H)](  # dht None: dh0 as the (unread) pointer
        x=x, do=do, g=g, h=h, hT=hT, dh=dh, dht=dh0 if dht is None else dht, dh0=dh0, ends=ends, sign=sign, T=T,
        H=H, K=K, W=W, C=C, BK=block(K), BV=BV, HAS_DHT=dht is not None, TRANS=transpose, PREC=prec, UP=up,
        **_options("bscan"))
    return dh, dh0, ends


def mesa_cg_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    lamb: torch.Tensor, G0: torch.Tensor | None, H0: torch.Tensor | None, scale: float, steps: int,
                    chunk_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(o in q's dtype, x float32, G_T, H_T float32): ``steps`` CG steps on (G_t + diag(lamb)) x_t = scale q_t and
    o_t = H_t^T x_t, in three launches (module docstring). Inputs contiguous, any float dtype but float64."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    C = _chunk(chunk_size)
    N = cdiv(T, C)
    prec, up = dot_precision(q.dtype), upcast_dots(q.dtype)
    hk, hv, GT, HT = _states(k, v, g, beta, G0, H0, C, prec, up)
    x = q.new_empty(B, T, H, K, dtype=torch.float32)
    launch = cg_launch(torch.float32, C, prec, k.dtype)
    _chunk_cg_kernel[(N * (C // launch["BR"]), B * H)](
        k=k, beta=beta, g=g, h=hk, lamb=lamb, b=q, x=x, scale=scale, steps=steps, T=T, H=H, K=K, C=C,
        BK=block(K), TRANS=False, NAN_B=True, UP=up, **launch)
    # the read-out in a kernel of its own: in the solve's kernel its products made the compiler hold the keys' tiles
    # in registers across the steps, which then spilled (Triton 3.9, sm_90)
    o = q.new_empty(B, T, H, V)
    BV = min(LAUNCH["out_BV"], block(V))
    _readout_kernel[(cdiv(V, BV) * N, B * H)](
        x=x, k=k, v=v, g=g, beta=beta, h=hv, o=o, T=T, H=H, K=K, V=V, C=C, BK=block(K), BV=BV, PREC=prec, UP=up,
        **_options("out"))
    return o, x, GT, HT


def mesa_cg_backward(x: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     lamb: torch.Tensor, G0: torch.Tensor | None, H0: torch.Tensor | None, do: torch.Tensor,
                     dGT: torch.Tensor | None, dHT: torch.Tensor | None, scale: float, steps: int, chunk_size: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                torch.Tensor, torch.Tensor]:
    """(dq in do's dtype, dk, dv, dg, dbeta, dlamb, dG_0, dH_0 in their inputs' dtypes; an empty tensor for an
    absent initial state) of :func:`mesa_cg_forward` for the cotangents do of o (q's dtype) and dG_T, dH_T of the
    final states (None: zero), in six launches (module docstring)."""
    B, T, H, K = x.shape
    V = v.shape[-1]
    C = _chunk(chunk_size)
    N = cdiv(T, C)
    prec, up = dot_precision(do.dtype), upcast_dots(do.dtype)
    hk, hv, GT, HT = _states(k, v, g, beta, G0, H0, C, prec, up)
    # o_t = H_t^T x_t: its gradients (dx_t = H_t do_t the solve's right-hand side)
    dhv, dH0, ends_h = _dstates(x, do, g, hv, HT, dHT, 1.0, False, C, prec, up)
    dx, dk1 = torch.empty_like(x), torch.empty_like(x)
    dv = torch.empty_like(v)
    dbeta1 = x.new_empty(B, T, H)
    dG = x.new_empty(B, T, H)
    _read_grads_kernel[(N, B * H)](
        x=x, k=k, v=v, beta=beta, g=g, h=hv, dh=dhv, do=do, dx=dx, dk=dk1, dv=dv, dbeta=dbeta1, dG=dG, T=T, H=H, K=K,
        V=V, C=C, BK=block(K), BV=min(LAUNCH["grads_BV"], block(V)), BJ=min(LAUNCH["grads_BK"], block(K)), PREC=prec,
        UP=up, **_options("grads"))
    del hv, dhv  # H's states are done with: the solve's tensors take their memory
    # u_t = (G_t + diag(lamb))^-T dx_t: the same solve with S_n read transposed (S_n^T = G_n)
    u = torch.empty_like(x)
    launch = cg_launch(torch.float32, C, prec, k.dtype)
    _chunk_cg_kernel[(N * (C // launch["BR"]), B * H)](
        k=k, beta=beta, g=g, h=hk, lamb=lamb, b=dx, x=u, scale=1.0, steps=steps, T=T, H=H, K=K, C=C,
        BK=block(K), TRANS=True, NAN_B=False, UP=up, **launch)
    del dx
    # the solve's gradient to G_t is -u_t x_t^T: y_t = G_t x_t read with the cotangent -u_t
    dhk, dS0, ends_g = _dstates(x, u, g, hk, GT, dGT, -1.0, True, C, prec, up)
    dq = x.new_empty(B, T, H, K, dtype=do.dtype)
    dk, dbeta = torch.empty_like(k), torch.empty_like(beta)
    dlamb = x.new_empty(B, H, N, K)
    dg = torch.empty_like(g)
    NE_H, NE_G = ends_h.shape[-1], ends_g.shape[-1]
    _solve_grads_kernel[(N, B * H)](
        x=x, k=k, beta=beta, g=g, h=hk, dh=dhk, u=u, dk1=dk1, dbeta1=dbeta1, dG=dG, ends_h=ends_h, ends_g=ends_g,
        dq=dq, dk=dk, dbeta=dbeta, dlamb=dlamb, dg=dg, scale=scale, T=T, H=H, K=K, C=C, BK=block(K),
        BJ=min(LAUNCH["kk_BV"], block(K)), NE_H=NE_H, NE_G=NE_G, BE=max(2, next_power_of_2(max(NE_H, NE_G))),
        PREC=prec, UP=up, **_options("kk"))
    none = x.new_empty(0)
    return (dq, dk, dv, dg, dbeta, dlamb.sum((0, 2)).to(lamb.dtype),
            none if G0 is None else dS0.to(G0.dtype), none if H0 is None else dH0.to(H0.dtype))


def _forward_fake(q, k, v, g, beta, lamb, G0, H0, scale, steps, chunk_size):
    B, T, H, K = q.shape
    f32 = torch.float32
    return (q.new_empty(B, T, H, v.shape[-1]), q.new_empty(B, T, H, K, dtype=f32), q.new_empty(B, H, K, K, dtype=f32),
            q.new_empty(B, H, K, v.shape[-1], dtype=f32))


def _backward_fake(x, k, v, g, beta, lamb, G0, H0, do, dGT, dHT, scale, steps, chunk_size):
    return (x.new_empty(x.shape, dtype=do.dtype), torch.empty_like(k), torch.empty_like(v), torch.empty_like(g),
            torch.empty_like(beta), torch.empty_like(lamb), x.new_empty(0) if G0 is None else torch.empty_like(G0),
            x.new_empty(0) if H0 is None else torch.empty_like(H0))


_forward_op = define_op("mesa_net_cg_fwd", mesa_cg_forward, _forward_fake)
_backward_op = define_op("mesa_net_cg_bwd", mesa_cg_backward, _backward_fake)


def _setup_context(ctx, inputs, output):
    q, k, v, g, beta, lamb, G0, H0, scale, steps, chunk_size = inputs
    ctx.save_for_backward(output[1], k, v, g, beta, lamb, G0, H0)
    ctx.scale, ctx.steps, ctx.chunk_size, ctx.out_dtype = scale, steps, chunk_size, output[0].dtype


def _backward_rule(ctx, do, dx, dGT, dHT):
    x, k, v, g, beta, lamb, G0, H0 = ctx.saved_tensors
    run = mesa_cg_backward if eager_backward(ctx) else _backward_op
    if do is None:
        do = x.new_zeros(*x.shape[:-1], v.shape[-1], dtype=ctx.out_dtype)
    dq, dk, dv, dg, dbeta, dlamb, dG0, dH0 = run(
        x, k, v, g, beta, lamb, G0, H0, do.contiguous(), None if dGT is None else dGT.contiguous(),
        None if dHT is None else dHT.contiguous(), ctx.scale, ctx.steps, ctx.chunk_size)
    return (dq, dk, dv, dg, dbeta, dlamb, None if G0 is None else dG0, None if H0 is None else dH0, None, None, None)


_mesa_cg = op_function("mesa_net_cg_function", mesa_cg_forward, _forward_op, _setup_context, _backward_rule,
                       non_differentiable=(1,))


def mesa_net_cg_fused(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      lamb: torch.Tensor, *, scale: float, initial_state: MesaState | None, output_final_state: bool,
                      chunk_size: int, cg_steps: int | None) -> tuple[torch.Tensor, MesaState | None]:
    """G_t = exp(g_t) G_{t-1} + beta_t k_t k_t^T, H_t = exp(g_t) H_{t-1} + beta_t k_t v_t^T, o_t = H_t^T x_t with x_t
    ``cg_steps`` (None: K) CG steps on (G_t + diag(lamb)) x_t = scale q_t, on this module's kernels (head dims up to
    128, inputs bf16, fp16 or float32); differentiable (implicitly). Returns (o in q's dtype, final (G, H) in
    float32 or None)."""
    q, k, v, g, beta, lamb = (x.contiguous() for x in (q, k, v, g, beta, lamb))
    G0, H0 = (None, None) if initial_state is None else (x.contiguous() for x in initial_state)
    check_cg_system(k, g, beta, G0, torch.float32)
    steps = q.shape[-1] if cg_steps is None else cg_steps
    o, _, GT, HT = _mesa_cg(q, k, v, g, beta, lamb, G0, H0, float(scale), steps, chunk_size)
    return o, ((GT, HT) if output_final_state else None)
