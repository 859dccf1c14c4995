"""Triton kernels (forward and backward) for TTT-Linear, with or without the inner LayerNorm.

Per head, mini-batches of b tokens entered with weights W [K, V]; q~ = scale q; every gradient of the mini-batch is
taken at W (inner.py):

    Z = K W,          err = dLN^T (K + LN(Z) - V)   (inner norm; K == V)   or   err = Z - V   (plain)
    A = (Q~ K^T) ⊙ [eta_s]_{ts} ⊙ causal,           Zq = Q~ W - A err
    o = Q~ + LN(Zq)   (inner norm)   or   o = Zq   (plain),      W' = W - (eta ⊙ K)^T err

LN(z) = w ⊙ (z - mean z) r + beta over the V channels, r = (var z + eps)^-1/2; dLN^T e = r (g - mean g - h mean(g h))
with g = w ⊙ e and h = (z - mean z) r. A mini-batch needs the whole W (the norm couples every value channel), so a
program per batch-head walks the mini-batches in order with W in float32 registers: nothing per token but the
outputs is written, and the weights entering every chunk of ``chunk`` mini-batches (64 tokens) are kept for the
backward pass (memory K V / 64 floats per token and head).

Backward, per mini-batch in reverse with dW the gradient of W' (from the later mini-batches, or of the final state):

    dZq = dLN^T(w ⊙ do) at Zq (norm) or do;      dq~ = do (norm) + dZq W^T - ... ;   dW += Q~^T dZq + K^T dZ
    dA = -dZq err^T,      derr = -A^T dZq - (eta ⊙ K) dW',      d(eta ⊙ K) = -err dW'^T
    dS = dA ⊙ causal ⊙ eta_s (S = Q~ K^T): dq~ += dS K, dk += dS^T Q~, deta_s += sum_t (dA ⊙ causal ⊙ S)_ts
    err = r (g - mean g - h mean(g h)):   dg = r (derr - mean derr - h mean(derr h)),
                                          dh = -r mean(g h) derr - r mean(derr h) g,   dr = (derr . err) / r
    g = w ⊙ e, e = K + w ⊙ h + beta - V:  de = w ⊙ dg, dk += de, dv = -de, dh += w ⊙ de, dw += e dg + de h, dbeta += de
    h, r of Z:                            dZ = r (dh - mean dh - h mean(dh h)) - (r^2 / V) dr h,    dk += dZ W^T

(plain: dZ = derr, dv = -derr). Each chunk's weights are recomputed from the kept chunk-entry weights into a
scratch buffer of ``chunk`` [K, V] tiles per program before its mini-batches are walked backwards. Checked against
autograd of the chunk backend (tests/ops/test_triton_ttt.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common.triton_launch import fast_launch
from ..common.triton_masking import causal_dot_rest
from ..common.triton_ops import eager_backward, eager_function, needs_backward, use_custom_op
from ..common.triton_utils import block as _block
from ..common.triton_utils import cdiv, dot_precision
from .checks import TRITON_MAX_HEAD_DIM, TRITON_MINI_BATCH_SIZES, triton_takes

TOKENS_PER_CHUNK = 64  # the forward keeps W every 64 tokens (every 64 / b mini-batches)
# One pipelining stage: with Triton's default of 3 the backward kernel needed 240 KB of shared memory at
# K = V = 128 (sm_90, bf16), more than an H100 has; with one, 128 KB (``python -m linattn.bench.triton_resources``).
LAUNCH = {"fwd_warps": 8, "fwd_stages": 1, "bwd_warps": 8, "bwd_stages": 1}


def _update_precision(dtype: torch.dtype) -> str:
    """Precision of the inner-weight update W -= (eta k)^T err, which accumulates over the whole sequence: with
    plain tf32 (10-bit mantissas) the error of bf16 runs grew past the project's bf16 tolerance on the H100
    (relative RMSE 6.0e-3 at T=80), so half-precision inputs update W with 3xTF32 (float32 accuracy on tensor
    cores); the other products, which do not accumulate, stay tf32 (3xTF32 everywhere halved the layer's speed)."""
    return "ieee" if dtype == torch.float32 else "tf32x3"


@triton.jit
def _ln_stats(z, m_v, V: tl.constexpr, eps):
    """(h, r) of LayerNorm over the valid V columns of z [b, BV]: h = (z - mean) r (0 in padded columns)."""
    mu = tl.sum(z, axis=1) / V
    zc = tl.where(m_v[None, :], z - mu[:, None], 0.0)
    r = 1.0 / tl.sqrt(tl.sum(zc * zc, axis=1) / V + eps)
    return zc * r[:, None], r


@triton.jit
def _ln_grad(x, h, r, m_v, V: tl.constexpr):
    """r (x - mean x - h mean(x h)) over the valid V columns (the LayerNorm backward at h, r; 0 elsewhere)."""
    mx = tl.sum(x, axis=1) / V
    mxh = tl.sum(x * h, axis=1) / V
    return tl.where(m_v[None, :], r[:, None] * (x - mx[:, None] - h * mxh[:, None]), 0.0)


@triton.jit
def _minibatch(q, k, v, eta, W, row, m_t, o_k, o_v, m_k, m_v, wl, bl, scale, eps, K: tl.constexpr,
               V: tl.constexpr, NORM: tl.constexpr, PREC: tl.constexpr):
    """Loads of one mini-batch and its error at W: (q~, k, v, eta, err, and for the norm h, r, e, g)."""
    qs = tl.load(q + row[:, None] * K + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.0).to(tl.float32)
    qs = qs * scale
    kc = tl.load(k + row[:, None] * K + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.0).to(tl.float32)
    vc = tl.load(v + row[:, None] * V + o_v[None, :], mask=m_t[:, None] & m_v[None, :], other=0.0).to(tl.float32)
    et = tl.load(eta + row, mask=m_t, other=0.0).to(tl.float32)
    Z = tl.dot(kc, W, input_precision=PREC)
    if NORM:
        h, r = _ln_stats(Z, m_v, V, eps)
        # K == V: the residual k and the value share the column index
        e = tl.where(m_v[None, :], kc + wl[None, :] * h + bl[None, :] - vc, 0.0)
        g = wl[None, :] * e
        err = _ln_grad(g, h, r, m_v, V)
    else:
        h, r, e, g = Z, tl.sum(Z, axis=1), Z, Z  # unused
        err = Z - vc
    return qs, kc, vc, et, err, h, r, e, g


@fast_launch
@triton.jit(do_not_specialize=["T"])
def _ttt_fwd_kernel(q, k, v, eta, w_ln, b_ln, w0, o, wt, wc, scale, eps, T, H: tl.constexpr, K: tl.constexpr,
                    V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, NB: tl.constexpr,
                    NORM: tl.constexpr, HAS_W0: tl.constexpr, SAVE: tl.constexpr, PREC: tl.constexpr,
                    WPREC: tl.constexpr):
    """Grid (B*H,): o, the final weights wt and (SAVE) the weights wc entering every chunk of NB mini-batches."""
    i_bh = tl.program_id(0).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    o_k, o_v, o_t = tl.arange(0, BK), tl.arange(0, BV), tl.arange(0, BT)
    m_k, m_v = o_k < K, o_v < V
    kv = o_k[:, None] * V + o_v[None, :]
    m_kv = m_k[:, None] & m_v[None, :]
    W = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_W0:
        W += tl.load(w0 + i_bh * K * V + kv, mask=m_kv, other=0.0)
    wl = tl.load(w_ln + i_h * V + o_v, mask=m_v, other=0.0).to(tl.float32) if NORM else tl.zeros([BV], tl.float32)
    bl = tl.load(b_ln + i_h * V + o_v, mask=m_v, other=0.0).to(tl.float32) if NORM else tl.zeros([BV], tl.float32)
    NM = tl.cdiv(T, BT)
    causal = o_t[:, None] >= o_t[None, :]
    for m in range(NM):
        if SAVE:
            if m % NB == 0:
                tl.store(wc + (i_bh * tl.cdiv(NM, NB) + m // NB) * K * V + kv, W, mask=m_kv)
        t = m * BT + o_t
        m_t = t < T
        row = (i_b * T + t) * H + i_h
        qs, kc, vc, et, err, h, r, e, g = _minibatch(q, k, v, eta, W, row, m_t, o_k, o_v, m_k, m_v, wl, bl, scale,
                                                     eps, K, V, NORM, PREC)
        A = tl.where(causal, tl.dot(qs, tl.trans(kc), input_precision=PREC) * et[None, :], 0.0)
        err_fin, err_rest = causal_dot_rest(err)  # row t reads err rows <= t only (triton_masking.py)
        Zq = tl.dot(qs, W, input_precision=PREC) - (tl.dot(A, err_fin, input_precision=PREC) + err_rest)
        if NORM:
            hq, rq = _ln_stats(Zq, m_v, V, eps)
            out = qs + wl[None, :] * hq + bl[None, :]
        else:
            out = Zq
        tl.store(o + row[:, None] * V + o_v[None, :], out.to(o.dtype.element_ty), mask=m_t[:, None] & m_v[None, :])
        W -= tl.dot(tl.trans(kc * et[:, None]), err, input_precision=WPREC)
    tl.store(wt + i_bh * K * V + kv, W, mask=m_kv)


@fast_launch
@triton.jit(do_not_specialize=["T"])
def _ttt_bwd_kernel(q, k, v, eta, w_ln, b_ln, wc, scratch, do, dwt, dq, dk, dv, deta, dw0, dwl, dbl, scale, eps, T,
                    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                    BV: tl.constexpr, NB: tl.constexpr, NORM: tl.constexpr, HAS_DWT: tl.constexpr,
                    PREC: tl.constexpr, WPREC: tl.constexpr):
    """Grid (B*H,): dq, dk, dv, deta, the initial weights' gradient dw0 and this program's share of the LayerNorm
    parameters' gradients (dwl, dbl [B*H, V]); walks the chunks backwards, recomputing each chunk's weights."""
    i_bh = tl.program_id(0).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    o_k, o_v, o_t = tl.arange(0, BK), tl.arange(0, BV), tl.arange(0, BT)
    m_k, m_v = o_k < K, o_v < V
    kv = o_k[:, None] * V + o_v[None, :]
    m_kv = m_k[:, None] & m_v[None, :]
    wl = tl.load(w_ln + i_h * V + o_v, mask=m_v, other=0.0).to(tl.float32) if NORM else tl.zeros([BV], tl.float32)
    bl = tl.load(b_ln + i_h * V + o_v, mask=m_v, other=0.0).to(tl.float32) if NORM else tl.zeros([BV], tl.float32)
    dwl_acc = tl.zeros([BV], dtype=tl.float32)
    dbl_acc = tl.zeros([BV], dtype=tl.float32)
    dW = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_DWT:
        dW += tl.load(dwt + i_bh * K * V + kv, mask=m_kv, other=0.0)
    NM = tl.cdiv(T, BT)
    NC = tl.cdiv(NM, NB)
    causal = o_t[:, None] >= o_t[None, :]
    for ci in range(NC):
        c = NC - 1 - ci
        # the weights entering each mini-batch of chunk c, into this program's scratch tiles
        W = tl.load(wc + (i_bh * NC + c) * K * V + kv, mask=m_kv, other=0.0)
        for j in range(NB):
            tl.store(scratch + (i_bh * NB + j) * K * V + kv, W, mask=m_kv)
            t = (c * NB + j) * BT + o_t
            m_t = t < T
            row = (i_b * T + t) * H + i_h
            qs, kc, vc, et, err, h, r, e, g = _minibatch(q, k, v, eta, W, row, m_t, o_k, o_v, m_k, m_v, wl, bl,
                                                         scale, eps, K, V, NORM, PREC)
            W -= tl.dot(tl.trans(kc * et[:, None]), err, input_precision=WPREC)
        for ji in range(NB):
            j = NB - 1 - ji
            W = tl.load(scratch + (i_bh * NB + j) * K * V + kv, mask=m_kv, other=0.0)
            t = (c * NB + j) * BT + o_t
            m_t = t < T
            row = (i_b * T + t) * H + i_h
            qs, kc, vc, et, err, h, r, e, g = _minibatch(q, k, v, eta, W, row, m_t, o_k, o_v, m_k, m_v, wl, bl,
                                                         scale, eps, K, V, NORM, PREC)
            S = tl.where(causal, tl.dot(qs, tl.trans(kc), input_precision=PREC), 0.0)
            A = S * et[None, :]
            doc = tl.load(do + row[:, None] * V + o_v[None, :], mask=m_t[:, None] & m_v[None, :],
                          other=0.0).to(tl.float32)
            if NORM:
                Zq = tl.dot(qs, W, input_precision=PREC) - tl.dot(A, err, input_precision=PREC)
                hq, rq = _ln_stats(Zq, m_v, V, eps)
                dwl_acc += tl.sum(doc * hq, axis=0)
                dbl_acc += tl.sum(doc, axis=0)
                dZq = _ln_grad(wl[None, :] * doc, hq, rq, m_v, V)
                dqs = doc  # the residual q~ (K == V)
            else:
                dZq = doc
                dqs = tl.zeros([BT, BK], dtype=tl.float32)
            dqs += tl.dot(dZq, tl.trans(W), input_precision=PREC)
            dA = -tl.dot(dZq, tl.trans(err), input_precision=PREC)
            ke = kc * et[:, None]
            derr = -tl.dot(tl.trans(A), dZq, input_precision=PREC) - tl.dot(ke, dW, input_precision=PREC)
            dke = -tl.dot(err, tl.trans(dW), input_precision=PREC)  # gradient of eta ⊙ k
            dkc = dke * et[:, None]
            det = tl.sum(kc * dke, axis=1)
            dA = tl.where(causal, dA, 0.0)
            dS = dA * et[None, :]
            dqs += tl.dot(dS, kc, input_precision=PREC)
            dkc += tl.dot(tl.trans(dS), qs, input_precision=PREC)
            det += tl.sum(dA * S, axis=0)
            if NORM:
                mgh = tl.sum(g * h, axis=1) / V
                dg = _ln_grad(derr, h, r, m_v, V)
                dh = -(r * mgh)[:, None] * derr - (r * tl.sum(derr * h, axis=1) / V)[:, None] * g
                dr = tl.sum(derr * err, axis=1) / r
                de = wl[None, :] * dg
                dwl_acc += tl.sum(e * dg + de * h, axis=0)
                dbl_acc += tl.sum(de, axis=0)
                dkc += de
                dvc = -de
                dh += wl[None, :] * de
                dZ = _ln_grad(dh, h, r, m_v, V) - (r * r * dr / V)[:, None] * h
            else:
                dZ = derr
                dvc = -derr
            dkc += tl.dot(dZ, tl.trans(W), input_precision=PREC)
            dW += tl.dot(tl.trans(qs), dZq, input_precision=PREC) + tl.dot(tl.trans(kc), dZ, input_precision=PREC)
            m_tk = m_t[:, None] & m_k[None, :]
            tl.store(dq + row[:, None] * K + o_k[None, :], (dqs * scale).to(dq.dtype.element_ty), mask=m_tk)
            tl.store(dk + row[:, None] * K + o_k[None, :], dkc.to(dk.dtype.element_ty), mask=m_tk)
            tl.store(dv + row[:, None] * V + o_v[None, :], dvc.to(dv.dtype.element_ty),
                     mask=m_t[:, None] & m_v[None, :])
            tl.store(deta + row, det, mask=m_t)
    tl.store(dw0 + i_bh * K * V + kv, dW, mask=m_kv)
    if NORM:
        tl.store(dwl + i_bh * V + o_v, dwl_acc, mask=m_v)
        tl.store(dbl + i_bh * V + o_v, dbl_acc, mask=m_v)


def _blocks(K: int, V: int, b: int) -> dict:
    return dict(BT=b, BK=_block(K), BV=_block(V), NB=max(1, TOKENS_PER_CHUNK // b))


def ttt_triton_forward(q, k, v, eta, w0, w_ln, b_ln, scale, eps, b, keep):
    """(o, final W float32, chunk-entry weights [B, H, NC, K, V] float32 when ``keep`` else an empty tensor).
    q, k, v, eta contiguous [B, T, H, *]; w_ln, b_ln [H, V] or None (plain)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    blk = _blocks(K, V, b)
    NC = cdiv(cdiv(T, b), blk["NB"])
    o = torch.empty_like(v)
    wt = torch.empty(B, H, K, V, device=q.device, dtype=torch.float32)
    wc = torch.empty((B, H, NC, K, V) if keep else (0,), device=q.device, dtype=torch.float32)
    norm = w_ln is not None
    _ttt_fwd_kernel[(B * H,)](
        q=q, k=k, v=v, eta=eta, w_ln=w_ln if norm else wt, b_ln=b_ln if norm else wt, w0=w0 if w0 is not None else wt,
        o=o, wt=wt, wc=wc, scale=scale, eps=eps, T=T, H=H, K=K, V=V, **blk, NORM=norm, HAS_W0=w0 is not None,
        SAVE=keep, PREC=dot_precision(q.dtype), WPREC=_update_precision(q.dtype),
        num_warps=LAUNCH["fwd_warps"], num_stages=LAUNCH["fwd_stages"])
    return o, wt, wc


def ttt_triton_backward(q, k, v, eta, w0, w_ln, b_ln, scale, eps, b, wc, do, dwt):
    """(dq, dk, dv, deta, dW0 float32, dw_ln, db_ln [H, V] float32; empty without the norm) from the kept chunk
    weights ``wc``."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    blk = _blocks(K, V, b)
    norm = w_ln is not None
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    deta = torch.empty(B, T, H, device=q.device, dtype=torch.float32)
    dw0 = torch.empty(B, H, K, V, device=q.device, dtype=torch.float32)
    scratch = torch.empty(B * H, blk["NB"], K, V, device=q.device, dtype=torch.float32)
    dwl = torch.empty(B, H, V, device=q.device, dtype=torch.float32) if norm else dw0
    dbl = torch.empty(B, H, V, device=q.device, dtype=torch.float32) if norm else dw0
    _ttt_bwd_kernel[(B * H,)](
        q=q, k=k, v=v, eta=eta, w_ln=w_ln if norm else dw0, b_ln=b_ln if norm else dw0, wc=wc, scratch=scratch,
        do=do, dwt=dwt if dwt is not None else dw0, dq=dq, dk=dk, dv=dv, deta=deta, dw0=dw0, dwl=dwl, dbl=dbl,
        scale=scale, eps=eps, T=T, H=H, K=K, V=V, **blk, NORM=norm, HAS_DWT=dwt is not None,
        PREC=dot_precision(q.dtype), WPREC=_update_precision(q.dtype), num_warps=LAUNCH["bwd_warps"],
        num_stages=LAUNCH["bwd_stages"])
    none = dw0.new_empty(0)  # custom ops return tensors: empty ones stand for the absent LayerNorm gradients
    return dq, dk, dv, deta.to(eta.dtype), dw0, (dwl.sum(0) if norm else none), (dbl.sum(0) if norm else none)


def _fwd_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, eta: torch.Tensor, w0: torch.Tensor | None,
              w_ln: torch.Tensor | None, b_ln: torch.Tensor | None, scale: float, eps: float, b: int, keep: bool
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return ttt_triton_forward(q, k, v, eta, w0, w_ln, b_ln, scale, eps, b, keep)


def _bwd_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, eta: torch.Tensor, w0: torch.Tensor | None,
              w_ln: torch.Tensor | None, b_ln: torch.Tensor | None, scale: float, eps: float, b: int,
              wc: torch.Tensor, do: torch.Tensor, dwt: torch.Tensor | None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                         torch.Tensor]:
    return ttt_triton_backward(q, k, v, eta, w0, w_ln, b_ln, scale, eps, b, wc, do, dwt)


_fwd_op = torch.library.custom_op("linattn::ttt_linear_triton_fwd", _fwd_impl, mutates_args=())
_bwd_op = torch.library.custom_op("linattn::ttt_linear_triton_bwd", _bwd_impl, mutates_args=())


@_fwd_op.register_fake
def _(q, k, v, eta, w0, w_ln, b_ln, scale, eps, b, keep):
    B, T, H, K = q.shape
    V = v.shape[-1]
    NC = cdiv(cdiv(T, b), max(1, TOKENS_PER_CHUNK // b))
    wt = q.new_empty(B, H, K, V, dtype=torch.float32)
    return torch.empty_like(v), wt, q.new_empty((B, H, NC, K, V) if keep else (0,), dtype=torch.float32)


@_bwd_op.register_fake
def _(q, k, v, eta, w0, w_ln, b_ln, scale, eps, b, wc, do, dwt):
    B, T, H, K = q.shape
    V = v.shape[-1]
    ln = q.new_empty(0, dtype=torch.float32) if w_ln is None else w_ln.new_empty(w_ln.shape, dtype=torch.float32)
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(eta),
            q.new_empty(B, H, K, V, dtype=torch.float32), ln, torch.empty_like(ln))


def _setup_context(ctx, inputs, output):
    q, k, v, eta, w0, w_ln, b_ln, scale, eps, b, keep = inputs
    ctx.save_for_backward(q, k, v, eta, w0, w_ln, b_ln, output[2])
    ctx.scale, ctx.eps, ctx.b = scale, eps, b


def _backward(ctx, do, dwt, d_wc):
    q, k, v, eta, w0, w_ln, b_ln, wc = ctx.saved_tensors
    run = _bwd_impl if eager_backward(ctx) else _bwd_op
    do = torch.zeros_like(v) if do is None else do.contiguous()
    dq, dk, dv, deta, dw0, dwl, dbl = run(q, k, v, eta, w0, w_ln, b_ln, ctx.scale, ctx.eps, ctx.b, wc, do,
                                          None if dwt is None else dwt.float().contiguous())
    if w_ln is None:
        dwl = dbl = None
    return (dq, dk, dv, deta, dw0 if w0 is not None else None, dwl, dbl, None, None, None, None)


_fwd_op.register_autograd(_backward, setup_context=_setup_context)
_Function = eager_function("ttt_linear_triton_function", _fwd_impl, _setup_context, _backward,
                           non_differentiable=(2,))


def ttt_linear_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, eta: torch.Tensor, *, scale: float,
                      initial_state: torch.Tensor | None = None, output_final_state: bool = False,
                      chunk_size: int = 64, mini_batch_size: int = 16, norm_weight: torch.Tensor | None = None,
                      norm_bias: torch.Tensor | None = None, norm_eps: float = 1e-6
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """backend='triton' for ttt_linear (inputs validated by the public op; ``chunk_size`` unused: the kernels walk
    mini-batches and keep the weights every 64 tokens). mini_batch_size 16 or 32, K and V up to 128."""
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
    run = _fwd_op if use_custom_op(q) else _Function.apply
    o, wt, _ = run(q, k, v, eta, w0, w_ln, b_ln, float(scale), float(norm_eps), mini_batch_size, keep)
    return o, (wt if output_final_state else None)


TRITON_BACKENDS = {"ttt_linear": ttt_linear_triton}
