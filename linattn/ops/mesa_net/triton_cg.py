"""Conjugate gradient on (G_t + diag(lamb)) x_t = b_t for every token at once, one fused Triton kernel per step.

A step of :func:`linattn.ops.mesa_net.solve.cg_solve` is about fifteen elementwise and reduction kernels over
[B, T, H, K]; here it is one, given the product y = G_t p from the scan:

    Ap = y + lamb p,   alpha = r.r / p.Ap,   x += alpha p,   r -= alpha Ap,   beta = r'.r' / r.r,   p = r' + beta p

with cg_solve's freezing rule (a system whose residual reached ||r||^2 <= floor takes zero steps from then on; a
ratio with a denominator below float32's smallest normal number is zero). Forward only: the implicit backward of
the composed backend solves its own system by the same function. On a CPU tensor the kernel runs in Triton's
interpreter.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from ..common.triton_launch import fast_launch
from ..common.triton_utils import block, cdiv
from .solve import cg_floor

ROWS_PER_PROGRAM = 32  # tokens x heads per program: a [32, K] tile of each of x, r, p, y


@fast_launch
@triton.jit(do_not_specialize=["R"])
def _cg_step_kernel(x, r, p, y, lamb, rr, floor, R, H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr,
                    BR: tl.constexpr, TINY: tl.constexpr):
    """Grid (cdiv(R, BR),): one CG step for rows [BR * pid, BR * (pid + 1)) of the [R, K] systems (row = token x
    head, head = row % H); x, r, p and rr [R] updated in place."""
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    cols = tl.arange(0, BK)
    m_r = rows < R
    m = m_r[:, None] & (cols[None, :] < K)
    at = rows[:, None] * K + cols[None, :]
    pt = tl.load(p + at, mask=m, other=0.0)
    lam = tl.load(lamb + (rows % H)[:, None] * K + cols[None, :], mask=m, other=0.0)
    ap = tl.load(y + at, mask=m, other=0.0) + lam * pt
    rr_old = tl.load(rr + rows, mask=m_r, other=0.0)
    fl = tl.load(floor + rows, mask=m_r, other=0.0)
    active = rr_old > fl
    pap = tl.sum(pt * ap, axis=1)
    ok = active & (pap > TINY)
    alpha = tl.where(ok, rr_old / tl.where(ok, pap, 1.0), 0.0)
    xt = tl.load(x + at, mask=m, other=0.0) + alpha[:, None] * pt
    rt = tl.load(r + at, mask=m, other=0.0) - alpha[:, None] * ap
    rr_new = tl.sum(rt * rt, axis=1)
    ok2 = active & (rr_new > fl) & (rr_old > TINY)
    beta = tl.where(ok2, rr_new / tl.where(ok2, rr_old, 1.0), 0.0)
    tl.store(x + at, xt, mask=m)
    tl.store(r + at, rt, mask=m)
    tl.store(p + at, rt + beta[:, None] * pt, mask=m)
    tl.store(rr + rows, rr_new, mask=m_r)


def fused_cg_solve(product: Callable[[torch.Tensor], torch.Tensor], lamb: torch.Tensor, b: torch.Tensor,
                   steps: int) -> torch.Tensor:
    """``steps`` CG steps on (G_t + diag(lamb)) x = b from x = 0, float32 b [B, T, H, K] contiguous, lamb [H, K];
    ``product(p)`` returns G_t p_t for every token. The same iterates as ``cg_solve`` on the product
    p -> product(p) + lamb p, up to the order of float32 sums."""
    B, T, H, K = b.shape
    R = B * T * H
    x = torch.zeros_like(b)
    r = b.clone()
    p = b.clone()
    rr = (b * b).sum(-1).reshape(R).contiguous()
    floor = cg_floor(b).reshape(R).contiguous()
    lamb = lamb.to(b.dtype).contiguous()
    for _ in range(steps):
        y = product(p).contiguous()
        _cg_step_kernel[(cdiv(R, ROWS_PER_PROGRAM),)](
            x=x, r=r, p=p, y=y, lamb=lamb, rr=rr, floor=floor, R=R, H=H, K=K, BK=block(K), BR=ROWS_PER_PROGRAM,
            TINY=torch.finfo(b.dtype).tiny)
    return x
