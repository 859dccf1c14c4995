"""Triton kernels (forward and backward) for Titans, and the ``backend="triton"`` table of the ttt family
(ttt_linear's kernels: triton_linear.py).

Titans: memory M and momentum S [K, V] per head, a = 1 - alpha, every gradient of a mini-batch at its entering M_0.
Unrolled over one mini-batch (chunk.py's docstring with chunks of one mini-batch, so no triangular solve:
U = K M_0 - V holds for all its tokens at once), with G_ts = theta_s c_ts (t >= s) and the exit row x (the
mini-batch's last token; for the last mini-batch the sequence's last token):

    U = K M_0 - V,      o = A ⊙ (Q~ M_0) + d ⊙ (Q~ S_0) - ((Q~ K^T) ⊙ G ⊙ causal) U
    M' = A_x M_0 + d_x S_0 - (g_M ⊙ K)^T U,      S' = E_x S_0 - (g_S ⊙ K)^T U,      g_M = theta c_x., g_S = theta e_x.

The coefficients (G, A_r, d_r, g_M, g_S, A_x, d_x, E_x) are computed per mini-batch by products of the gates (no
logs: gates 0 and 1 are exact), with one kernel each way (triton_gates.py, beside its PyTorch reference). Without
an inner norm the V columns of M and S are independent, so the grid is (B*H, V blocks): each program keeps [K, BV]
slices of M and S in float32 registers and walks the mini-batches; the forward keeps the (M, S) entering every 64
tokens. Backward, per mini-batch in reverse with dM, dS the gradients of M', S' and P = Q~ K^T ⊙ causal:

    dU = -(P ⊙ G)^T do - (g_M ⊙ K) dM - (g_S ⊙ K) dS,       dv = -dU
    d(P ⊙ G) = -(do U^T) ⊙ causal:  dG = d(P ⊙ G) ⊙ P,  dP = d(P ⊙ G) ⊙ G
    dq~ = (A ⊙ do) M_0^T + (d ⊙ do) S_0^T + dP K,        dk = dP^T Q~ + dU M_0^T - g_M ⊙ (U dM^T) - g_S ⊙ (U dS^T)
    dA_r = rowsum(do ⊙ Q~ M_0), dd_r = rowsum(do ⊙ Q~ S_0), dg_M = -rowsum(K ⊙ U dM^T), dg_S = -rowsum(K ⊙ U dS^T)
    dA_x = <M_0, dM>, dd_x = <S_0, dM>, dE_x = <S_0, dS>
    dM_0 = A_x dM + Q~^T (A ⊙ do) + K^T dU,               dS_0 = d_x dM + E_x dS + Q~^T (d ⊙ do)

dU does not depend on U, so the gradients of the states form a recurrence of their own, driven by do, Q~, K and the
coefficients alone. The backward is two kernels: a light scan of (dM, dS) alone over the mini-batches in reverse,
which keeps the gradients leaving every chunk of 64 tokens; then one program per (batch-head, V block, chunk) for all
chunks at once, which walks its chunk's mini-batches in reverse from those gradients, recomputing each mini-batch's
entry (M, S) from the chunk's kept entry state (at most 3 updates for mini-batches of 16). dq, dk and the coefficient
gradients are sums over the V blocks: each block writes its share and the host sums them. Checked against autograd
of the recurrence (tests/ops/test_triton_titans.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common.checks import compute_dtype
from ..common.registered_ops import define_op
from ..common.triton_launch import fast_launch
from ..common.triton_masking import causal_dot_rest
from ..common.triton_ops import eager_backward, needs_backward, op_function
from ..common.triton_utils import block as _block
from ..common.triton_utils import cdiv, dot_precision, launch_overrides
from .checks import TRITON_MAX_HEAD_DIM, TRITON_MINI_BATCH_SIZES, titans_triton_takes
from .triton_gates import coefficient_loads, titans_coefficients_triton
from .triton_linear import TOKENS_PER_CHUNK, state_program, ttt_linear_triton

# titans: a program holds [K, BV] slices of M and S (and of their gradients in the backward); BV caps the V block
# ("fwd": forward, "scan": the backward's scan of (dM, dS), "bwd": the backward's per-chunk gradients). Timed on an
# H100 at B8 T2048 H8 K = V = 128, bf16: the forward is fastest with 4 warps and BV 32 (1.84 ms; 8 warps 2.62 ms);
# forward + backward 10.4 ms at these settings (bwd_BV 16: 13.3, 64: 10.2; bwd_warps 4: 11.3; scan_warps 8: 10.5).
# Profiled, the per-chunk gradient kernel is most of it (4.5 ms, against 0.6 ms for the scan and 0.75 for the forward).
TITANS_LAUNCH = {"fwd_warps": 4, "fwd_stages": 1, "fwd_BV": 32, "bwd_warps": 8, "bwd_stages": 1, "bwd_BV": 32,
                 "scan_warps": 4, "scan_stages": 1, "scan_BV": 32}
launch_overrides("titans", TITANS_LAUNCH)


def _update_precision(dtype: torch.dtype) -> str:
    """Precision of titans' state update, which accumulates over the whole sequence: with plain tf32 (10-bit
    mantissas) the error of bf16 runs of ttt_linear's update grew past the project's bf16 tolerance on the H100
    (relative RMSE 6.0e-3 at T=80), so half-precision inputs update with 3xTF32 (float32 accuracy on tensor cores);
    the other products, which do not accumulate, stay tf32 (3xTF32 everywhere halved the layer's speed).
    ttt_linear's update gets the same accuracy from two tf32 dots (triton_linear.py's ``_descend``)."""
    return "ieee" if dtype == torch.float32 else "tf32x3"


# ---------------------------------------------------------------------------------------------------------------------
# titans: linear memory with momentum and weight decay (see the module docstring)


@triton.jit
def _titans_rows(m, i_b, i_h, T, H: tl.constexpr, BT: tl.constexpr):
    """The rows (into [B, T, H, *] tensors) of mini-batch m's tokens, and which of them lie inside the sequence."""
    t = m * BT + tl.arange(0, BT)
    return (i_b * T + t) * H + i_h, t < T


