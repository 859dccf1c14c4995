"""Triton kernels (forward and backward) for the scalar-decay linear RNN.

    S_t = exp(g_t) S_{t-1} + k_t v_t^T,        o_t = S_t^T (scale q_t)

Chunkwise, with b_t the cumulative log gate restarted at each chunk (so every exponent below is
<= 0 and nothing overflows for any T), chunk n of C tokens entering with state S_n:

    o_t     = e^{b_t} (scale q_t)^T S_n + sum_{s<=t} e^{b_t - b_s} (scale q_t . k_s) v_s
    S_{n+1} = e^{b_C} S_n + sum_s e^{b_C - b_s} k_s v_s^T

Backward (dH_n: gradient of the state leaving chunk n; q~ = scale q):

    dH_{n-1} = e^{b_C} dH_n + sum_t e^{b_t} q~_t do_t^T
    dq~_t = e^{b_t} S_n do_t + sum_{s<=t} e^{b_t - b_s} (do_t . v_s) k_s
    dk_s  = sum_{t>=s} e^{b_t - b_s} (do_t . v_s) q~_t + e^{b_C - b_s} dH_n v_s
    dv_s  = sum_{t>=s} e^{b_t - b_s} (q~_t . k_s) do_t + e^{b_C - b_s} dH_n^T k_s

Within a chunk every term depends on b only through differences b_t - b_s, e^{b_t} on the state entering
it and e^{b_C} on the state leaving it (S_{n+1} is linear in e^{b_C}), so the gradient of the chunk's
cumulative gate is dB_t = q_t . dq_t - k_t . dk_t, plus <dH_n, S_{n+1}> at the chunk's last token, and
dg is the reverse cumulative sum of dB within the chunk. The chunk end's term needs no S_{n+1}:

    <dH_n, S_{n+1}> = e^{b_C} <dH_n, S_n> + sum_s k_s . dk_s^inter,   dk_s^inter = e^{b_C - b_s} dH_n v_s

(One reverse sum of dB over the whole sequence, ending at <dS_T, S_T>, is the same number in exact
arithmetic; its terms cancel over the sequence and with tf32 products it drifted to 1e-2 from the float32
reference where the other gradients were 3e-3.)

Four kernels: the state scan (a program per value block and batch-head, looping over chunks), the
output (a program per value block, chunk and batch-head), the reverse scan of state gradients, and
the per-chunk input gradients (with dg). The states entering the
chunks are recomputed in the backward pass instead of being kept. Block shapes depend on the head dims
and the chunk size only, never on T, so a new sequence length reuses the compiled kernels (T is not
specialised on). Packed sequences (B = 1) are read
where they lie: every kernel takes its chunk's first token and token count from the chunks' rows
(common/triton_chunk_output.py's chunk_span) and the state scans run each sequence's own chunks.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..common.scan_segments import Segments, plan_segments, segment_buffers, segment_ints, segment_table
from ..common.triton_chunk_output import (
    chunk_count,
    chunk_output_kernel,
    chunk_span,
    chunk_state_dtype,
    scan_chunk,
    scan_tokens,
)
from ..common.triton_launch import fast_launch
from ..common.triton_ops import gated_rnn_backend
from ..common.triton_scan_segments import fix_segments, scan_slices, scan_span
from ..common.triton_utils import block as _block
from ..common.triton_utils import (
    cdiv,
    dot_precision,
    launch_options,
    launch_overrides,
    mm,
    upcast_dots,
)


@fast_launch
@triton.jit(do_not_specialize=["T", "NC", "PER_ROW", "LEN", "BASE"])
def _state_fwd_kernel(k, v, g, h, h0, ht, cu, rows, seg, lam, Lam, T, NC, PER_ROW, LEN, BASE, H: tl.constexpr,
                      K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                      HAS_H0: tl.constexpr, PACKED: tl.constexpr, SEGMENTED: tl.constexpr, PREC: tl.constexpr,
                      UP: tl.constexpr):
    """Grid (cdiv(V, BV), B*H; packed: S*H; segmented: segments*H): h[b, h, n] = state entering chunk n (NC chunks a
    row); ht = state after the last chunk. PACKED (packed sequences where they lie, chunk n's tokens from ``rows``:
    chunk_span): program s*H + h scans sequence s's chunks [cu[s], cu[s + 1]), from its initial state h0[s, h] to its
    final state ht[s, h]. SEGMENTED (common/scan_segments.py): program s*H + h scans segment s from zero (from h0
    at its sequence's start) and stores its end state to ht[s, h], its summed log decay to Lam[s, h] and each chunk's
    log decay from the segment's start to lam[.., h, n]: common/triton_scan_segments.py completes h. BASE: added to the
    program index along axis 1 (launches cut at the grid's limit, grid_slices)."""
    i_v, i_bh = tl.program_id(0), tl.program_id(1).to(tl.int64) + BASE
    i_h = i_bh % H
    N = NC
    c0, c1, i_b, i_hb, i_0, starts, _ = scan_span(cu, seg, i_bh, N, PER_ROW, LEN, H, PACKED, SEGMENTED)
    o_k, o_c = tl.arange(0, BK), tl.arange(0, C)
    o_v = i_v * BV + tl.arange(0, BV)
    kv = o_k[:, None] * V + o_v[None, :]
    m_kv = (o_k[:, None] < K) & (o_v[None, :] < V)
    S = tl.zeros([BK, BV], dtype=tl.float32)
    dec = tl.sum(tl.zeros([BK], dtype=tl.float32), axis=0)  # SEGMENTED: the log decay since the segment's start
    if HAS_H0:
        if starts:
            S += tl.load(h0 + i_0 * K * V + kv, mask=m_kv, other=0.0).to(tl.float32)
    t_start, t_end = scan_tokens(rows, c0, c1, PACKED)  # the run's tokens, read once
    for n in range(c0, c1):
        tl.store(h + (i_hb * N + n) * K * V + kv, S.to(h.dtype.element_ty), mask=m_kv)
        first, count = scan_chunk(rows, n, c0, t_start, t_end, i_b, T, C, PACKED)
        m_t = o_c < count
        row = (first + o_c) * H + i_h
        b = tl.cumsum(tl.load(g + row, mask=m_t, other=0.0).to(tl.float32), axis=0)
        b_last = tl.sum(tl.where(o_c == C - 1, b, 0.0), axis=0)
        kt = tl.load(k + row[None, :] * K + o_k[:, None], mask=(o_k[:, None] < K) & m_t[None, :], other=0.0)
        vc = tl.load(v + row[:, None] * V + o_v[None, :], mask=m_t[:, None] & (o_v[None, :] < V), other=0.0)
        vw = (vc.to(tl.float32) * tl.exp(b_last - b)[:, None]).to(vc.dtype)
        S = S * tl.exp(b_last) + mm(kt, vw, PREC, UP)
        if SEGMENTED:
            _store_decay(lam + i_hb * N + n, dec, i_v)
            dec += b_last
    tl.store(ht + i_bh * K * V + kv, S, mask=m_kv)
    if SEGMENTED:
        _store_decay(Lam + i_bh, dec, i_v)


@triton.jit
def _store_decay(ptr, value, i_v):
    """One value block's programs store a scalar log decay (the others hold the same number)."""
    o = tl.arange(0, 2)
    tl.store(ptr + o * 0, value + o * 0.0, mask=(o == 0) & (o * 0 + i_v == 0))


@fast_launch
@triton.jit(do_not_specialize=["T", "NC", "PER_ROW", "LEN", "BASE"])
def _state_bwd_kernel(q, g, do, dh, dht, dh0, cu, rows, seg, lam, Lam, scale, T, NC, PER_ROW, LEN, BASE,
                      H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr,
                      BV: tl.constexpr, HAS_DHT: tl.constexpr, PACKED: tl.constexpr, SEGMENTED: tl.constexpr,
                      PREC: tl.constexpr, UP: tl.constexpr):
    """Grid (cdiv(V, BV), B*H; packed: S*H; segmented: segments*H): dh[b, h, n] = gradient of the state leaving
    chunk n; dh0 = of the initial one (PACKED: program s*H + h runs sequence s's chunks in reverse, from dht[s, h]
    to dh0[s, h]). SEGMENTED: segment s in reverse from zero (from dht at its sequence's end), its gradient at the
    segment's start to dh0[s, h], the decays as in _state_fwd_kernel (lam: from the chunk's end to the segment's). BASE:
    added to the program index along axis 1 (launches cut at the grid's limit, grid_slices)."""
    i_v, i_bh = tl.program_id(0), tl.program_id(1).to(tl.int64) + BASE
    i_h = i_bh % H
    N = NC
    c0, c1, i_b, i_hb, i_0, _, ends = scan_span(cu, seg, i_bh, N, PER_ROW, LEN, H, PACKED, SEGMENTED)
    o_k, o_c = tl.arange(0, BK), tl.arange(0, C)
    o_v = i_v * BV + tl.arange(0, BV)
    kv = o_k[:, None] * V + o_v[None, :]
    m_kv = (o_k[:, None] < K) & (o_v[None, :] < V)
    dS = tl.zeros([BK, BV], dtype=tl.float32)
    dec = tl.sum(tl.zeros([BK], dtype=tl.float32), axis=0)
    if HAS_DHT:
        if ends:
            dS += tl.load(dht + i_0 * K * V + kv, mask=m_kv, other=0.0).to(tl.float32)
    t_start, t_end = scan_tokens(rows, c0, c1, PACKED)  # the run's tokens, read once
    for i in range(c1 - c0):
        n = c1 - 1 - i
        tl.store(dh + (i_hb * N + n) * K * V + kv, dS.to(dh.dtype.element_ty), mask=m_kv)
        first, count = scan_chunk(rows, n, c0, t_start, t_end, i_b, T, C, PACKED)
        m_t = o_c < count
        row = (first + o_c) * H + i_h
        b = tl.cumsum(tl.load(g + row, mask=m_t, other=0.0).to(tl.float32), axis=0)
        b_last = tl.sum(tl.where(o_c == C - 1, b, 0.0), axis=0)
        qt = tl.load(q + row[None, :] * K + o_k[:, None], mask=(o_k[:, None] < K) & m_t[None, :], other=0.0)
        doc = tl.load(do + row[:, None] * V + o_v[None, :], mask=m_t[:, None] & (o_v[None, :] < V), other=0.0)
        q_dec = (qt.to(tl.float32) * (scale * tl.exp(b))[None, :]).to(doc.dtype)
        dS = dS * tl.exp(b_last) + mm(q_dec, doc, PREC, UP)
        if SEGMENTED:
            _store_decay(lam + i_hb * N + n, dec, i_v)
            dec += b_last
    tl.store(dh0 + i_bh * K * V + kv, dS, mask=m_kv)
    if SEGMENTED:
        _store_decay(Lam + i_bh, dec, i_v)


@fast_launch
@triton.jit(do_not_specialize=["T", "NC"])
def _grads_bwd_kernel(q, k, v, g, h, do, dh, dq, dk, dv, dg, rows, scale, T, NC, H: tl.constexpr, K: tl.constexpr,
                      V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
                      UP: tl.constexpr, PACKED: tl.constexpr):
    """Grid (NC, B*H): dq, dk, dv of one chunk (looping over value blocks) and dg, in g's dtype (PACKED: the chunk's
    tokens from ``rows``): the reverse cumulative sum within the chunk of dB_t = q_t.dq_t - k_t.dk_t plus, at its
    last token, the chunk end's term <dH_n, S_{n+1}> = e^{b_C} <dH_n, S_n> + sum_s k_s . dk_s^inter (module
    docstring), from the tiles the value loop reads anyway."""
    n, i_bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    N = NC
    o_k, o_c = tl.arange(0, BK), tl.arange(0, C)
    first, count = chunk_span(rows, n, i_b, T, C, PACKED)
    m_t = o_c < count
    row = (first + o_c) * H + i_h
    m_ck = m_t[:, None] & (o_k[None, :] < K)
    b = tl.cumsum(tl.load(g + row, mask=m_t, other=0.0).to(tl.float32), axis=0)
    b_last = tl.sum(tl.where(o_c == C - 1, b, 0.0), axis=0)
    qc = tl.load(q + row[:, None] * K + o_k[None, :], mask=m_ck, other=0.0)
    kc = tl.load(k + row[:, None] * K + o_k[None, :], mask=m_ck, other=0.0)
    causal = o_c[:, None] >= o_c[None, :]
    D = tl.where(causal, tl.exp(tl.where(causal, b[:, None] - b[None, :], 0.0)), 0.0)  # [t, s]
    A = mm(qc, tl.trans(kc), PREC, UP) * D * scale  # decayed scores q~_t . k_s
    k_tail = (kc.to(tl.float32) * tl.exp(b_last - b)[:, None]).to(kc.dtype)
    dq_acc = tl.zeros([C, BK], dtype=tl.float32)
    dk_acc = tl.zeros([C, BK], dtype=tl.float32)
    dA = tl.zeros([C, C], dtype=tl.float32)
    sdh = 0.0  # <S_n, dH_n>
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_cv = m_t[:, None] & (o_v[None, :] < V)
        m_kv = (o_k[:, None] < K) & (o_v[None, :] < V)
        vc = tl.load(v + row[:, None] * V + o_v[None, :], mask=m_cv, other=0.0)
        doc = tl.load(do + row[:, None] * V + o_v[None, :], mask=m_cv, other=0.0)
        S = tl.load(h + (i_bh * N + n) * K * V + o_k[:, None] * V + o_v[None, :], mask=m_kv, other=0.0)
        dS = tl.load(dh + (i_bh * N + n) * K * V + o_k[:, None] * V + o_v[None, :], mask=m_kv, other=0.0)
        dA += mm(doc, tl.trans(vc), PREC, UP)
        dq_acc += mm(doc.to(S.dtype), tl.trans(S), PREC, UP)
        dk_acc += mm(vc.to(dS.dtype), tl.trans(dS), PREC, UP)
        sdh += tl.sum(tl.sum(S.to(tl.float32) * dS.to(tl.float32), axis=1), axis=0)
        dv_blk = mm(tl.trans(A).to(doc.dtype), doc, PREC, UP)
        dv_blk += mm(k_tail.to(dS.dtype), dS, PREC, UP)
        tl.store(dv + row[:, None] * V + o_v[None, :], dv_blk.to(dv.dtype.element_ty), mask=m_cv)
    dA = dA * D  # (do_t . v_s) e^{b_t - b_s} for s <= t
    dq_acc = dq_acc * tl.exp(b)[:, None] + mm(dA.to(kc.dtype), kc, PREC, UP)
    dk_acc = dk_acc * tl.exp(b_last - b)[:, None]  # the inter-chunk part, dk^inter
    end = tl.exp(b_last) * sdh + tl.sum(tl.sum(kc.to(tl.float32) * dk_acc, axis=1), axis=0)
    dk_acc += mm(tl.trans(dA).to(qc.dtype), qc, PREC, UP) * scale
    dq_acc = dq_acc * scale
    tl.store(dq + row[:, None] * K + o_k[None, :], dq_acc.to(dq.dtype.element_ty), mask=m_ck)
    tl.store(dk + row[:, None] * K + o_k[None, :], dk_acc.to(dk.dtype.element_ty), mask=m_ck)
    dG_t = tl.sum(qc.to(tl.float32) * dq_acc - kc.to(tl.float32) * dk_acc, axis=1)
    # b_t cumulates the gates within the chunk, so g_t reaches the later b_s of its chunk and, through b_C, the
    # whole state leaving it (the chunk end's term). One reverse sum of dG over the sequence is the same in exact
    # arithmetic, but its terms cancel over the whole sequence: with tf32 products it was 1e-2 off (T = 1024).
    dG_t += tl.where(o_c == count - 1, end, 0.0)
    tl.store(dg + row, tl.cumsum(dG_t, axis=0, reverse=True).to(dg.dtype.element_ty), mask=m_t)


# Launch settings: fixed per head size (never tuned per sequence length); `python -m linattn.bench.triton_tune
# --family simple_gla` times alternatives kernel by kernel on a GPU.
# "<kernel>_stages": software-pipelining depth of bf16/fp16 inputs (float32 keeps Triton's default); "scan" is the
# forward state scan, "bscan" the reverse one.
# "segments" and "seg_min": the state scans cut long sequences into segments (docs/triton.md, "Segmented state
# scans"): "auto", "always" or "never", and the shortest segment in chunks.
LAUNCH = {"BV": 64, "scan_warps": 4, "scan_stages": 3, "bscan_warps": 4, "bscan_stages": 3, "out_warps": 4,
          "out_stages": 3, "grads_BV": 64, "grads_warps": 8, "grads_stages": 3, "segments": "auto", "seg_min": 8}
launch_overrides("simple_gla", LAUNCH)


def _fitted(K: int, dtype: torch.dtype, C: int) -> tuple[int, dict, int | None]:
    """(chunk size, launch settings, float32 stages) that fit an H100's 227 KB of shared memory per program.

    LAUNCH is tuned for bf16/fp16 at head dims up to 128 and is used unchanged there. Wider key blocks and float32
    tiles need more shared memory (``python -m linattn.bench.triton_resources`` for sm_90, Triton 3.9): the gradient
    kernel took 311 KB at float32, K = 128 and 328 KB at bf16, K = 256 with LAUNCH; the output kernel 279 KB at float32,
    K = 256. So bf16/fp16 with K > 128 take value blocks of 32 in the gradient kernel (201 KB); float32 with K <= 128
    value blocks of 32 and 2 stages there (164 KB); float32 with K > 128 chunks of at most 32 tokens, value blocks of
    32 and one stage everywhere (at most 172 KB). The chunk size changes only the order of the sums, not the result.
    bf16/fp16 with K > 128 also run the output kernel at 2 warps (below: Triton 3.6 miscompiled it at 4 and 8).
    """
    launch = dict(LAUNCH)
    if dtype != torch.float32:
        if _block(K) > 128:
            launch["grads_BV"] = min(launch["grads_BV"], 32)
            # Triton 3.6 on an H200 miscompiled the output kernel at bf16, K = 256, value blocks of 32 with 4 or 8
            # warps and 1 to 3 stages (compute-sanitizer: shared-memory reads past the allocation, then an illegal
            # memory access); at 2 warps it ran clean
            launch["out_warps"] = min(launch["out_warps"], 2)
        return C, launch, None
    if _block(K) <= 128:
        launch["grads_BV"] = min(launch["grads_BV"], 32)
        return C, launch, None
    launch.update(BV=min(launch["BV"], 32), grads_BV=min(launch["grads_BV"], 32))
    return min(C, 32), launch, 1


def _options(launch: dict, kernel: str, dtype: torch.dtype, f32_stages: int | None) -> dict:
    """Warps and stages of ``kernel``; float32 gradient kernels at K <= 128 run 2 stages (see :func:`_fitted`)."""
    if dtype == torch.float32 and f32_stages is None and kernel == "grads":
        f32_stages = 2
    return launch_options(launch, kernel, dtype, float32_stages=f32_stages)


def _segments(B: int, N: int, H: int, V: int, C: int, split: bool, launch: dict, device: torch.device,
              cu_chunks: torch.Tensor | None) -> Segments | None:
    """How the state scans are cut (common/scan_segments.py), the same for the forward and the backward pass: per
    chunk column a scan runs H programs per value block. Packed sequences are not cut where the kernels split each
    chunk (``split``: float32 with K > 128, :func:`_fitted_chunks`)."""
    if split and cu_chunks is not None:
        return None
    return plan_segments(B, N, C, H * cdiv(V, min(launch["BV"], _block(V))), device, cu_chunks, launch, "simple_gla")


def _states(k, v, g, initial_state, C, launch, f32_stages, cu_chunks=None, precision=None, chunk_rows=None,
            segments=None):
    """(h [B, H, N, K, V]: the states entering the chunks, the final state float32 [rows, H, K, V]); ``segments``:
    the scan cut as :func:`_segments` says."""
    B, T, H, K = k.shape
    V = v.shape[-1]
    N = chunk_count(T, C, chunk_rows)
    rows = B if cu_chunks is None else cu_chunks.shape[0] - 1
    BK, BV = _block(K), min(launch["BV"], _block(V))
    h = torch.empty(B, H, N, K, V, device=k.device, dtype=chunk_state_dtype(k))
    ht = torch.empty(rows, H, K, V, device=k.device, dtype=torch.float32)
    h0 = initial_state if initial_state is not None else ht  # unused pointer when HAS_H0 is False
    ends, Lam, lam = segment_buffers(segments, ht, B, N, H, K, V, per_key=False)
    for base, count in scan_slices(rows, H, segments):
        _state_fwd_kernel[(cdiv(V, BV), count)](
            k=k, v=v, g=g, h=h, h0=h0, ht=ends, cu=ht if cu_chunks is None else cu_chunks,
            rows=ht if chunk_rows is None else chunk_rows, seg=segment_table(segments, ht), lam=lam, Lam=Lam, T=T,
            NC=N, **segment_ints(segments), BASE=base, H=H, K=K, V=V, C=C, BK=BK, BV=BV,
            HAS_H0=initial_state is not None, PACKED=chunk_rows is not None, SEGMENTED=segments is not None,
            PREC=precision or dot_precision(k.dtype), UP=upcast_dots(k.dtype),
            **_options(launch, "scan", k.dtype, f32_stages))
    if segments is not None:
        fix_segments(h, ends, lam, Lam, ht, segments, reverse=False, BK=BK, BV=BV)
    return h, ht


def _fitted_chunks(cu_chunks, chunk_rows, chunk_size, C):
    """``cu_chunks`` and ``chunk_rows`` of packed sequences (in chunks of ``chunk_size`` tokens) counted in the
    kernels' chunks of C tokens (C divides ``chunk_size``): each chunk split into chunk_size / C, the ones past its
    tokens empty and placed at its end (a state passes an empty chunk unchanged; a sequence still ends where its
    last chunk does)."""
    if cu_chunks is None or C == chunk_size:
        return cu_chunks, chunk_rows
    m = chunk_size // C
    step = torch.minimum(torch.arange(m, device=chunk_rows.device) * C, chunk_rows[:, 1:])  # an empty one at the end
    rows = torch.stack([chunk_rows[:, :1] + step, (chunk_rows[:, 1:] - step).clamp(0, C)], dim=-1)
    return cu_chunks * m, rows.view(-1, 2)


class ChunkStates(NamedTuple):
    """The chunk-entry states of one scan (``h`` [B, H, N, K, V], the final state float32) and the launch they
    were made with: enough to read the scan with any number of queries (:func:`simple_gla_triton_read`); ``rows``:
    packed sequences' chunks (None unpacked)."""

    h: torch.Tensor
    final: torch.Tensor
    C: int
    launch: dict
    f32_stages: int | None
    precision: str | None
    rows: torch.Tensor | None = None


def simple_gla_triton_states(k, v, g, initial_state, C, cu_chunks=None, precision=None, chunk_rows=None
                             ) -> ChunkStates:
    """The state scan S_n = exp(sum of g over chunk n) S_{n-1} + sum_s exp(b_last - b_s) k_s v_s^T at every chunk
    entry. ``cu_chunks`` and ``chunk_rows``: packed sequences (B = 1) read where they lie, by chunks of C tokens
    (common/packed_call.py's ChunkLayout); ``precision``: the dots' input precision instead of
    :func:`dot_precision`'s (float32 inputs only)."""
    C0 = C
    C, launch, f32_stages = _fitted(k.shape[-1], k.dtype, C)
    cu_chunks, chunk_rows = _fitted_chunks(cu_chunks, chunk_rows, C0, C)
    B, T, H, _ = k.shape
    segments = _segments(B, chunk_count(T, C, chunk_rows), H, v.shape[-1], C, C != C0, launch, k.device, cu_chunks)
    h, ht = _states(k, v, g, initial_state, C, launch, f32_stages, cu_chunks, precision, chunk_rows, segments)
    return ChunkStates(h, ht, C, launch, f32_stages, precision, chunk_rows)


def simple_gla_triton_read(q, k, v, g, scale, states: ChunkStates):
    """o_t = (scale exp(b_t) q_t)^T S_n + the chunk's causal part, for the states of the same k, v, g: one launch of
    the output kernel (a scan read with another query costs no second state scan)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    C, launch, N = states.C, states.launch, states.h.shape[2]
    o = torch.empty_like(v)
    BK, BV = _block(K), min(launch["BV"], _block(V))
    chunk_output_kernel[(cdiv(V, BV) * N, B * H)](
        q=q, k=k, v=v, g=g, h=states.h, o=o, rows=o if states.rows is None else states.rows, scale=scale, T=T,
        NC=N, H=H, K=K, V=V, C=C, BK=BK, BV=BV, PREC=states.precision or dot_precision(q.dtype),
        UP=upcast_dots(q.dtype), USE_G=True, PACKED=states.rows is not None,
        **_options(launch, "out", q.dtype, states.f32_stages))
    return o


def simple_gla_triton_forward(q, k, v, g, scale, initial_state, C, keep=False, cu_chunks=None, precision=None,
                              chunk_rows=None):
    """Forward pass: (o, final state float32). Inputs contiguous [B, T, H, *]; g [B, T, H] float32, bf16 or fp16.
    Nothing is kept for the backward pass (``keep`` is ignored): its states cost one cheap scan to recompute.
    ``cu_chunks`` and ``chunk_rows``: packed sequences read where they lie (:func:`simple_gla_triton_states`).
    ``precision``: the dots' input precision instead of :func:`dot_precision`'s (float32 inputs only)."""
    states = simple_gla_triton_states(k, v, g, initial_state, C, cu_chunks, precision, chunk_rows)
    return simple_gla_triton_read(q, k, v, g, scale, states), states.final


def simple_gla_triton_backward(q, k, v, g, scale, initial_state, C, do, dht, saved=(None, None), cu_chunks=None,
                               precision=None, chunk_rows=None):
    """Backward pass: (dq, dk, dv, dg, d_initial_state); the chunk states are recomputed (nothing is kept)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    C0 = C
    C, launch, f32_stages = _fitted(K, q.dtype, C)
    cu_chunks, chunk_rows = _fitted_chunks(cu_chunks, chunk_rows, C0, C)
    N = chunk_count(T, C, chunk_rows)
    rows = B if cu_chunks is None else cu_chunks.shape[0] - 1
    rp = q if chunk_rows is None else chunk_rows  # pointer placeholder unpacked
    BK, BV = _block(K), min(launch["BV"], _block(V))
    segments = _segments(B, N, H, V, C, C != C0, launch, q.device, cu_chunks)
    h, _ = _states(k, v, g, initial_state, C, launch, f32_stages, cu_chunks, precision, chunk_rows, segments)
    dh = torch.empty_like(h)
    dh0 = torch.empty(rows, H, K, V, device=q.device, dtype=torch.float32)
    starts, Lam, lam = segment_buffers(segments, dh0, B, N, H, K, V, per_key=False)
    for base, count in scan_slices(rows, H, segments):
        _state_bwd_kernel[(cdiv(V, BV), count)](
            q=q, g=g, do=do, dh=dh, dht=dht if dht is not None else dh0, dh0=starts,
            cu=dh0 if cu_chunks is None else cu_chunks, rows=rp, seg=segment_table(segments, dh0), lam=lam, Lam=Lam,
            scale=scale, T=T, NC=N, **segment_ints(segments), BASE=base, H=H, K=K, V=V, C=C, BK=BK, BV=BV,
            HAS_DHT=dht is not None, PACKED=chunk_rows is not None, SEGMENTED=segments is not None,
            PREC=precision or dot_precision(q.dtype), UP=upcast_dots(q.dtype),
            **_options(launch, "bscan", q.dtype, f32_stages))
    if segments is not None:
        fix_segments(dh, starts, lam, Lam, dh0, segments, reverse=True, BK=BK, BV=BV)
    dq, dk, dv, dg = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(g)
    _grads_bwd_kernel[(N, B * H)](
        q=q, k=k, v=v, g=g, h=h, do=do, dh=dh, dq=dq, dk=dk, dv=dv, dg=dg, rows=rp, scale=scale, T=T, NC=N, H=H, K=K,
        V=V, C=C, BK=BK, BV=min(launch["grads_BV"], _block(V)), PREC=precision or dot_precision(q.dtype),
        UP=upcast_dots(q.dtype), PACKED=chunk_rows is not None, **_options(launch, "grads", q.dtype, f32_stages))
    return dq, dk, dv, dg, dh0


simple_gla_triton = gated_rnn_backend("simple_gla_triton", simple_gla_triton_forward, simple_gla_triton_backward)


TRITON_BACKENDS = {"simple_gla": simple_gla_triton}
