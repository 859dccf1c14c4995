"""Triton kernels (forward and backward) of TTT-Linear, with or without the inner LayerNorm.

Per head, mini-batches j of b tokens entered with weights W_j [K, V]; q~ = scale q; every gradient of a mini-batch
is taken at W_j (inner.py):

    Z = K W_j,        err = dLN^T (K + LN(Z) - V)   (inner norm; K == V)   or   err = Z - V   (plain)
    W_{j+1} = W_j - K^T (eta ⊙ err)
    Zq = Q~ W_j - A err,   A = (Q~ K^T) ⊙ [eta_s]_{ts} ⊙ [s <= t, same mini-batch]
    o = Q~ + LN(Zq)   (inner norm)   or   o = Zq   (plain)

LN(z) = w ⊙ (z - mean z) r + beta over the V channels, r = (var z + eps)^-1/2; dLN^T e = r (g - mean g - h mean(g h))
with g = w ⊙ e and h = (z - mean z) r. Only err needs the running weights: the norm couples every value channel of
Z, so a mini-batch needs the whole W_j, and the mini-batches form a sequential chain. Everything else is parallel
over chunks of 64 tokens (64 / b mini-batches): from the weights W_c entering chunk c,
W_j = W_c - sum_{s in c, before mini-batch j} k_s eta_s err_s^T, so for all tokens t of the chunk at once

    Zq = Q~ W_c - ((Q~ K^T) ⊙ [eta_s] ⊙ M) err,   M_ts = [s <= t]

(the earlier mini-batches of the chunk through W_j, the causal part of t's own through A).

Forward, two kernels:

1. scan, a program per batch-head with W in float32 registers, per mini-batch: Z = K W, its LayerNorm statistics
   and err, then W -= K^T (eta ⊙ err). Three dots a mini-batch: for bf16/fp16 inputs K is exact in tf32, and
   eta ⊙ err = hi + lo with hi its leading 10 mantissa bits (exact in tf32), so K^T hi + K^T lo in tf32 is as
   accurate as float32 (3xTF32 with its third product, K's low part, zero); float32 inputs: one ieee dot. Writes
   h [V] and r per token (norm) or err [V] (plain) in float32, the W_c every 64 tokens and the final W.
2. output, a program per (batch-head, chunk): err from h and r (e = k + w ⊙ h + beta - v, err = dLN^T(w ⊙ e)),
   Zq by the chunk form above, o.

Backward, dW_{j+1} the gradient of the weights leaving mini-batch j (from the later mini-batches and the final state):

    dZq = dLN^T(w ⊙ do) at Zq (norm) or do;     P = dZq err^T;     dA = -P ⊙ [s <= t, same mini-batch]
    dq~ = do (norm) + dZq W_j^T + dS K,   dS = dA ⊙ [eta_s];   dk += dS^T Q~;   deta_s += sum_t (dA ⊙ Q~ K^T)_ts
    derr = -A^T dZq - (eta ⊙ K) dW_{j+1};   d(eta ⊙ k) = -err dW_{j+1}^T: dk += eta d(eta ⊙ k),
                                            deta += rowsum(k ⊙ d(eta ⊙ k))
    err = r (g - mean g - h mean(g h)):   dg = r (derr - mean derr - h mean(derr h)),
                                          dh = -r mean(g h) derr - r mean(derr h) g,   dr = (derr . err) / r
    g = w ⊙ e, e = K + w ⊙ h + beta - V:  de = w ⊙ dg, dk += de, dv = -de, dh += w ⊙ de, dw += e dg + de h, dbeta += de
    h, r of Z:                            dZ = r (dh - mean dh - h mean(dh h)) - (r^2 / V) dr h,    dk += dZ W_j^T
    dW_j = dW_{j+1} + Q~^T dZq + K^T dZ

(plain: dZ = derr, dv = -derr). Three kernels:

1. pre, a program per (batch-head, chunk): Zq again by the chunk form, dZq (kept, float32; plain: do itself), the
   output LayerNorm's parameter gradients (this chunk's share), and -A^T dZq (float32).
2. scan in reverse, a program per batch-head with dW in float32 registers, per mini-batch four dots: derr,
   d(eta ⊙ k), the inner LayerNorm backward (from the kept h and r), dW += Q~^T dZq + K^T dZ. Writes dZ (float32,
   over -A^T dZq), dv, the partial dk and deta, the inner LayerNorm's parameter gradients (this program's share)
   and dW_0, the initial weights' gradient.
3. post, a program per (batch-head, chunk): the terms at W_j in chunk form (W_j^T = W_c^T - sum err_s eta_s k_s^T
   over the earlier mini-batches) joined with those of dA:

       dq~ = do (norm) + dZq W_c^T - (P ⊙ [eta_s] ⊙ M) K
       dk += dZ W_c^T - ((dZ err^T) ⊙ [eta_s] ⊙ M') K - (P ⊙ [eta_s] ⊙ M'')^T Q~
       deta_s -= sum_t (P ⊙ M'' ⊙ Q~ K^T)_ts

   with M'_ts = [s's mini-batch before t's] and M'' = M - M' (same mini-batch, s <= t).

Kept for the backward pass, per token and head: h [V] and r (norm) or err [V] (plain), float32, and the chunk-entry
weights (K V / 64 floats). Checked against autograd of the recurrence (tests/ops/test_triton_ttt.py).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..common.registered_ops import define_op
from ..common.triton_launch import fast_launch
from ..common.triton_masking import causal_dot_rest
from ..common.triton_ops import eager_backward, needs_backward, op_function
from ..common.triton_utils import block as _block
from ..common.triton_utils import cdiv, dot_precision, launch_overrides
from .checks import TRITON_MAX_HEAD_DIM, TRITON_MINI_BATCH_SIZES, triton_takes

TOKENS_PER_CHUNK = 64  # the forward keeps W every 64 tokens (64 / b mini-batches): the parallel kernels' chunks
# Warps and pipelining stages per kernel: "fwd_scan", "fwd_out" (forward), "bwd_pre", "bwd_scan", "bwd_post"
# (backward). 8 warps: the chunk kernels hold [64, 128] and [128, 128] float32 tiles (with 4 warps they spilled 1-2 KB
# a thread, with 16 more than with 8). Two stages in the forward scan (it loads the next mini-batch early, at 4 KB more
# shared memory, compiled for sm_90 at K = V = 128; ``python -m linattn.bench.triton_resources`` shows each kernel's),
# one in the backward's: ``python -m linattn.bench.triton_tune --family ttt_linear`` on an H200 (bf16, B 4, T 16384,
# H 16, K = V = 128) timed the forward scan at 4.48 ms with one stage and 4.21 with two, the backward scan at 8.34
# and 9.71. Scans with 4 warps gave outputs 16% away from the defaults' there (and took 1.5-3x longer): a fault not
# yet understood (compiler or kernel); keep 8.
LAUNCH = {"fwd_scan_warps": 8, "fwd_scan_stages": 2, "fwd_out_warps": 8, "fwd_out_stages": 1,
          "bwd_pre_warps": 8, "bwd_pre_stages": 1, "bwd_scan_warps": 8, "bwd_scan_stages": 1,
          "bwd_post_warps": 8, "bwd_post_stages": 1}
launch_overrides("ttt_linear", LAUNCH)


def _launch(kernel: str) -> dict:
    return {"num_warps": LAUNCH[f"{kernel}_warps"], "num_stages": LAUNCH[f"{kernel}_stages"]}


@triton.jit
def _ln_stats(z, m_v, V: tl.constexpr, eps):
    """(h, r) of LayerNorm over the valid V columns of z [b, BV]: h = (z - mean) r (0 in padded columns)."""
    mu = tl.sum(z, axis=1) / V
    zc = tl.where(m_v[None, :], z - mu[:, None], 0.0)
    r = 1.0 / tl.sqrt(tl.sum(zc * zc, axis=1) / V + eps)
    return zc * r[:, None], r


@triton.jit
def _sum_pairs(a0, a1, b0, b1):
    return a0 + b0, a1 + b1


@triton.jit
def _sum_triples(a0, a1, a2, b0, b1, b2):
    return a0 + b0, a1 + b1, a2 + b2


@triton.jit
def _ln_apply(x, h, r, mx, mxh, m_v):
    """r (x - mx - h mxh) over the valid V columns, 0 elsewhere."""
    return tl.where(m_v[None, :], r[:, None] * (x - mx[:, None] - h * mxh[:, None]), 0.0)


@triton.jit
def _ln_grad(x, h, r, m_v, V: tl.constexpr):
    """(r (x - mean x - h mean(x h)) over the valid V columns (the LayerNorm backward at h, r; 0 elsewhere), and
    mean(x h)). The row sums are one reduction of two operands: one exchange between the warps, not two."""
    sx, sxh = tl.reduce((x, x * h), 1, _sum_pairs)
    return _ln_apply(x, h, r, sx / V, sxh / V, m_v), sxh / V


@triton.jit
def _inner_err(h, r, kc, vc, wl, bl, m_v, V: tl.constexpr):
    """(err, e, g, mean(g h)) of the inner norm at (h, r): e = k + w ⊙ h + beta - v (K == V: k and v share the
    column index), g = w ⊙ e, err = dLN^T e."""
    e = tl.where(m_v[None, :], kc + wl[None, :] * h + bl[None, :] - vc, 0.0)
    g = wl[None, :] * e
    err, mgh = _ln_grad(g, h, r, m_v, V)
    return err, e, g, mgh


@triton.jit
def _load_rows(x, row, m_t, o_d, m_d, D: tl.constexpr):
    """Rows ``row`` of a [rows, D] tensor (masked by m_t) as float32 [n, BD], 0 outside."""
    return tl.load(x + row[:, None] * D + o_d[None, :], mask=m_t[:, None] & m_d[None, :], other=0.0).to(tl.float32)


@triton.jit
def _store_rows(x, row, m_t, o_d, m_d, D: tl.constexpr, val):
    """``val`` [n, BD] into rows ``row`` of a [rows, D] tensor (m_t's rows and the valid columns), in x's dtype."""
    tl.store(x + row[:, None] * D + o_d[None, :], val.to(x.dtype.element_ty), mask=m_t[:, None] & m_d[None, :])


@triton.jit
def state_program(H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                  BV: tl.constexpr):
    """A (batch-head, V block) program's indices (grid (B*H, V blocks); a 1-D grid is one V block): i_bh, i_v, i_b,
    i_h, the token, key and value offsets, their masks, and the offsets (and mask) of its [K, BV] slice of a [K, V]
    state (the scans of this module and titans')."""
    i_bh = tl.program_id(0).to(tl.int64)
    i_v = tl.program_id(1)
    o_k, o_t = tl.arange(0, BK), tl.arange(0, BT)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    return (i_bh, i_v, i_bh // H, i_bh % H, o_k, o_t, o_v, m_k, m_v, o_k[:, None] * V + o_v[None, :],
            m_k[:, None] & m_v[None, :])


@triton.jit
def _norm_params(w_ln, b_ln, i_h, o_v, m_v, V: tl.constexpr, BV: tl.constexpr, NORM: tl.constexpr):
    """The inner LayerNorm's weight and bias [BV] of head i_h, float32 (zeros without the norm)."""
    if NORM:
        wl = tl.load(w_ln + i_h * V + o_v, mask=m_v, other=0.0).to(tl.float32)
        bl = tl.load(b_ln + i_h * V + o_v, mask=m_v, other=0.0).to(tl.float32)
    else:
        wl = tl.zeros([BV], dtype=tl.float32)
        bl = tl.zeros([BV], dtype=tl.float32)
    return wl, bl


@triton.jit
def _stored_err(hs, rs, kc, v, wl, bl, row, m_t, o_v, m_v, V: tl.constexpr, NORM: tl.constexpr):
    """(err, h, r, e, g, mean(g h)) of the rows ``row`` from what the forward scan kept: err itself (plain; the rest
    unused), or h and r (norm). Padded rows read r = 1 (their err is finite; every product weighs them by eta = 0)."""
    hv = _load_rows(hs, row, m_t, o_v, m_v, V)
    if NORM:
        r = tl.load(rs + row, mask=m_t, other=1.0)
        err, e, g, mgh = _inner_err(hv, r, kc, _load_rows(v, row, m_t, o_v, m_v, V), wl, bl, m_v, V)
    else:
        err, e, g = hv, hv, hv
        r = tl.sum(hv, axis=1)
        mgh = r
    return err, hv, r, e, g, mgh


@triton.jit
def _descend(W, kc, x, PREC: tl.constexpr, SPLIT: tl.constexpr):
    """W - K^T x. SPLIT (bf16/fp16 inputs: K exact in tf32): x = hi + lo with hi x's 10 leading mantissa bits, two
    tf32 dots as accurate as float32 (plain tf32 drifted past the bf16 tolerance over long sequences, the update
    accumulating over the whole sequence); else one dot at PREC."""
    kt = tl.trans(kc)
    if SPLIT:
        hi = (x.to(tl.int32, bitcast=True) & -8192).to(tl.float32, bitcast=True)  # -8192: the top 19 bits set
        d = tl.dot(kt, hi, tl.dot(kt, x - hi, input_precision="tf32"), input_precision="tf32")
    else:
        d = tl.dot(kt, x, input_precision=PREC)
    return W - d


@triton.jit
def _chunk_program(T, H: tl.constexpr, BC: tl.constexpr):
    """A (chunk, batch-head) program's chunk index, batch-head, head, the rows (into [B, T, H, *] tensors) of its
    tokens and which of them lie inside the sequence."""
    i_c = tl.program_id(0)
    i_bh = tl.program_id(1).to(tl.int64)
    t = i_c * BC + tl.arange(0, BC)
    return i_c, i_bh, i_bh % H, ((i_bh // H) * T + t) * H + i_bh % H, t < T


@triton.jit
def _chunk_read(q, k, v, eta, wc, hs, rs, wl, bl, i_bh, i_c, row, m_t, o_c, o_k, o_v, m_k, m_v, scale, T,
                K: tl.constexpr, V: tl.constexpr, BC: tl.constexpr, NORM: tl.constexpr, PREC: tl.constexpr,
                CONFINE: tl.constexpr):
    """(Zq, Q~, S = Q~ K^T, eta) of a chunk: Zq = Q~ W_c - ((Q~ K^T) ⊙ [eta_s] ⊙ [s <= t]) err. CONFINE (the
    forward): row t reads err rows <= t only, so a non-finite err reaches the later rows alone (triton_masking.py);
    the backward's recomputation, equal on finite inputs, saves that tile's cumulative sum. Loads in the order that
    lets the [K, V] weights die first (registers)."""
    qs = _load_rows(q, row, m_t, o_k, m_k, K) * scale
    W = tl.load(wc + (i_bh * tl.cdiv(T, BC) + i_c) * K * V + o_k[:, None] * V + o_v[None, :],
                mask=m_k[:, None] & m_v[None, :], other=0.0)
    Zq = tl.dot(qs, W, input_precision=PREC)
    kc = _load_rows(k, row, m_t, o_k, m_k, K)
    S = tl.dot(qs, tl.trans(kc), input_precision=PREC)
    et = tl.load(eta + row, mask=m_t, other=0.0).to(tl.float32)
    A = tl.where(o_c[:, None] >= o_c[None, :], S * et[None, :], 0.0)
    err, h, r, e, g, mgh = _stored_err(hs, rs, kc, v, wl, bl, row, m_t, o_v, m_v, V, NORM)
    if CONFINE:
        err_fin, err_rest = causal_dot_rest(err)
        Zq -= tl.dot(A, err_fin, input_precision=PREC) + err_rest
    else:
        Zq -= tl.dot(A, err, input_precision=PREC)
    return Zq, qs, S, et


@fast_launch
@triton.jit(do_not_specialize=["T"])
def _ttt_fwd_scan_kernel(k, v, eta, w_ln, b_ln, w0, wt, wc, hs, rs, eps, T, H: tl.constexpr, K: tl.constexpr,
                         V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, NB: tl.constexpr,
                         NORM: tl.constexpr, HAS_W0: tl.constexpr, PREC: tl.constexpr, SPLIT: tl.constexpr):
    """Grid (B*H,): the final weights wt, the weights wc [B, H, NC, K, V] entering every chunk of NB mini-batches,
    and per token h [B, T, H, V] and r [B, T, H] (norm) or err (plain, into hs)."""
    i_bh, _, i_b, i_h, o_k, o_t, o_v, m_k, m_v, kv, m_kv = state_program(H, K, V, BT, BK, BV)
    W = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_W0:
        W += tl.load(w0 + i_bh * K * V + kv, mask=m_kv, other=0.0)
    wl, bl = _norm_params(w_ln, b_ln, i_h, o_v, m_v, V, BV, NORM)
    NM = tl.cdiv(T, BT)
    NC = tl.cdiv(NM, NB)
    for m in range(NM):
        if m % NB == 0:
            tl.store(wc + (i_bh * NC + m // NB) * K * V + kv, W, mask=m_kv)
        t = m * BT + o_t
        m_t = t < T
        row = (i_b * T + t) * H + i_h
        kc = _load_rows(k, row, m_t, o_k, m_k, K)
        vc = _load_rows(v, row, m_t, o_v, m_v, V)
        et = tl.load(eta + row, mask=m_t, other=0.0).to(tl.float32)
        Z = tl.dot(kc, W, input_precision=PREC)
        if NORM:
            h, r = _ln_stats(Z, m_v, V, eps)
            err, e, g, mgh = _inner_err(h, r, kc, vc, wl, bl, m_v, V)
            _store_rows(hs, row, m_t, o_v, m_v, V, h)
            tl.store(rs + row, r, mask=m_t)
        else:
            err = Z - vc
            _store_rows(hs, row, m_t, o_v, m_v, V, err)
        W = _descend(W, kc, err * et[:, None], PREC, SPLIT)
    tl.store(wt + i_bh * K * V + kv, W, mask=m_kv)


@fast_launch
@triton.jit(do_not_specialize=["T"])
def _ttt_fwd_out_kernel(q, k, v, eta, w_ln, b_ln, wc, hs, rs, o, scale, eps, T, H: tl.constexpr, K: tl.constexpr,
                        V: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, NORM: tl.constexpr,
                        PREC: tl.constexpr):
    """Grid (chunks, B*H): o of one chunk of BC tokens, from its entry weights and the kept err (or h, r)."""
    i_c, i_bh, i_h, row, m_t = _chunk_program(T, H, BC)
    o_k, o_v, o_c = tl.arange(0, BK), tl.arange(0, BV), tl.arange(0, BC)
    m_k, m_v = o_k < K, o_v < V
    wl, bl = _norm_params(w_ln, b_ln, i_h, o_v, m_v, V, BV, NORM)
    Zq, qs, S, et = _chunk_read(q, k, v, eta, wc, hs, rs, wl, bl, i_bh, i_c, row, m_t, o_c, o_k, o_v, m_k, m_v, scale,
                                T, K, V, BC, NORM, PREC, True)
    if NORM:
        hq, rq = _ln_stats(Zq, m_v, V, eps)
        out = qs + wl[None, :] * hq + bl[None, :]  # the residual q~ (K == V)
    else:
        out = Zq
    _store_rows(o, row, m_t, o_v, m_v, V, out)


@fast_launch
@triton.jit(do_not_specialize=["T"])
def _ttt_bwd_pre_kernel(q, k, v, eta, w_ln, b_ln, wc, hs, rs, do, dzq, derr, dwl, dbl, scale, eps, T,
                        H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
                        BK: tl.constexpr, BV: tl.constexpr, NORM: tl.constexpr, PREC: tl.constexpr):
    """Grid (chunks, B*H): for one chunk, dZq (norm; plain: do is dZq), -A^T dZq into derr, and this chunk's share
    of the output LayerNorm's parameter gradients (dwl, dbl [B, H, chunks, V])."""
    i_c, i_bh, i_h, row, m_t = _chunk_program(T, H, BC)
    o_k, o_v, o_c = tl.arange(0, BK), tl.arange(0, BV), tl.arange(0, BC)
    m_k, m_v = o_k < K, o_v < V
    wl, bl = _norm_params(w_ln, b_ln, i_h, o_v, m_v, V, BV, NORM)
    if NORM:
        Zq, qs, S, et = _chunk_read(q, k, v, eta, wc, hs, rs, wl, bl, i_bh, i_c, row, m_t, o_c, o_k, o_v, m_k, m_v,
                                    scale, T, K, V, BC, NORM, PREC, False)
        hq, rq = _ln_stats(Zq, m_v, V, eps)
        doc = _load_rows(do, row, m_t, o_v, m_v, V)
        dZq = _ln_grad(wl[None, :] * doc, hq, rq, m_v, V)[0]
        _store_rows(dzq, row, m_t, o_v, m_v, V, dZq)
        share = (i_bh * tl.cdiv(T, BC) + i_c) * V + o_v
        tl.store(dwl + share, tl.sum(doc * hq, axis=0), mask=m_v)
        tl.store(dbl + share, tl.sum(doc, axis=0), mask=m_v)
    else:
        qs = _load_rows(q, row, m_t, o_k, m_k, K) * scale
        S = tl.dot(qs, tl.trans(_load_rows(k, row, m_t, o_k, m_k, K)), input_precision=PREC)
        et = tl.load(eta + row, mask=m_t, other=0.0).to(tl.float32)
        dZq = _load_rows(do, row, m_t, o_v, m_v, V)
    own = (o_c[:, None] // BT == o_c[None, :] // BT) & (o_c[:, None] >= o_c[None, :])
    A = tl.where(own, S * et[None, :], 0.0)  # each mini-batch's A (the chunk's earlier mini-batches act through W_j)
    _store_rows(derr, row, m_t, o_v, m_v, V, -tl.dot(tl.trans(A), dZq, input_precision=PREC))


@fast_launch
@triton.jit(do_not_specialize=["T"])
def _ttt_bwd_scan_kernel(q, k, v, eta, w_ln, b_ln, hs, rs, dzq, derr, dwt, dk, dv, deta, dw0, dwl, dbl, scale, T,
                         H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                         BV: tl.constexpr, NORM: tl.constexpr, HAS_DWT: tl.constexpr, PREC: tl.constexpr):
    """Grid (B*H,): walks the mini-batches in reverse with dW in registers. Reads -A^T dZq from derr and writes dZ
    over it (each row is read before it is written, by this program alone); writes dv, the partial dk and deta
    (float32), the initial weights' gradient dw0 and this program's share of the inner LayerNorm's parameter
    gradients (dwl, dbl [B, H, V])."""
    i_bh, _, i_b, i_h, o_k, o_t, o_v, m_k, m_v, kv, m_kv = state_program(H, K, V, BT, BK, BV)
    wl, bl = _norm_params(w_ln, b_ln, i_h, o_v, m_v, V, BV, NORM)
    dwl_acc = tl.zeros([BV], dtype=tl.float32)
    dbl_acc = tl.zeros([BV], dtype=tl.float32)
    dW = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_DWT:
        dW += tl.load(dwt + i_bh * K * V + kv, mask=m_kv, other=0.0)
    NM = tl.cdiv(T, BT)
    for mi in range(NM):
        m = NM - 1 - mi
        t = m * BT + o_t
        m_t = t < T
        row = (i_b * T + t) * H + i_h
        qs = _load_rows(q, row, m_t, o_k, m_k, K) * scale
        kc = _load_rows(k, row, m_t, o_k, m_k, K)
        et = tl.load(eta + row, mask=m_t, other=0.0).to(tl.float32)
        err, h, r, e, g, mgh = _stored_err(hs, rs, kc, v, wl, bl, row, m_t, o_v, m_v, V, NORM)
        dZq = _load_rows(dzq, row, m_t, o_v, m_v, V)
        d_err = _load_rows(derr, row, m_t, o_v, m_v, V) - tl.dot(kc * et[:, None], dW, input_precision=PREC)
        dke = -tl.dot(err, tl.trans(dW), input_precision=PREC)  # gradient of eta ⊙ k
        dkc = dke * et[:, None]
        det = tl.sum(kc * dke, axis=1)
        if NORM:
            sd, sdh, sde = tl.reduce((d_err, d_err * h, d_err * err), 1, _sum_triples)  # one exchange for three
            dg = _ln_apply(d_err, h, r, sd / V, sdh / V, m_v)
            dh = -(r * mgh)[:, None] * d_err - (r * sdh / V)[:, None] * g
            dr = sde / r
            de = wl[None, :] * dg
            dwl_acc += tl.sum(e * dg + de * h, axis=0)
            dbl_acc += tl.sum(de, axis=0)
            dkc += de
            dvc = -de
            dh += wl[None, :] * de
            dZ = _ln_grad(dh, h, r, m_v, V)[0] - (r * r * dr / V)[:, None] * h
        else:
            dZ = d_err
            dvc = -d_err
        dW += tl.dot(tl.trans(qs), dZq, input_precision=PREC) + tl.dot(tl.trans(kc), dZ, input_precision=PREC)
        _store_rows(derr, row, m_t, o_v, m_v, V, dZ)
        _store_rows(dk, row, m_t, o_k, m_k, K, dkc)
        _store_rows(dv, row, m_t, o_v, m_v, V, dvc)
        tl.store(deta + row, det, mask=m_t)
    tl.store(dw0 + i_bh * K * V + kv, dW, mask=m_kv)
    if NORM:
        tl.store(dwl + i_bh * V + o_v, dwl_acc, mask=m_v)
        tl.store(dbl + i_bh * V + o_v, dbl_acc, mask=m_v)


@fast_launch
@triton.jit(do_not_specialize=["T"])
def _ttt_bwd_post_kernel(q, k, v, eta, w_ln, b_ln, wc, hs, rs, do, dzq, dz, dkp, detp, dq, dk, deta, scale, T,
                         H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
                         BK: tl.constexpr, BV: tl.constexpr, NORM: tl.constexpr, PREC: tl.constexpr):
    """Grid (chunks, B*H): dq, dk, deta of one chunk in the inputs' dtypes: the terms at the mini-batches' weights
    (in chunk form, from the chunk's entry weights) and those of dA, added to the scan's partial dk and deta."""
    i_c, i_bh, i_h, row, m_t = _chunk_program(T, H, BC)
    o_k, o_v, o_c = tl.arange(0, BK), tl.arange(0, BV), tl.arange(0, BC)
    m_k, m_v = o_k < K, o_v < V
    # ordered so that the large tiles die early (W first): registers and shared memory
    W = tl.load(wc + (i_bh * tl.cdiv(T, BC) + i_c) * K * V + o_k[:, None] * V + o_v[None, :],
                mask=m_k[:, None] & m_v[None, :], other=0.0)
    dZq = _load_rows(dzq, row, m_t, o_v, m_v, V)
    dqs = tl.dot(dZq, tl.trans(W), input_precision=PREC)
    dZ = _load_rows(dz, row, m_t, o_v, m_v, V)
    dkc = tl.dot(dZ, tl.trans(W), input_precision=PREC)
    wl, bl = _norm_params(w_ln, b_ln, i_h, o_v, m_v, V, BV, NORM)
    kc = _load_rows(k, row, m_t, o_k, m_k, K)
    err, h, r, e, g, mgh = _stored_err(hs, rs, kc, v, wl, bl, row, m_t, o_v, m_v, V, NORM)
    P = tl.dot(dZq, tl.trans(err), input_precision=PREC)
    PZ = tl.dot(dZ, tl.trans(err), input_precision=PREC)
    et = tl.load(eta + row, mask=m_t, other=0.0).to(tl.float32)
    causal = o_c[:, None] >= o_c[None, :]
    earlier = o_c[:, None] // BT > o_c[None, :] // BT  # s's mini-batch before t's: W_j's updates inside the chunk
    own = causal & (o_c[:, None] // BT == o_c[None, :] // BT)  # same mini-batch, s <= t: where A lives
    Pe = P * et[None, :]
    # dZ W_j^T over the earlier mini-batches' updates; dZq W_j^T's and dS K's (dS = -P ⊙ eta_s ⊙ own) together
    dkc -= tl.dot(tl.where(earlier, PZ * et[None, :], 0.0), kc, input_precision=PREC)
    dqs -= tl.dot(tl.where(causal, Pe, 0.0), kc, input_precision=PREC)
    qs = _load_rows(q, row, m_t, o_k, m_k, K) * scale
    S = tl.dot(qs, tl.trans(kc), input_precision=PREC)
    dkc -= tl.dot(tl.trans(tl.where(own, Pe, 0.0)), qs, input_precision=PREC)  # dS^T Q~
    dkc += _load_rows(dkp, row, m_t, o_k, m_k, K)
    det = tl.load(detp + row, mask=m_t, other=0.0) - tl.sum(tl.where(own, P * S, 0.0), axis=0)  # dA ⊙ S over t
    if NORM:
        dqs += _load_rows(do, row, m_t, o_v, m_v, V)  # the residual q~ (K == V)
    _store_rows(dq, row, m_t, o_k, m_k, K, dqs * scale)
    _store_rows(dk, row, m_t, o_k, m_k, K, dkc)
    tl.store(deta + row, det.to(deta.dtype.element_ty), mask=m_t)


class _Geometry(NamedTuple):
    """Sizes of a call: the shape, the blocks every kernel takes, NB mini-batches and BC tokens a chunk, NC chunks."""

    B: int
    T: int
    H: int
    K: int
    V: int
    blk: dict
    NB: int
    BC: int
    NC: int


def _geometry(q: torch.Tensor, v: torch.Tensor, b: int) -> _Geometry:
    B, T, H, K = q.shape
    V = v.shape[-1]
    NB = max(1, TOKENS_PER_CHUNK // b)
    return _Geometry(B, T, H, K, V, dict(BK=_block(K), BV=_block(V)), NB, NB * b, cdiv(T, NB * b))


def ttt_triton_forward(q, k, v, eta, w0, w_ln, b_ln, scale, eps, b, keep):
    """(o, final W float32, and when ``keep``: the chunk-entry weights [B, H, NC, K, V], h [B, T, H, V] and r
    [B, T, H] (norm; r empty for plain, whose err [B, T, H, V] takes h's place), all float32; else three empty
    tensors). q, k, v, eta contiguous [B, T, H, *]; w_ln, b_ln [H, V] or None (plain)."""
    B, T, H, K, V, blk, NB, BC, NC = _geometry(q, v, b)
    norm = w_ln is not None
    f32 = dict(device=q.device, dtype=torch.float32)
    wt = torch.empty(B, H, K, V, **f32)
    wc = torch.empty(B, H, NC, K, V, **f32)  # the output kernel reads them: kept with or without a backward pass
    hs = torch.empty(B, T, H, V, **f32)
    rs = torch.empty(B, T, H, **f32) if norm else wt.new_empty(0)
    ln = dict(w_ln=w_ln if norm else wt, b_ln=b_ln if norm else wt)
    prec = dot_precision(q.dtype)
    _ttt_fwd_scan_kernel[(B * H,)](
        k=k, v=v, eta=eta, **ln, w0=w0 if w0 is not None else wt, wt=wt, wc=wc, hs=hs, rs=rs if norm else hs,
        eps=eps, T=T, H=H, K=K, V=V, BT=b, **blk, NB=NB, NORM=norm, HAS_W0=w0 is not None, PREC=prec,
        SPLIT=q.dtype != torch.float32, **_launch("fwd_scan"))
    o = torch.empty_like(v)
    _ttt_fwd_out_kernel[(NC, B * H)](
        q=q, k=k, v=v, eta=eta, **ln, wc=wc, hs=hs, rs=rs if norm else hs, o=o, scale=scale, eps=eps, T=T, H=H,
        K=K, V=V, BC=BC, **blk, NORM=norm, PREC=prec, **_launch("fwd_out"))
    if not keep:
        wc, hs, rs = (wt.new_empty(0) for _ in range(3))
    return o, wt, wc, hs, rs


def ttt_triton_backward(q, k, v, eta, w_ln, b_ln, scale, eps, b, wc, hs, rs, do, dwt):
    """(dq, dk, dv, deta, dW0 float32, dw_ln, db_ln [H, V] float32; empty without the norm) from what the forward
    kept (``wc``, ``hs``, ``rs``)."""
    B, T, H, K, V, blk, NB, BC, NC = _geometry(q, v, b)
    norm = w_ln is not None
    f32 = dict(device=q.device, dtype=torch.float32)
    prec = dot_precision(q.dtype)
    dw0 = torch.empty(B, H, K, V, **f32)
    ln = dict(w_ln=w_ln if norm else dw0, b_ln=b_ln if norm else dw0)
    rs = rs if norm else hs
    common = dict(q=q, k=k, v=v, eta=eta, **ln, hs=hs, rs=rs, scale=scale, T=T, H=H, K=K, V=V, **blk, NORM=norm,
                  PREC=prec)
    dzq = torch.empty(B, T, H, V, **f32) if norm else do  # plain: dZq = do
    derr = torch.empty(B, T, H, V, **f32)  # -A^T dZq, then dZ
    out_ln = torch.empty(2, B, H, NC, V, **f32) if norm else (dw0, dw0)  # the output LayerNorm's (dw, dbeta) shares
    _ttt_bwd_pre_kernel[(NC, B * H)](
        **common, wc=wc, do=do, dzq=dzq, derr=derr, dwl=out_ln[0], dbl=out_ln[1], eps=eps, BT=b, BC=BC,
        **_launch("bwd_pre"))
    dkp = torch.empty(B, T, H, K, **f32)
    detp = torch.empty(B, T, H, **f32)
    dv = torch.empty_like(v)
    inner_ln = torch.empty(2, B, H, V, **f32) if norm else (dw0, dw0)  # the inner LayerNorm's shares
    _ttt_bwd_scan_kernel[(B * H,)](
        **common, dzq=dzq, derr=derr, dwt=dwt if dwt is not None else dw0, dk=dkp, dv=dv, deta=detp, dw0=dw0,
        dwl=inner_ln[0], dbl=inner_ln[1], BT=b, HAS_DWT=dwt is not None, **_launch("bwd_scan"))
    dq, dk, deta = torch.empty_like(q), torch.empty_like(k), torch.empty_like(eta)
    _ttt_bwd_post_kernel[(NC, B * H)](
        **common, wc=wc, do=do, dzq=dzq, dz=derr, dkp=dkp, detp=detp, dq=dq, dk=dk, deta=deta, BT=b, BC=BC,
        **_launch("bwd_post"))
    if not norm:
        none = dw0.new_empty(0)  # custom ops return tensors: empty ones stand for the absent LayerNorm gradients
        return dq, dk, dv, deta, dw0, none, none
    dwl, dbl = (out_ln[i].sum((0, 2)) + inner_ln[i].sum(0) for i in range(2))
    return dq, dk, dv, deta, dw0, dwl, dbl


def _fwd_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, eta: torch.Tensor, w0: torch.Tensor | None,
              w_ln: torch.Tensor | None, b_ln: torch.Tensor | None, scale: float, eps: float, b: int, keep: bool
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return ttt_triton_forward(q, k, v, eta, w0, w_ln, b_ln, scale, eps, b, keep)


def _bwd_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, eta: torch.Tensor, w_ln: torch.Tensor | None,
              b_ln: torch.Tensor | None, scale: float, eps: float, b: int, wc: torch.Tensor, hs: torch.Tensor,
              rs: torch.Tensor, do: torch.Tensor, dwt: torch.Tensor | None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                         torch.Tensor]:
    return ttt_triton_backward(q, k, v, eta, w_ln, b_ln, scale, eps, b, wc, hs, rs, do, dwt)


def _fwd_fake(q, k, v, eta, w0, w_ln, b_ln, scale, eps, b, keep):
    B, T, H, K = q.shape
    V = v.shape[-1]
    wt = q.new_empty(B, H, K, V, dtype=torch.float32)
    if not keep:
        return torch.empty_like(v), wt, *(q.new_empty(0, dtype=torch.float32) for _ in range(3))
    NC = _geometry(q, v, b).NC
    rs = q.new_empty((B, T, H) if w_ln is not None else (0,), dtype=torch.float32)
    return (torch.empty_like(v), wt, q.new_empty(B, H, NC, K, V, dtype=torch.float32),
            q.new_empty(B, T, H, V, dtype=torch.float32), rs)


_fwd_op = define_op("ttt_linear_triton_fwd", _fwd_impl, _fwd_fake)


def _bwd_fake(q, k, v, eta, w_ln, b_ln, scale, eps, b, wc, hs, rs, do, dwt):
    B, T, H, K = q.shape
    V = v.shape[-1]
    ln = q.new_empty(0, dtype=torch.float32) if w_ln is None else w_ln.new_empty(w_ln.shape, dtype=torch.float32)
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(eta),
            q.new_empty(B, H, K, V, dtype=torch.float32), ln, torch.empty_like(ln))


_bwd_op = define_op("ttt_linear_triton_bwd", _bwd_impl, _bwd_fake)


def _setup_context(ctx, inputs, output):
    q, k, v, eta, w0, w_ln, b_ln, scale, eps, b, keep = inputs
    ctx.save_for_backward(q, k, v, eta, w_ln, b_ln, *output[2:])
    ctx.scale, ctx.eps, ctx.b, ctx.has_w0 = scale, eps, b, w0 is not None


def _backward(ctx, do, dwt, d_wc, d_hs, d_rs):
    q, k, v, eta, w_ln, b_ln, wc, hs, rs = ctx.saved_tensors
    run = _bwd_impl if eager_backward(ctx) else _bwd_op
    do = torch.zeros_like(v) if do is None else do.contiguous()
    dq, dk, dv, deta, dw0, dwl, dbl = run(q, k, v, eta, w_ln, b_ln, ctx.scale, ctx.eps, ctx.b, wc, hs, rs, do,
                                          None if dwt is None else dwt.float().contiguous())
    if w_ln is None:
        dwl = dbl = None
    return (dq, dk, dv, deta, dw0 if ctx.has_w0 else None, dwl, dbl, None, None, None, None)


_differentiable = op_function("ttt_linear_triton_function", _fwd_impl, _fwd_op, _setup_context, _backward,
                              non_differentiable=(2, 3, 4))


def ttt_linear_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, eta: torch.Tensor, *, scale: float,
                      initial_state: torch.Tensor | None = None, output_final_state: bool = False,
                      chunk_size: int = 64, mini_batch_size: int = 16, norm_weight: torch.Tensor | None = None,
                      norm_bias: torch.Tensor | None = None, norm_eps: float = 1e-6
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """backend='triton' for ttt_linear (inputs validated by the public op; ``chunk_size`` unused: the kernels work
    in chunks of 64 tokens). mini_batch_size 16 or 32, K and V up to 128."""
    if not triton_takes(mini_batch_size, q.shape[-1], v.shape[-1]):
        raise ValueError(f"backend='triton' takes mini_batch_size in {TRITON_MINI_BATCH_SIZES} and head dims up to "
                         f"{TRITON_MAX_HEAD_DIM}; got mini_batch_size={mini_batch_size}, K={q.shape[-1]}, "
                         f"V={v.shape[-1]} (backend='chunk' takes any)")
    dtype = q.dtype if q.dtype in (torch.bfloat16, torch.float16, torch.float32) else torch.float32
    q, k, v = (x.to(dtype).contiguous() for x in (q, k, v))
    eta = eta.contiguous() if eta.dtype in (torch.bfloat16, torch.float16, torch.float32) else eta.float().contiguous()
    w0 = None if initial_state is None else initial_state.float().contiguous()
    w_ln, b_ln = (None, None) if norm_weight is None else (norm_weight.float().contiguous(),
                                                           norm_bias.float().contiguous())
    keep = needs_backward(q, k, v, eta, w0, w_ln, b_ln)
    o, wt, *_ = _differentiable(q, k, v, eta, w0, w_ln, b_ln, float(scale), float(norm_eps), mini_batch_size, keep)
    return o, (wt if output_final_state else None)
