"""The keys at their split's end (``splits.py``) as Triton kernels: one program per split and batch*head.

Within split J of chunks f .. e, with R_j = P_{j+1}^T .. P_e^T (R_e = I) and P_j = I - E_j,

    K~_j = K^_j R_j,   R_{j-1} = R_j - E_j^T R_j,   E~_J = I - R_{f-1}^T,

a chain of S steps from the split's last chunk down, R held in float32 registers. Its backward runs the chain's
adjoint up from the first chunk, with Rb_j the gradient of R_j (Rb_{f-1} = -dE~_J^T):

    dE_j -= R_j Rb_{j-1}^T,   dK^_j += dK~_j R_j^T,   Rb_j = K^_j^T dK~_j + Rb_{j-1} - E_j Rb_{j-1},

reading the R_j that the forward chain (run again for it) kept in a scratch: S K x K matrices per (split,
batch*head), N K^2 per batch*head in all, in the inputs' dtype.

The chains (R, Rb) are carried in float32. Their products take the float32 matrix as a 16-bit head and a 16-bit
tail against the other, 16-bit operand (exact in a tensor-core product): about 16 bits of its mantissa for bf16,
more than the 8 that the outputs are rounded to, so the S steps round once, at the end. The backward's outputs
(dE_j, dK^_j) are single products of 16-bit operands, as in the flash pass's backward. float32 inputs (float64
calls) use the precision their flash pass uses.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..common.triton_launch import fast_launch
from ..common.triton_utils import mm


@triton.jit
def _split(x, LOW: tl.constexpr):
    """(head, tail) of float32 x in dtype LOW: head + tail = x to about twice LOW's mantissa bits."""
    head = x.to(LOW)
    return head, (x - head.to(tl.float32)).to(LOW)


@triton.jit
def _mm_by_f32(a, b, PREC: tl.constexpr, UP: tl.constexpr):
    """a @ b for float32 b and a in the inputs' dtype (exact in its products); a float32 a: mm at PREC."""
    if a.dtype == tl.float32:
        return mm(a, b, PREC, UP)
    else:
        head, tail = _split(b, a.dtype)
        return mm(a, head, PREC, UP) + mm(a, tail, PREC, UP)


@triton.jit
def _split_range(J, N, SPLIT: tl.constexpr):
    """First and last chunk of split J (the last split may have fewer: the rest would be identity chunks)."""
    f = J * SPLIT
    return f, tl.minimum(f + SPLIT, N) - 1


@fast_launch
@triton.jit(do_not_specialize=["N"])
def split_keys_fwd_kernel(kh, E, ks, Es, Rs, N, K: tl.constexpr, C: tl.constexpr, SPLIT: tl.constexpr,
                          BK: tl.constexpr, KEEP: tl.constexpr, PREC: tl.constexpr, UP: tl.constexpr):
    """Grid (NS, B*H): kh, ks [B, H, N C, K]; E [B, H, N, K, K]; Es [B, H, NS, K, K]; with KEEP, R_j to
    Rs [B H, NS, SPLIT, BK, BK] (slot j - f) in its dtype."""
    J, i_bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    NS = (N + SPLIT - 1) // SPLIT
    o_c, o_k = tl.arange(0, C), tl.arange(0, BK)
    m_k = o_k < K
    m_kk = m_k[:, None] & m_k[None, :]
    eye = (o_k[:, None] == o_k[None, :]).to(tl.float32)
    f, e = _split_range(J, N, SPLIT)
    R = eye
    for i in range(0, e - f + 1):
        j = e - i
        if KEEP:
            tl.store(Rs + ((i_bh * NS + J) * SPLIT + j - f) * BK * BK + o_k[:, None] * BK + o_k[None, :],
                     R.to(Rs.dtype.element_ty))
        rows = (i_bh * N + j) * C + o_c
        kj = tl.load(kh + rows[:, None] * K + o_k[None, :], mask=m_k[None, :], other=0.0)
        tl.store(ks + rows[:, None] * K + o_k[None, :], _mm_by_f32(kj, R, PREC, UP).to(ks.dtype.element_ty),
                 mask=m_k[None, :])
        Et = tl.load(E + (i_bh * N + j) * K * K + o_k[None, :] * K + o_k[:, None], mask=m_kk, other=0.0)  # E_j^T
        R = R - _mm_by_f32(Et, R, PREC, UP)
    tl.store(Es + (i_bh * NS + J) * K * K + o_k[:, None] * K + o_k[None, :],
             (eye - tl.trans(R)).to(Es.dtype.element_ty), mask=m_kk)


@fast_launch
@triton.jit(do_not_specialize=["N"])
def split_keys_bwd_kernel(kh, E, dks, dEs, Rs, dkh, dE, N, K: tl.constexpr, C: tl.constexpr, SPLIT: tl.constexpr,
                          BK: tl.constexpr, PREC: tl.constexpr, UP: tl.constexpr):
    """Grid (NS, B*H): adds the split transform's part to dkh [B, H, N C, K] and dE [B, H, N, K, K] (float32, each
    chunk's rows in one program: no atomics) from dks [B, H, N C, K] and dEs [B, H, NS, K, K] (float32) and the
    forward kernel's R_j in Rs."""
    J, i_bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    NS = (N + SPLIT - 1) // SPLIT
    o_c, o_k = tl.arange(0, C), tl.arange(0, BK)
    m_k = o_k < K
    m_kk = m_k[:, None] & m_k[None, :]
    f, e = _split_range(J, N, SPLIT)
    Rb = -tl.load(dEs + (i_bh * NS + J) * K * K + o_k[None, :] * K + o_k[:, None], mask=m_kk, other=0.0)
    for j in range(f, e + 1):
        Rj = tl.load(Rs + ((i_bh * NS + J) * SPLIT + j - f) * BK * BK + o_k[:, None] * BK + o_k[None, :])
        pE = dE + (i_bh * N + j) * K * K + o_k[:, None] * K + o_k[None, :]
        tl.store(pE, tl.load(pE, mask=m_kk, other=0.0) - mm(Rj, tl.trans(Rb.to(Rj.dtype)), PREC, UP), mask=m_kk)
        rows = (i_bh * N + j) * C + o_c
        dkt = tl.load(dks + rows[:, None] * K + o_k[None, :], mask=m_k[None, :], other=0.0)
        pk = dkh + rows[:, None] * K + o_k[None, :]
        tl.store(pk, tl.load(pk, mask=m_k[None, :], other=0.0) + mm(dkt.to(Rj.dtype), tl.trans(Rj), PREC, UP),
                 mask=m_k[None, :])
        kj = tl.load(kh + rows[:, None] * K + o_k[None, :], mask=m_k[None, :], other=0.0)
        Ej = tl.load(E + (i_bh * N + j) * K * K + o_k[:, None] * K + o_k[None, :], mask=m_kk, other=0.0)
        Rb = Rb - _mm_by_f32(Ej, Rb, PREC, UP) + _mm_by_f32(tl.trans(kj), dkt, PREC, UP)
