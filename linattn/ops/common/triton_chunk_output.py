"""The output pass of a chunked scalar-decay scan, shared by simple_gla (and its derived ops) and the delta family
(which runs it on its pseudo-values), and the dtype in which these scans keep chunk-entry states."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_launch import fast_launch
from .triton_masking import causal_dot_rest
from .triton_utils import block_and_index, cdiv, mm


def chunk_state_dtype(x: torch.Tensor) -> torch.dtype:
    """Chunk-entry states are kept in the input dtype for bf16/fp16 (half the memory, as FLA does)."""
    return torch.float32 if x.dtype == torch.float32 else x.dtype


def chunk_count(T: int, C: int, chunk_rows: torch.Tensor | None) -> int:
    """The chunks of C tokens a batch row of T tokens runs; for packed sequences (``chunk_rows``, see
    :func:`chunk_span`) one per row of ``chunk_rows``."""
    return cdiv(T, C) if chunk_rows is None else chunk_rows.shape[0]


@triton.jit
def chunk_span(chunk_rows, n, i_b, T, C: tl.constexpr, PACKED: tl.constexpr):
    """(first, count) of chunk n of batch row i_b: the index of its first token among all B * T tokens (int64) and how
    many tokens it has. PACKED (packed sequences read where they lie, B = 1): from ``chunk_rows`` [chunks, 2] (first
    packed token, tokens; common/packed_call.py's ChunkLayout), every chunk inside one sequence and the rows past
    ``count`` another sequence's, which every load and store masks; else tokens n*C.. of the row, at most T - n*C."""
    if PACKED:
        first = tl.load(chunk_rows + 2 * n).to(tl.int64)
        count = tl.load(chunk_rows + 2 * n + 1).to(tl.int32)
    else:
        first = i_b.to(tl.int64) * T + n * C
        count = tl.minimum(T - n * C, C).to(tl.int32)
    return first, count


@triton.jit
def scan_tokens(chunk_rows, c0, c1, PACKED: tl.constexpr):
    """(first token, end token) of the chunks [c0, c1) that one program of a state scan runs, read once before its
    loop (PACKED; 0, 0 unpacked): they are consecutive chunks of one sequence, so :func:`scan_chunk` finds each
    chunk's tokens by arithmetic instead of a load that every step of the serial loop would wait on."""
    if PACKED:
        ran = c1 > c0
        last = tl.maximum(c1 - 1, c0)
        start = tl.load(chunk_rows + 2 * c0, mask=ran, other=0).to(tl.int64)
        end = (tl.load(chunk_rows + 2 * last, mask=ran, other=0).to(tl.int64)
               + tl.load(chunk_rows + 2 * last + 1, mask=ran, other=0).to(tl.int64))
    else:
        start = c0 * 0
        end = start
    return start, end


@triton.jit
def scan_chunk(chunk_rows, n, c0, start, end, i_b, T, C: tl.constexpr, PACKED: tl.constexpr):
    """:func:`chunk_span` of chunk n of a scan program's run [c0, ..) without a load (PACKED, from its
    :func:`scan_tokens`): chunk n - c0 of the run starts (n - c0) C tokens after ``start`` and ends at most at
    ``end`` (an empty chunk, count 0, past it: simple_gla's split chunks place theirs at the end)."""
    if PACKED:
        first = start + (n - c0) * C
        count = tl.maximum(tl.minimum(end - first, C), 0).to(tl.int32)
    else:
        first, count = chunk_span(chunk_rows, n, i_b, T, C, PACKED)
    return first, count


@fast_launch
@triton.jit(do_not_specialize=["T", "NC"])
def chunk_output_kernel(q, k, v, g, h, o, rows, scale, T, NC, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                        C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr, UP: tl.constexpr,
                        USE_G: tl.constexpr, PACKED: tl.constexpr):
    """Grid (cdiv(V, BV) * NC, B*H) (triton_utils.block_and_index): o for one chunk and value block, from the state
    h[b, h, n] entering the chunk (NC chunks a batch row) and the per-head log gates g (cumulated within the chunk as
    b; USE_G False: no decay, g not read):
        o_t = (scale exp(b_t) q_t)^T S_n + sum_{s <= t in the chunk} scale (q_t . k_s) exp(b_t - b_s) v_s.
    PACKED: the chunks' tokens from ``rows`` (:func:`chunk_span`)."""
    i_v, n = block_and_index(tl.cdiv(V, BV))
    i_bh = tl.program_id(1).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    N = NC
    o_k, o_c = tl.arange(0, BK), tl.arange(0, C)
    o_v = i_v * BV + tl.arange(0, BV)
    first, count = chunk_span(rows, n, i_b, T, C, PACKED)
    m_t = o_c < count
    row = (first + o_c) * H + i_h
    m_ck = m_t[:, None] & (o_k[None, :] < K)
    m_cv = m_t[:, None] & (o_v[None, :] < V)
    if USE_G:
        b = tl.cumsum(tl.load(g + row, mask=m_t, other=0.0).to(tl.float32), axis=0)
    else:
        b = tl.zeros([C], dtype=tl.float32)
    qc = tl.load(q + row[:, None] * K + o_k[None, :], mask=m_ck, other=0.0)
    kt = tl.load(k + row[None, :] * K + o_k[:, None], mask=(o_k[:, None] < K) & m_t[None, :], other=0.0)
    vc = tl.load(v + row[:, None] * V + o_v[None, :], mask=m_cv, other=0.0)
    S = tl.load(h + (i_bh * N + n) * K * V + o_k[:, None] * V + o_v[None, :],
                mask=(o_k[:, None] < K) & (o_v[None, :] < V), other=0.0)
    q_dec = (qc.to(tl.float32) * (scale * tl.exp(b))[:, None]).to(S.dtype)
    acc = mm(q_dec, S, PREC, UP)
    causal = o_c[:, None] >= o_c[None, :]
    D = tl.where(causal, tl.exp(tl.where(causal, b[:, None] - b[None, :], 0.0)), 0.0)
    A = tl.where(causal, mm(qc, kt, PREC, UP) * D * scale, 0.0)  # selected: a later NaN key must not leak
    v_fin, v_rest = causal_dot_rest(vc)  # row t reads v rows <= t only (triton_masking.py)
    acc += mm(A.to(vc.dtype), v_fin, PREC, UP) + v_rest
    tl.store(o + row[:, None] * V + o_v[None, :], acc.to(o.dtype.element_ty), mask=m_cv)
