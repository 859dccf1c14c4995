"""The device side of segmented state scans (common/scan_segments.py): where a segment lies, and the kernel that
folds the segments' end states in order and corrects every chunk state of a segment by the state it really enters
with. For a diagonal transition (a log decay per key channel, PER_KEY, or one per head), with E_j and Lambda_j the
end state and summed log decay of segment j scanned from zero (its sequence's first segment from the initial state):

    forward:  S_j = sum_{i < j} exp(Lambda_{i+1} + ... + Lambda_{j-1}) E_i   (i from the sequence's first segment),
              h_n += exp(lambda_n) S_j   for the chunks n of segment j (not the sequence's first),
              final = exp(Lambda_last) S_last + E_last
    reverse:  the same from the sequence's last segment down (E_j the gradient reaching segment j's start from its own
              chunks, h the gradients of the states leaving the chunks), ending at the initial state's gradient.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .scan_segments import Segments
from .triton_launch import fast_launch
from .triton_utils import cdiv, grid_slices


@triton.jit
def segment_span(seg, s, PER_ROW, LEN, NC, PACKED: tl.constexpr):
    """(first chunk, chunk after the last, sequence, its sequence's first segment, its last segment) of segment s, all
    int64. PACKED: read from the table ``seg`` [segments, 5]; else row s // PER_ROW cut into PER_ROW segments of LEN
    chunks (of NC), chunk indices within the row."""
    if PACKED:
        c0 = tl.load(seg + 5 * s).to(tl.int64)
        c1 = tl.load(seg + 5 * s + 1).to(tl.int64)
        sq = tl.load(seg + 5 * s + 2).to(tl.int64)
        lo = tl.load(seg + 5 * s + 3).to(tl.int64)
        hi = tl.load(seg + 5 * s + 4).to(tl.int64)
    else:
        s = s.to(tl.int64)
        sq = s // PER_ROW
        c0 = (s - sq * PER_ROW) * LEN
        c1 = tl.minimum(c0 + LEN, NC)
        lo = sq * PER_ROW
        hi = lo + PER_ROW - 1
    return c0, c1, sq, lo, hi


@triton.jit
def scan_span(cu, seg, i_bh, NC, PER_ROW, LEN, H: tl.constexpr, PACKED: tl.constexpr, SEGMENTED: tl.constexpr):
    """(c0, c1, i_b, i_hb, h0 row, whether this program starts its sequence and ends it) of a state scan's program
    over rows of heads i_bh: batch rows (unpacked), packed sequences (PACKED: chunks from ``cu``), or segments of
    either (SEGMENTED: :func:`segment_span`). ``i_bh`` int64."""
    i_h = i_bh % H
    if SEGMENTED:
        s = i_bh // H
        c0, c1, sq, lo, hi = segment_span(seg, s, PER_ROW, LEN, NC, PACKED)
        if PACKED:
            i_b, i_hb = sq * 0, i_h
        else:
            i_b, i_hb = sq, sq * H + i_h
        return c0, c1, i_b, i_hb, sq * H + i_h, lo == s, hi == s
    elif PACKED:  # sequence i_bh // H: its chunks of the one batch row, its states at row i_h of h
        c0 = tl.load(cu + i_bh // H).to(tl.int64)
        c1 = tl.load(cu + i_bh // H + 1).to(tl.int64)
        return c0, c1, i_bh * 0, i_h, i_bh, i_bh >= 0, i_bh >= 0
    else:
        return i_bh * 0, i_bh * 0 + NC, i_bh // H, i_bh, i_bh, i_bh >= 0, i_bh >= 0


@triton.jit
def _decay(Lam, i, o_k, K: tl.constexpr, PER_KEY: tl.constexpr):
    """exp of log decay row i, as a column to scale [BK, BV] state rows by (one value per head without PER_KEY)."""
    if PER_KEY:
        return tl.exp(tl.load(Lam + i * K + o_k, mask=o_k < K, other=0.0))[:, None]
    else:
        return tl.exp(tl.load(Lam + i + o_k * 0))[:, None]


@fast_launch
@triton.jit(do_not_specialize=["NC", "PER_ROW", "LEN"])
def segment_fixup_kernel(x, E, lam, Lam, out, seg, NC, PER_ROW, LEN, H: tl.constexpr, K: tl.constexpr,
                         V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PER_KEY: tl.constexpr,
                         REVERSE: tl.constexpr, PACKED: tl.constexpr):
    """Grid (LEN * segments * H, cdiv(K, BK), cdiv(V, BV)): program (j, s, h) folds the earlier (REVERSE: later)
    segments of segment s's sequence and corrects the j-th chunk state of segment s, x[row, h, c0 + j] (rows: batch
    rows, or the one packed row), unless s is its sequence's first (REVERSE: last) segment; j = 0 at its sequence's
    last (REVERSE: first) segment also stores the sequence's final state (REVERSE: initial state gradient)
    out[seq, h]. One chunk a program: the corrections are independent, and a loop over a segment's chunks would
    take about as long as the scan. E [segments, H, K, V] and Lam [segments, H(, K)] from the segmented scan; lam
    [rows, H, NC(, K)] the log decay from a chunk to its segment's start (REVERSE: end). The program index runs
    along the grid's first axis, which has room for any number of chunks."""
    i_x, i_k, i_v = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
    j, i_sh = i_x % LEN, i_x // LEN
    s, i_h = i_sh // H, i_sh % H
    c0, c1, sq, lo, hi = segment_span(seg, s, PER_ROW, LEN, NC, PACKED)
    if REVERSE:
        fixed, ends = s != hi, s == lo
    else:
        fixed, ends = s != lo, s == hi
    n = c0 + j
    if (fixed & (n < c1)) | (ends & (j == 0)):
        if PACKED:
            i_hb = i_h
        else:
            i_hb = sq * H + i_h
        o_k, o_v = i_k * BK + tl.arange(0, BK), i_v * BV + tl.arange(0, BV)
        kv = o_k[:, None] * V + o_v[None, :]
        m_kv = (o_k[:, None] < K) & (o_v[None, :] < V)
        S = tl.zeros([BK, BV], dtype=tl.float32)
        if REVERSE:
            for jj in range(hi - s):
                i = hi - jj
                S = S * _decay(Lam, i * H + i_h, o_k, K, PER_KEY) + tl.load(E + (i * H + i_h) * K * V + kv,
                                                                           mask=m_kv, other=0.0)
        else:
            for i in range(lo, s):
                S = S * _decay(Lam, i * H + i_h, o_k, K, PER_KEY) + tl.load(E + (i * H + i_h) * K * V + kv,
                                                                           mask=m_kv, other=0.0)
        if fixed & (n < c1):
            ptr = x + (i_hb * NC + n) * K * V + kv
            add = S * _decay(lam, i_hb * NC + n, o_k, K, PER_KEY)
            tl.store(ptr, (tl.load(ptr, mask=m_kv, other=0.0).to(tl.float32) + add).to(x.dtype.element_ty),
                     mask=m_kv)
        if ends & (j == 0):
            final = S * _decay(Lam, i_sh, o_k, K, PER_KEY) + tl.load(E + i_sh * K * V + kv, mask=m_kv, other=0.0)
            tl.store(out + (sq * H + i_h) * K * V + kv, final.to(out.dtype.element_ty), mask=m_kv)