@triton.jit
def _titans_update(M, S, kc, U, gM, gS, Ax, dx, Ex, WPREC: tl.constexpr):
    """(M', S') of a mini-batch: M' = A_x M + d_x S - (g_M k)^T U, S' = E_x S - (g_S k)^T U."""
    M_next = Ax * M + dx * S - tl.dot(tl.trans(kc * gM[:, None]), U, input_precision=WPREC)
    return M_next, Ex * S - tl.dot(tl.trans(kc * gS[:, None]), U, input_precision=WPREC)


@triton.jit
def _store_pair(a, b, offsets, x, y, mask):
    """x into a and y into b at the same offsets (a state pair: M and S, or their gradients)."""
    tl.store(a + offsets, x, mask=mask)
    tl.store(b + offsets, y, mask=mask)


@triton.jit
def _titans_loads(q, k, v, G, cv, cx, row, m_t, cb, o_t, o_k, o_v, m_k, m_v, scale, K: tl.constexpr,
                  V: tl.constexpr, BT: tl.constexpr):
    """One mini-batch's q~, k, v (this program's V columns) and coefficients (G, A_r, d_r, g_M, g_S, A_x, d_x, E_x);
    ``cb`` indexes the mini-batch among all (batch-head major)."""
    m_tk = m_t[:, None] & m_k[None, :]
    qs = tl.load(q + row[:, None] * K + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32) * scale
    kc = tl.load(k + row[:, None] * K + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32)
    vc = tl.load(v + row[:, None] * V + o_v[None, :], mask=m_t[:, None] & m_v[None, :], other=0.0).to(tl.float32)
    Gm, Ar, dr, gM, gS, Ax, dx, Ex = coefficient_loads(G, cv, cx, cb, o_t, BT)
    return qs, kc, vc, Gm, Ar, dr, gM, gS, Ax, dx, Ex


