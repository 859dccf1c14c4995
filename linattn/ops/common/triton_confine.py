"""The confinement guard of softmax attention as two fused kernels (CUDA eager, or the CPU under TRITON_INTERPRET=1).

A fused attention kernel (SDPA's flash kernels) multiplies masked weights by values: 0 x NaN = NaN, so a
non-finite key or value at t would reach earlier queries of its tile. The guard of masking.py runs the kernel on
the finite parts of k and v and sets to NaN the rows that see a non-finite one; in PyTorch that is a dozen
elementwise kernels and reductions around each call. Here it is two kernels forward and one backward:

- :func:`finite_keys_values`: one read of k and v writing their finite parts and, per (b, t, kv head), whether
  the row held a NaN or inf (``bad``);
- :func:`confine_rows`: o with NaN in the rows of queries that see a bad row (causal: a bad key at j <= i,
  counting a cache of Tk - Tq keys before the queries; not causal: any bad key). Its backward is the same kernel
  writing 0 to those rows of the incoming gradient.

The gradient of the finite parts passes through unchanged: for finite inputs that is exactly the gradient of
``where(isfinite(x), x, 0)``; at a non-finite entry itself no gradient is defined (the outputs that read it are
NaN), so it is not zeroed, which spares keeping k and v (or a mask of them) for the backward pass.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_compat import patch_interpreter
from .triton_launch import fast_launch
from .triton_masking import is_finite
from .triton_ops import op_function
from .triton_utils import cdiv, next_power_of_2

patch_interpreter()

ROWS_PER_PROGRAM = 16
QUERIES_PER_PROGRAM = 16
KEYS_PER_STEP = 128


@fast_launch
@triton.jit(do_not_specialize=["R", "T", "H"])
def _finite_rows_kernel(x, x_fin, bad, R, T, H, s_b, s_t, s_h, D: tl.constexpr, ACCUMULATE: tl.constexpr,
                        BR: tl.constexpr, BD: tl.constexpr):
    """Grid (cdiv(R, BR),) over the R = B T H rows of x [B, T, H, D] (strides s_b, s_t, s_h; unit last stride):
    x_fin (contiguous) = x where finite, else 0; bad[row] = the row holds a non-finite entry (or'ed into bad's
    previous value with ACCUMULATE)."""
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    cols = tl.arange(0, BD)
    b, t, h = rows // (T * H), (rows // H) % T, rows % H
    m = (rows < R)[:, None] & (cols < D)[None, :]
    xv = tl.load(x + (b * s_b + t * s_t + h * s_h)[:, None] + cols[None, :], mask=m, other=0.0)
    fin = is_finite(xv)
    tl.store(x_fin + rows[:, None] * D + cols[None, :], tl.where(fin, xv, 0.0).to(x_fin.dtype.element_ty), mask=m)
    row_bad = tl.max(tl.where(fin, 0, 1).to(tl.int8), axis=1)
    if ACCUMULATE:
        row_bad = row_bad | tl.load(bad + rows, mask=rows < R, other=0)
    tl.store(bad + rows, row_bad, mask=rows < R)


@fast_launch
@triton.jit(do_not_specialize=["Tq", "Tk", "Hq", "Hkv"])
def _confine_rows_kernel(o, out, bad, Tq, Tk, Hq, Hkv, o_b, o_t, o_h, out_b, out_t, out_h, fill,
                         D: tl.constexpr, CAUSAL: tl.constexpr, BQ: tl.constexpr, BK: tl.constexpr,
                         BD: tl.constexpr):
    """Grid (cdiv(Tq, BQ), B Hq): out = o with ``fill`` in the rows whose query sees a bad key. Query i sits at
    position Tk - Tq + i; causally it sees keys j <= that position, otherwise all Tk. bad is [B, Tk, Hkv] int8;
    query head h reads kv head h // (Hq // Hkv)."""
    i0 = tl.program_id(0) * BQ
    bh = tl.program_id(1)
    b, h = bh // Hq, bh % Hq
    hk = h // (Hq // Hkv)
    qi = i0 + tl.arange(0, BQ)
    pos = Tk - Tq + qi
    # index of the first bad key (Tk when none) among the keys any query of this block can see
    last = tl.minimum(Tk - Tq + i0 + BQ, Tk) if CAUSAL else Tk
    first_bad = Tk
    for j0 in range(0, last, BK):
        j = j0 + tl.arange(0, BK)
        flag = tl.load(bad + (b.to(tl.int64) * Tk + j) * Hkv + hk, mask=j < last, other=0)
        first_bad = tl.minimum(first_bad, tl.min(tl.where(flag != 0, j, Tk), axis=0))
    seen = (first_bad <= pos) if CAUSAL else (first_bad < Tk) & (qi >= 0)
    cols = tl.arange(0, BD)
    m = (qi < Tq)[:, None] & (cols < D)[None, :]
    src = o + b.to(tl.int64) * o_b + h * o_h + qi.to(tl.int64)[:, None] * o_t + cols[None, :]
    x = tl.load(src, mask=m, other=0.0)
    y = tl.where(seen[:, None], fill, x.to(tl.float32)).to(out.dtype.element_ty)
    dst = out + b.to(tl.int64) * out_b + h * out_h + qi.to(tl.int64)[:, None] * out_t + cols[None, :]
    tl.store(dst, y, mask=m)