def scan_slices(rows: int, H: int, segments: Segments | None) -> list[tuple[int, int]]:
    """(first, count) of a state scan's launches along its heads axis: a program per sequence (or segment) and head,
    cut at the grid's limit (triton_utils.grid_slices)."""
    return grid_slices((rows if segments is None else segments.count) * H)


def fix_segments(x: torch.Tensor, ends: torch.Tensor, lam: torch.Tensor, Lam: torch.Tensor, out: torch.Tensor,
                 segments: Segments, *, reverse: bool, BK: int, BV: int, num_warps: int = 4) -> None:
    """Launch :func:`segment_fixup_kernel`: x [rows, H, NC, K, V] the segmented scan's chunk states (corrected in
    place), ``ends`` its segments' end states [segments, H, K, V], ``Lam`` their log decays [segments, H(, K)],
    ``lam`` the chunks' [rows, H, NC(, K)]; ``out`` [sequences, H, K, V] receives the final state (reverse: the
    initial state's gradient)."""
    _, H, NC, K, V = x.shape
    packed = segments.table is not None
    segment_fixup_kernel[(segments.length * segments.count * H, cdiv(K, BK), cdiv(V, BV))](
        x=x, E=ends, lam=lam, Lam=Lam, out=out, seg=segments.table if packed else ends, NC=NC,
        PER_ROW=max(segments.per_row, 1), LEN=segments.length, H=H, K=K, V=V, BK=BK, BV=BV,
        PER_KEY=lam.dim() == 4, REVERSE=reverse, PACKED=packed, num_warps=num_warps)