@fast_launch
@triton.jit(do_not_specialize=["T", "N"])
def _titans_fwd_kernel(q, k, v, G, cv, cx, m0, s0, o, mt, st, mc, sc, scale, T, N, H: tl.constexpr,
                       K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                       NB: tl.constexpr, HAS_S0: tl.constexpr, SAVE: tl.constexpr, PREC: tl.constexpr,
                       WPREC: tl.constexpr):
    """Grid (B*H, V blocks): o's columns of this block, the final (M, S) and (SAVE) the (M, S) entering every chunk of
    NB mini-batches, each [K, BV] slice of this program's columns."""
    i_bh, i_v, i_b, i_h, o_k, o_t, o_v, m_k, m_v, kv, m_kv = state_program(H, K, V, BT, BK, BV)
    M = tl.zeros([BK, BV], dtype=tl.float32)
    S = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_S0:
        M += tl.load(m0 + i_bh * K * V + kv, mask=m_kv, other=0.0)
        S += tl.load(s0 + i_bh * K * V + kv, mask=m_kv, other=0.0)
    NC = tl.cdiv(N, NB)
    causal = o_t[:, None] >= o_t[None, :]
    for m in range(N):
        if SAVE:
            if m % NB == 0:
                _store_pair(mc, sc, (i_bh * NC + m // NB) * K * V + kv, M, S, m_kv)
        row, m_t = _titans_rows(m, i_b, i_h, T, H, BT)
        qs, kc, vc, Gm, Ar, dr, gM, gS, Ax, dx, Ex = _titans_loads(q, k, v, G, cv, cx, row, m_t, i_bh * N + m, o_t,
                                                                   o_k, o_v, m_k, m_v, scale, K, V, BT)
        U = tl.dot(kc, M, input_precision=PREC) - vc
        P = tl.where(causal, tl.dot(qs, tl.trans(kc), input_precision=PREC) * Gm, 0.0)
        U_fin, U_rest = causal_dot_rest(U)  # row t reads U rows <= t only (triton_masking.py)
        out = (Ar[:, None] * tl.dot(qs, M, input_precision=PREC) + dr[:, None] * tl.dot(qs, S, input_precision=PREC)
               - (tl.dot(P, U_fin, input_precision=PREC) + U_rest))
        tl.store(o + row[:, None] * V + o_v[None, :], out.to(o.dtype.element_ty), mask=m_t[:, None] & m_v[None, :])
        M, S = _titans_update(M, S, kc, U, gM, gS, Ax, dx, Ex, WPREC)
    _store_pair(mt, st, i_bh * K * V + kv, M, S, m_kv)


@fast_launch
@triton.jit(do_not_specialize=["T", "N"])
def _titans_dstate_kernel(q, k, v, G, cv, cx, do, dmt, dst, dmc, dsc, dm0, ds0, scale, T, N, H: tl.constexpr,
                          K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                          NB: tl.constexpr, HAS_DMT: tl.constexpr, HAS_DST: tl.constexpr, PREC: tl.constexpr):
    """Grid (B*H, V blocks): the gradient scan of (M, S) alone, mini-batches in reverse; writes the gradients of the
    (M, S) leaving every chunk of NB mini-batches (dmc, dsc [B*H, NC, K, V], this block's columns) and of the initial
    state. dU does not depend on U, so the scan needs no state of the forward pass."""
    i_bh, i_v, i_b, i_h, o_k, o_t, o_v, m_k, m_v, kv, m_kv = state_program(H, K, V, BT, BK, BV)
    dM = tl.zeros([BK, BV], dtype=tl.float32)
    dS = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_DMT:
        dM += tl.load(dmt + i_bh * K * V + kv, mask=m_kv, other=0.0)
    if HAS_DST:
        dS += tl.load(dst + i_bh * K * V + kv, mask=m_kv, other=0.0)
    NC = tl.cdiv(N, NB)
    causal = o_t[:, None] >= o_t[None, :]
    for mi in range(N):
        m = N - 1 - mi
        if (m % NB == NB - 1) | (m == N - 1):  # the last mini-batch of its chunk: the chunk's exit gradients
            _store_pair(dmc, dsc, (i_bh * NC + m // NB) * K * V + kv, dM, dS, m_kv)
        row, m_t = _titans_rows(m, i_b, i_h, T, H, BT)
        qs, kc, vc, Gm, Ar, dr, gM, gS, Ax, dx, Ex = _titans_loads(q, k, v, G, cv, cx, row, m_t, i_bh * N + m, o_t,
                                                                   o_k, o_v, m_k, m_v, scale, K, V, BT)
        doc = tl.load(do + row[:, None] * V + o_v[None, :], mask=m_t[:, None] & m_v[None, :], other=0.0).to(tl.float32)
        PG = tl.where(causal, tl.dot(qs, tl.trans(kc), input_precision=PREC), 0.0) * Gm
        dU = (-tl.dot(tl.trans(PG), doc, input_precision=PREC)
              - tl.dot(kc * gM[:, None], dM, input_precision=PREC)
              - tl.dot(kc * gS[:, None], dS, input_precision=PREC))
        dM_prev = (Ax * dM + tl.dot(tl.trans(qs), doc * Ar[:, None], input_precision=PREC)
                   + tl.dot(tl.trans(kc), dU, input_precision=PREC))
        dS = dx * dM + Ex * dS + tl.dot(tl.trans(qs), doc * dr[:, None], input_precision=PREC)
        dM = dM_prev
    _store_pair(dm0, ds0, i_bh * K * V + kv, dM, dS, m_kv)


@fast_launch
@triton.jit(do_not_specialize=["T", "N"])
def _titans_grads_kernel(q, k, v, G, cv, cx, mc, sc, dmc, dsc, do, dq, dk, dv, dG, dcv, dcx, scale, T, N, BH,
                         H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                         BV: tl.constexpr, NB: tl.constexpr, PREC: tl.constexpr, WPREC: tl.constexpr):
    """Grid (B*H, V blocks, chunks of NB mini-batches): dv's columns of this block and this block's share of dq, dk
    [NVB, B, T, H, K] and of the coefficient gradients dG, dcv, dcx [NVB, ...] (summed over the blocks afterwards),
    for one chunk. Walks the chunk's mini-batches in reverse from the chunk's exit gradients (dmc, dsc); each
    mini-batch's entry (M, S) is recomputed from the chunk's kept entry state (NB is small: at most NB - 1 updates
    per mini-batch, and nothing per token is kept)."""
    i_bh, i_v, i_b, i_h, o_k, o_t, o_v, m_k, m_v, kv, m_kv = state_program(H, K, V, BT, BK, BV)
    c = tl.program_id(2)
    NC = tl.cdiv(N, NB)
    chunk = (i_bh * NC + c) * K * V
    dM = tl.load(dmc + chunk + kv, mask=m_kv, other=0.0)
    dS = tl.load(dsc + chunk + kv, mask=m_kv, other=0.0)
    i_v = i_v.to(tl.int64)
    part = i_v * BH + i_bh  # this block's share of the summed gradients
    n_rows = BH * T  # rows (tokens times heads) of one block's share of dq and dk
    causal = o_t[:, None] >= o_t[None, :]
    nb = tl.minimum(N - c * NB, NB)  # the last chunk may hold fewer mini-batches
    for ji in range(nb):
        j = nb - 1 - ji
        M = tl.load(mc + chunk + kv, mask=m_kv, other=0.0)
        S = tl.load(sc + chunk + kv, mask=m_kv, other=0.0)
        for jj in range(j):  # the entry state of mini-batch j
            m = c * NB + jj
            row, m_t = _titans_rows(m, i_b, i_h, T, H, BT)
            qs, kc, vc, Gm, Ar, dr, gM, gS, Ax, dx, Ex = _titans_loads(q, k, v, G, cv, cx, row, m_t, i_bh * N + m,
                                                                       o_t, o_k, o_v, m_k, m_v, scale, K, V, BT)
            U = tl.dot(kc, M, input_precision=PREC) - vc
            M, S = _titans_update(M, S, kc, U, gM, gS, Ax, dx, Ex, WPREC)
        m = c * NB + j
        cb = i_bh * N + m
        row, m_t = _titans_rows(m, i_b, i_h, T, H, BT)
        qs, kc, vc, Gm, Ar, dr, gM, gS, Ax, dx, Ex = _titans_loads(q, k, v, G, cv, cx, row, m_t, cb, o_t, o_k,
                                                                   o_v, m_k, m_v, scale, K, V, BT)
        doc = tl.load(do + row[:, None] * V + o_v[None, :], mask=m_t[:, None] & m_v[None, :],
                      other=0.0).to(tl.float32)
        U = tl.dot(kc, M, input_precision=PREC) - vc
        QK = tl.where(causal, tl.dot(qs, tl.trans(kc), input_precision=PREC), 0.0)
        PG = QK * Gm
        dAr = tl.sum(doc * tl.dot(qs, M, input_precision=PREC), axis=1)
        ddr = tl.sum(doc * tl.dot(qs, S, input_precision=PREC), axis=1)
        dPG = tl.where(causal, -tl.dot(doc, tl.trans(U), input_precision=PREC), 0.0)
        dQK = dPG * Gm
        tM = tl.dot(U, tl.trans(dM), input_precision=PREC)  # minus the gradient of g_M k
        tS = tl.dot(U, tl.trans(dS), input_precision=PREC)
        dgM = -tl.sum(kc * tM, axis=1)
        dgS = -tl.sum(kc * tS, axis=1)
        dU = (-tl.dot(tl.trans(PG), doc, input_precision=PREC)
              - tl.dot(kc * gM[:, None], dM, input_precision=PREC)
              - tl.dot(kc * gS[:, None], dS, input_precision=PREC))
        dA = doc * Ar[:, None]
        dD = doc * dr[:, None]
        dqs = (tl.dot(dA, tl.trans(M), input_precision=PREC) + tl.dot(dD, tl.trans(S), input_precision=PREC)
               + tl.dot(dQK, kc, input_precision=PREC))
        dkc = (tl.dot(tl.trans(dQK), qs, input_precision=PREC) + tl.dot(dU, tl.trans(M), input_precision=PREC)
               - gM[:, None] * tM - gS[:, None] * tS)
        dAx = tl.sum(tl.sum(M * dM, axis=1), axis=0)
        ddx = tl.sum(tl.sum(S * dM, axis=1), axis=0)
        dEx = tl.sum(tl.sum(S * dS, axis=1), axis=0)
        dM_prev = (Ax * dM + tl.dot(tl.trans(qs), dA, input_precision=PREC)
                   + tl.dot(tl.trans(kc), dU, input_precision=PREC))
        dS = dx * dM + Ex * dS + tl.dot(tl.trans(qs), dD, input_precision=PREC)
        dM = dM_prev
        m_tk = m_t[:, None] & m_k[None, :]
        tl.store(dq + (i_v * n_rows + row[:, None]) * K + o_k[None, :], dqs * scale, mask=m_tk)
        tl.store(dk + (i_v * n_rows + row[:, None]) * K + o_k[None, :], dkc, mask=m_tk)
        tl.store(dv + row[:, None] * V + o_v[None, :], (-dU).to(dv.dtype.element_ty),
                 mask=m_t[:, None] & m_v[None, :])
        pb = part * N + m  # this block's share of mini-batch m's coefficient gradients
        tl.store(dG + pb * BT * BT + o_t[:, None] * BT + o_t[None, :], dPG * QK)
        tl.store(dcv + (pb * 4 + 0) * BT + o_t, dAr)
        tl.store(dcv + (pb * 4 + 1) * BT + o_t, ddr)
        tl.store(dcv + (pb * 4 + 2) * BT + o_t, dgM)
        tl.store(dcv + (pb * 4 + 3) * BT + o_t, dgS)
        tl.store(dcx + pb * 3, dAx)
        tl.store(dcx + pb * 3 + 1, ddx)
        tl.store(dcx + pb * 3 + 2, dEx)


def _titans_blocks(K: int, V: int, b: int, kernel: str) -> dict:
    BV = min(_block(V), TITANS_LAUNCH[f"{kernel}_BV"])
    return dict(BT=b, BK=_block(K), BV=BV, NB=max(1, TOKENS_PER_CHUNK // b))


def titans_triton_forward(q, k, v, G, cv, cx, m0, s0, scale, b, keep):
    """(o, final M, S float32, chunk-entry M and S [B, H, NC, K, V] float32 when ``keep`` else empty tensors).
    q, k, v contiguous [B, T, H, *]; G, cv, cx from :func:`titans_coefficients_triton`; m0, s0 both or neither."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    N = G.shape[2]
    blk = _titans_blocks(K, V, b, "fwd")
    NC = cdiv(N, blk["NB"])
    o = torch.empty_like(v)
    mt, st = (torch.empty(B, H, K, V, device=q.device, dtype=torch.float32) for _ in range(2))
    mc, sc = (torch.empty((B, H, NC, K, V) if keep else (0,), device=q.device, dtype=torch.float32)
              for _ in range(2))
    _titans_fwd_kernel[(B * H, cdiv(V, blk["BV"]))](
        q=q, k=k, v=v, G=G, cv=cv, cx=cx, m0=m0 if m0 is not None else mt, s0=s0 if s0 is not None else st, o=o,
        mt=mt, st=st, mc=mc, sc=sc, scale=scale, T=T, N=N, H=H, K=K, V=V, **blk, HAS_S0=m0 is not None, SAVE=keep,
        PREC=dot_precision(q.dtype), WPREC=_update_precision(q.dtype), num_warps=TITANS_LAUNCH["fwd_warps"],
        num_stages=TITANS_LAUNCH["fwd_stages"])
    return o, mt, st, mc, sc


def titans_triton_backward(q, k, v, G, cv, cx, scale, b, mc, sc, do, dmt, dst):
    """(dq, dk, dv, dG, dcv, dcx, dM0, dS0) from the kept chunk-entry states; the coefficient gradients float32. Two
    kernels: the gradient scan of (M, S), sequential over mini-batches but light, keeping the gradients leaving
    every chunk; then every chunk's gradients at once."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    N = G.shape[2]
    scan = _titans_blocks(K, V, b, "scan")
    grads = _titans_blocks(K, V, b, "bwd")
    NC = cdiv(N, grads["NB"])
    NVB = cdiv(V, grads["BV"])
    f32 = dict(device=q.device, dtype=torch.float32)
    dmc, dsc = (torch.empty(B * H, NC, K, V, **f32) for _ in range(2))
    dm0, ds0 = (torch.empty(B, H, K, V, **f32) for _ in range(2))
    prec = dict(PREC=dot_precision(q.dtype), WPREC=_update_precision(q.dtype))
    _titans_dstate_kernel[(B * H, cdiv(V, scan["BV"]))](
        q=q, k=k, v=v, G=G, cv=cv, cx=cx, do=do, dmt=dmt if dmt is not None else dm0,
        dst=dst if dst is not None else ds0, dmc=dmc, dsc=dsc, dm0=dm0, ds0=ds0, scale=scale, T=T, N=N, H=H, K=K,
        V=V, **scan, HAS_DMT=dmt is not None, HAS_DST=dst is not None, PREC=prec["PREC"],
        num_warps=TITANS_LAUNCH["scan_warps"], num_stages=TITANS_LAUNCH["scan_stages"])
    dq, dk = (torch.empty(NVB, B, T, H, K, **f32) for _ in range(2))
    dv = torch.empty_like(v)
    dG, dcv, dcx = (torch.empty(NVB, *x.shape, **f32) for x in (G, cv, cx))
    _titans_grads_kernel[(B * H, NVB, NC)](
        q=q, k=k, v=v, G=G, cv=cv, cx=cx, mc=mc, sc=sc, dmc=dmc, dsc=dsc, do=do, dq=dq, dk=dk, dv=dv, dG=dG,
        dcv=dcv, dcx=dcx, scale=scale, T=T, N=N, BH=B * H, H=H, K=K, V=V, **grads, **prec,
        num_warps=TITANS_LAUNCH["bwd_warps"], num_stages=TITANS_LAUNCH["bwd_stages"])
    dq, dk, dG, dcv, dcx = (x[0] if NVB == 1 else x.sum(0) for x in (dq, dk, dG, dcv, dcx))
    return dq.to(q.dtype), dk.to(k.dtype), dv, dG, dcv, dcx, dm0, ds0


def _titans_fwd_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, G: torch.Tensor, cv: torch.Tensor,
                     cx: torch.Tensor, m0: torch.Tensor | None, s0: torch.Tensor | None, scale: float, b: int,
                     keep: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return titans_triton_forward(q, k, v, G, cv, cx, m0, s0, scale, b, keep)


def _titans_bwd_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, G: torch.Tensor, cv: torch.Tensor,
                     cx: torch.Tensor, scale: float, b: int, mc: torch.Tensor, sc: torch.Tensor, do: torch.Tensor,
                     dmt: torch.Tensor | None, dst: torch.Tensor | None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                torch.Tensor, torch.Tensor]:
    return titans_triton_backward(q, k, v, G, cv, cx, scale, b, mc, sc, do, dmt, dst)


def _titans_fwd_fake(q, k, v, G, cv, cx, m0, s0, scale, b, keep):
    B, T, H, K = q.shape
    V = v.shape[-1]
    NC = cdiv(G.shape[2], max(1, TOKENS_PER_CHUNK // b))
    state = q.new_empty(B, H, K, V, dtype=torch.float32)
    kept = q.new_empty((B, H, NC, K, V) if keep else (0,), dtype=torch.float32)
    return torch.empty_like(v), state, torch.empty_like(state), kept, torch.empty_like(kept)


_titans_fwd_op = define_op("titans_triton_fwd", _titans_fwd_impl, _titans_fwd_fake)


def _titans_bwd_fake(q, k, v, G, cv, cx, scale, b, mc, sc, do, dmt, dst):
    B, T, H, K = q.shape
    state = q.new_empty(B, H, K, v.shape[-1], dtype=torch.float32)
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(G), torch.empty_like(cv),
            torch.empty_like(cx), state, torch.empty_like(state))


_titans_bwd_op = define_op("titans_triton_bwd", _titans_bwd_impl, _titans_bwd_fake)


def _titans_setup_context(ctx, inputs, output):
    q, k, v, G, cv, cx, m0, s0, scale, b, keep = inputs
    ctx.save_for_backward(q, k, v, G, cv, cx, output[3], output[4])
    ctx.scale, ctx.b, ctx.has_state = scale, b, m0 is not None


def _titans_backward(ctx, do, dmt, dst, d_mc, d_sc):
    q, k, v, G, cv, cx, mc, sc = ctx.saved_tensors
    run = _titans_bwd_impl if eager_backward(ctx) else _titans_bwd_op
    do = torch.zeros_like(v) if do is None else do.contiguous()
    dmt, dst = (None if x is None else x.float().contiguous() for x in (dmt, dst))
    dq, dk, dv, dG, dcv, dcx, dm0, ds0 = run(q, k, v, G, cv, cx, ctx.scale, ctx.b, mc, sc, do, dmt, dst)
    if not ctx.has_state:
        dm0 = ds0 = None
    return dq, dk, dv, dG, dcv, dcx, dm0, ds0, None, None, None


_titans_differentiable = op_function("titans_triton_function", _titans_fwd_impl, _titans_fwd_op, _titans_setup_context,
                                     _titans_backward, non_differentiable=(3, 4))


def titans_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, theta: torch.Tensor, alpha: torch.Tensor,
                  eta: torch.Tensor, *, scale: float, initial_state: tuple[torch.Tensor, torch.Tensor] | None = None,
                  output_final_state: bool = False, chunk_size: int = 64, mini_batch_size: int = 16
                  ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """backend='triton' for titans (inputs validated by the public op; ``chunk_size`` unused: the kernels walk
    mini-batches and keep (M, S) every 64 tokens). mini_batch_size 16 or 32, K up to 128, any V (V is split
    into blocks across programs). The gate coefficients are PyTorch (autograd takes their gradients from the
    kernel's). float64 inputs are computed in float32; o and the state come back in the op's dtypes."""
    if not titans_triton_takes(mini_batch_size, q.shape[-1]):
        raise ValueError(f"backend='triton' takes mini_batch_size in {TRITON_MINI_BATCH_SIZES} and K up to "
                         f"{TRITON_MAX_HEAD_DIM}; got mini_batch_size={mini_batch_size}, K={q.shape[-1]} "
                         "(backend='chunk' takes any)")
    in_dtype, state_dtype = q.dtype, compute_dtype(q)
    dtype = q.dtype if q.dtype in (torch.bfloat16, torch.float16, torch.float32) else torch.float32
    q, k, v = (x.to(dtype).contiguous() for x in (q, k, v))
    G, cv, cx = titans_coefficients_triton(theta, alpha, eta, mini_batch_size)
    m0, s0 = (None, None) if initial_state is None else (x.float().contiguous() for x in initial_state)
    keep = needs_backward(q, k, v, G, cv, cx, m0, s0)
    o, mt, st, _, _ = _titans_differentiable(q, k, v, G, cv, cx, m0, s0, float(scale), mini_batch_size, keep)
    if not output_final_state:
        return o.to(in_dtype), None
    return o.to(in_dtype), (mt.to(state_dtype), st.to(state_dtype))  # float64 inputs: computed in float32


TRITON_BACKENDS = {"ttt_linear": ttt_linear_triton, "titans": titans_triton}
