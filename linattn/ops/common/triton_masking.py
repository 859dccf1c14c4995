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


@triton.jit
def finite_part(x):
    """Elementwise: x where finite, else 0 (float32)."""
    xf = x.to(tl.float32)
    return tl.where(is_finite(xf), xf, 0.0)


@triton.jit
def nonfinite_rows(x):
    """For a tile x [C, D]: per row, 1.0 where any entry is NaN or inf, else 0.0."""
    return tl.max(tl.where(is_finite(x), 0.0, 1.0), axis=1)


@triton.jit
def rows_seeing(bad, visible):
    """NaN for each row i of ``visible`` [R, C] (bool: row i reads column s) that reads a column s with bad[s] > 0,
    else 0: added to a product whose operands were read through :func:`finite_part`, it makes exactly the rows
    that read a non-finite input non-finite."""
    return tl.where(tl.max(tl.where(visible, bad[None, :], 0.0), axis=1) > 0, float("nan"), 0.0)
