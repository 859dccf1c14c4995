"""Causal masking by selection inside Triton kernels (see masking.py for the PyTorch side).

A kernel's masked entries are selected with ``tl.where`` (never multiplied by a 0/1 mask), and a product
P @ X of a causal tile P with a tile X whose later rows may hold NaN or inf reads X's finite part, the
non-finite rest added back to the rows that may see it:

    P @ X = P @ X_fin + cumsum_rows(X - X_fin),

so rows before a non-finite row of X are exact and the rows from it on are non-finite. NaN fails every
comparison and inf fails ``|x| < inf``, which is how a tile is tested for finiteness.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def is_finite(x):
    """Elementwise: x is neither NaN nor +-inf."""
    return tl.abs(x.to(tl.float32)) < float("inf")


@triton.jit
def causal_dot_rest(x):
    """For a tile x [C, D] (rows = time): (x's finite part in x's dtype, the cumulative sum over rows of its
    non-finite rest in float32); ``mm(P, finite) + rest`` is P @ x with row i reading rows <= i only."""
    xf = x.to(tl.float32)
    fin = is_finite(xf)
    return tl.where(fin, xf, 0.0).to(x.dtype), tl.cumsum(tl.where(fin, 0.0, xf), axis=0)
