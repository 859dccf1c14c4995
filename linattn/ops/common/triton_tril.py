"""Inverse of a unit lower-triangular chunk matrix inside a Triton kernel (import only where Triton is installed).

    Tm = (I + A)^-1,   A [C, C] strictly lower triangular, C in {16, 32, 64}

The delta-rule family needs it per chunk (the WY / UT transform). Row-by-row forward substitution
would take C - 1 dependent steps on a [C, C] tile; instead:

1. the 16 x 16 diagonal blocks are inverted together by forward substitution (15 steps on
   [C/16, 16, 16] tiles: rows of different blocks do not depend on each other);
2. with Li that block-diagonal inverse and A_off the part of A below the diagonal blocks,
   I + A = (I + A_bd)(I + X) with X = Li A_off strictly block-lower, so X^{C/16} = 0 and
   (I + A)^-1 = (I - X)(I + X^2)(I + X^4)... Li: 2 log2(C/16) [C, C] matrix products (four for C = 64).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .triton_utils import mm


@triton.jit
def unit_lower_inverse(A, C: tl.constexpr, PREC: tl.constexpr):
    """(I + A)^-1 in float32 for A [C, C] float32 (only its strictly lower triangle is read), C = 16, 32 or 64
    (at 128 the [128, 128] float32 tiles spill registers, and compiling for a GPU takes minutes)."""
    NB: tl.constexpr = C // 16
    o = tl.arange(0, C)
    A = tl.where(o[:, None] > o[None, :], A, 0.0)
    ob = tl.arange(0, NB)
    r = tl.arange(0, 16)
    same = ob[:, None, None, None] == ob[None, None, :, None]  # [NB, 1, NB, 1]: block row == block column
    Ab = tl.sum(tl.where(same, tl.reshape(A, (NB, 16, NB, 16)), 0.0), axis=2)  # diagonal blocks [NB, 16, 16]
    rows = r[None, :, None]
    Lb = tl.zeros([NB, 16, 16], dtype=tl.float32)  # inverse minus identity, block by block
    for i in range(1, 16):  # row i of every block: L_i = -a_i - sum_{j<i} a_ij L_j
        a_i = tl.sum(tl.where(rows == i, Ab, 0.0), axis=1)  # [NB, 16]
        Lb = tl.where(rows == i, (-a_i - tl.sum(a_i[:, :, None] * Lb, axis=1))[:, None, :], Lb)
    Lb += tl.where(r[:, None] == r[None, :], 1.0, 0.0)[None, :, :]
    Li = tl.reshape(tl.where(same, Lb[:, :, None, :], 0.0), (C, C))
    if NB > 1:  # the factors are polynomials in X: they commute
        X = mm(Li, tl.where(o[:, None] // 16 > o[None, :] // 16, A, 0.0), PREC, False)
        Li = Li - mm(X, Li, PREC, False)
        if NB > 2:
            X = mm(X, X, PREC, False)
            Li = Li + mm(X, Li, PREC, False)
            if NB > 4:
                X = mm(X, X, PREC, False)
                Li = Li + mm(X, Li, PREC, False)
    return Li

