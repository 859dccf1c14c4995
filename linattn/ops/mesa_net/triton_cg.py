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
from ..common.triton_masking import is_finite
from ..common.triton_utils import block, cdiv, dot_precision, launch_overrides, mm, upcast_dots
from ..simple_gla.triton import simple_gla_triton_states
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


# Launch settings of the chunk solve (bench with .carry_probe_mesa.py-style timings on a GPU; override through
# ``linattn.settings(triton_launch={"mesa_net": {...}})``): "cg_rows" tokens per program (a power of two, at most
# the chunk size: fewer rows hold smaller [rows, K] tiles of x, r and p live across the steps, at the cost of more
# programs reading the same chunk state), "cg_warps" warps per program.
LAUNCH = {"cg_rows": 64, "cg_warps": 8}
launch_overrides("mesa_net", LAUNCH)


@fast_launch
@triton.jit(do_not_specialize=["T", "steps"])
def _chunk_cg_kernel(k, w, g, h, lamb, b, x, steps, T, H: tl.constexpr, K: tl.constexpr, C: tl.constexpr,
                     BR: tl.constexpr, BK: tl.constexpr, FLOOR: tl.constexpr, TINY: tl.constexpr,
                     PREC: tl.constexpr, UP: tl.constexpr):
    """Grid (cdiv(T, C) * (C // BR), B*H): ``steps`` CG steps on (G_t + diag(lamb)) x_t = b_t for BR tokens of one
    chunk n, every step's product from the chunk's entering state S = h[b, h, n] [K, K] (G_t = S_t^T) and its keys:

        G_t p = exp(c_t) S^T p + sum_{s <= t in the chunk} exp(c_t - c_s) (p . k_s) w_s

    (c: the log gates cumulated within the chunk). A token's product reads only its own p, so the BR rows of a
    program are independent systems, which all take the same steps (cg_solve's freezing rule per row)."""
    i_r, i_bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    N = tl.cdiv(T, C)
    n = i_r // (C // BR)
    o_k, o_c = tl.arange(0, BK), tl.arange(0, C)
    o_r = (i_r % (C // BR)) * BR + tl.arange(0, BR)  # the program's rows, counted within the chunk
    m_k = o_k < K
    m_c = n * C + o_c < T
    m_r = n * C + o_r < T
    row_c = (i_b * T + n * C + o_c) * H + i_h
    row_r = (i_b * T + n * C + o_r) * H + i_h
    m_rk = m_r[:, None] & m_k[None, :]
    c = tl.cumsum(tl.load(g + row_c, mask=m_c, other=0.0).to(tl.float32), axis=0)
    c_r = tl.sum(tl.where(o_r[:, None] == o_c[None, :], c[None, :], 0.0), axis=1)  # selected: exactly the c_t above
    causal = o_r[:, None] >= o_c[None, :]
    D = tl.where(causal, tl.exp(tl.where(causal, c_r[:, None] - c[None, :], 0.0)), 0.0)  # [t, s]
    decay = tl.exp(c_r)
    # the products weight w_s by p . k_s, so a non-finite w_s reaches rows t >= s only: its finite part enters the
    # dot (a NaN times a zero weight would reach every row) and the rows that may read it become NaN
    m_ck = m_c[:, None] & m_k[None, :]
    wc = tl.load(w + row_c[:, None] * K + o_k[None, :], mask=m_ck, other=0.0)
    bad = tl.sum(tl.where(is_finite(wc), 0.0, 1.0), axis=1)
    poison = tl.where(tl.sum(tl.where(causal, bad[None, :], 0.0), axis=1) > 0, float("nan"), 0.0)
    lam = tl.load(lamb + i_h * K + o_k, mask=m_k, other=0.0).to(tl.float32)
    bt = tl.load(b + row_r[:, None] * K + o_k[None, :], mask=m_rk, other=0.0).to(tl.float32)
    at_S = h + (i_bh * N + n) * K * K + o_k[:, None] * K + o_k[None, :]
    m_kk = m_k[:, None] & m_k[None, :]
    at_kt = k + row_c[None, :] * K + o_k[:, None]
    m_kc = m_k[:, None] & m_c[None, :]
    xt = tl.zeros([BR, BK], dtype=tl.float32)
    rt = bt
    pt = bt
    rr = tl.sum(bt * bt, axis=1)
    floor = rr * FLOOR
    for _ in range(steps):
        # S, k and w are re-read every step (from cache) rather than held in registers across the steps
        S = tl.load(at_S, mask=m_kk, other=0.0)
        kt = tl.load(at_kt, mask=m_kc, other=0.0)
        wc = tl.load(w + row_c[:, None] * K + o_k[None, :], mask=m_ck, other=0.0)
        w_fin = tl.where(is_finite(wc), wc, 0.0)
        A = tl.where(causal, mm(pt, kt, PREC, UP) * D, 0.0)  # selected: a later NaN key must not leak
        ap = mm(pt * decay[:, None], S, PREC, UP) + mm(A, w_fin, PREC, UP)
        ap = ap + poison[:, None] + lam[None, :] * pt
        active = rr > floor
        pap = tl.sum(pt * ap, axis=1)
        ok = active & (pap > TINY)
        alpha = tl.where(ok, rr / tl.where(ok, pap, 1.0), 0.0)
        xt = xt + alpha[:, None] * pt
        rt = rt - alpha[:, None] * ap
        rr_new = tl.sum(rt * rt, axis=1)
        ok2 = active & (rr_new > floor) & (rr > TINY)
        beta = tl.where(ok2, rr_new / tl.where(ok2, rr, 1.0), 0.0)
        pt = rt + beta[:, None] * pt
        rr = rr_new
    tl.store(x + row_r[:, None] * K + o_k[None, :], xt, mask=m_rk)


def chunk_cg_solve(k: torch.Tensor, w: torch.Tensor, g: torch.Tensor, s0: torch.Tensor | None, lamb: torch.Tensor,
                   b: torch.Tensor, steps: int, chunk_size: int, precision: str | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """``steps`` CG steps on (G_t + diag(lamb)) x_t = b_t from x = 0 for every token, G_t = S_t^T with S the scan
    S_t = exp(g_t) S_{t-1} + k_t w_t^T from ``s0``: its chunk states scanned once, then one launch for all the steps.
    float32 k, w, b [B, T, H, K] contiguous, g [B, T, H], s0 [B, H, K, K] or None, lamb [H, K]; ``precision``: the
    dots' (None: IEEE float32). Returns (x, S_T). The same iterates as ``cg_solve`` on p -> G_t p + lamb p, up to
    the order of float32 sums."""
    B, T, H, K = b.shape
    states = simple_gla_triton_states(k, w, g, s0, chunk_size, precision=precision)
    C = states.C
    BR = min(C, LAUNCH["cg_rows"])
    x = torch.empty_like(b)
    _chunk_cg_kernel[(cdiv(T, C) * (C // BR), B * H)](
        k=k, w=w, g=g, h=states.h, lamb=lamb.to(b.dtype).contiguous(), b=b, x=x, steps=steps, T=T, H=H, K=K, C=C,
        BR=BR, BK=block(K), FLOOR=(32 * torch.finfo(b.dtype).eps) ** 2, TINY=torch.finfo(b.dtype).tiny,
        PREC=precision or dot_precision(b.dtype), UP=upcast_dots(b.dtype), num_warps=LAUNCH["cg_warps"])
    return x, states.final


@torch.library.custom_op("linattn::mesa_net_chunk_cg", mutates_args=())
def _chunk_cg_op(k: torch.Tensor, w: torch.Tensor, g: torch.Tensor, s0: torch.Tensor | None, lamb: torch.Tensor,
                 b: torch.Tensor, steps: int, chunk_size: int, precision: str | None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`chunk_cg_solve` as an opaque op for torch.compile graphs (forward only: the composed backend
    differentiates the solve implicitly, by another solve)."""
    return chunk_cg_solve(k, w, g, s0, lamb, b, steps, chunk_size, precision)


@_chunk_cg_op.register_fake
def _(k, w, g, s0, lamb, b, steps, chunk_size, precision):
    B, _, H, K = b.shape
    return torch.empty_like(b), b.new_empty(B, H, K, K, dtype=torch.float32)