def _finite_rows(x: torch.Tensor, bad: torch.Tensor, accumulate: bool) -> torch.Tensor:
    B, T, H, D = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    x_fin = torch.empty((B, T, H, D), dtype=x.dtype, device=x.device)
    R = B * T * H
    _finite_rows_kernel[(cdiv(R, ROWS_PER_PROGRAM),)](
        x=x, x_fin=x_fin, bad=bad, R=R, T=T, H=H, s_b=x.stride(0), s_t=x.stride(1), s_h=x.stride(2), D=D,
        ACCUMULATE=accumulate, BR=ROWS_PER_PROGRAM, BD=next_power_of_2(D))
    return x_fin


def _finite_kv_forward(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    B, T, H = k.shape[:3]
    bad = torch.empty((B, T, H), dtype=torch.int8, device=k.device)
    k_fin = _finite_rows(k, bad, accumulate=False)
    v_fin = _finite_rows(v, bad, accumulate=True)
    return k_fin, v_fin, bad


def _pass_through(ctx, dk, dv, dbad):
    return dk, dv


_finite_kv_differentiable = op_function("_FiniteKeysValues", _finite_kv_forward, None, lambda ctx, inputs, output: None,
                                        _pass_through, non_differentiable=(2,))


def finite_keys_values(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(k's finite part, v's finite part, bad [B, Tk, Hkv] int8: row (b, t, h) of k or v holds a NaN or inf) for
    k [B, Tk, Hkv, K], v [B, Tk, Hkv, V]; differentiable in k and v (module docstring)."""
    return _finite_kv_differentiable(k, v)


def _fill_rows(o: torch.Tensor, bad: torch.Tensor, causal: bool, fill: float) -> torch.Tensor:
    B, Tq, Hq, D = o.shape
    Tk, Hkv = bad.shape[1], bad.shape[2]
    if o.stride(-1) != 1:
        o = o.contiguous()
    out = torch.empty((B, Tq, Hq, D), dtype=o.dtype, device=o.device)
    _confine_rows_kernel[(cdiv(Tq, QUERIES_PER_PROGRAM), B * Hq)](
        o=o, out=out, bad=bad, Tq=Tq, Tk=Tk, Hq=Hq, Hkv=Hkv, o_b=o.stride(0), o_t=o.stride(1), o_h=o.stride(2),
        out_b=out.stride(0), out_t=out.stride(1), out_h=out.stride(2), fill=fill, D=D, CAUSAL=causal,
        BQ=QUERIES_PER_PROGRAM, BK=KEYS_PER_STEP, BD=next_power_of_2(D))
    return out


class _ConfineRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, o: torch.Tensor, bad: torch.Tensor, causal: bool) -> torch.Tensor:
        ctx.save_for_backward(bad)
        ctx.causal = causal
        return _fill_rows(o, bad, causal, float("nan"))

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        (bad,) = ctx.saved_tensors
        return _fill_rows(dout, bad, ctx.causal, 0.0), None, None


def confine_rows(o: torch.Tensor, bad: torch.Tensor, *, causal: bool = True) -> torch.Tensor:
    """o [B, Tq, Hq, D] with NaN in the rows whose query sees a bad key (``bad`` [B, Tk, Hkv] from
    :func:`finite_keys_values`); gradients of those rows are 0 (module docstring)."""
    return _ConfineRows.apply(o, bad, causal)
