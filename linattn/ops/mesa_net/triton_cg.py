"""Conjugate gradient on (G_t + diag(lamb)) x_t = b_t for every token at once, in Triton.

``chunk_cg_solve``: a whole solve in one launch after the chunk-state scan. G_t = S_t^T for the scan
S_t = exp(g_t) S_{t-1} + k_t w_t^T (w = beta k; S_0 = G_0^T, or G_0 for the backward's transposed system), so with
S_n the state entering token t's chunk and c the log gates cumulated within the chunk,

    G_t p = exp(c_t) S_n^T p + sum_{s <= t in the chunk} exp(c_t - c_s) (p . k_s) w_s,

which needs only the chunk's S_n [K, K], k, w [C, K] and c. A program takes ``cg_rows`` tokens of one chunk of one
batch-head, loads their b, keeps x, r and p in registers and runs all the steps: per step the products
P S_n (decayed by exp(c_t)) and (P K^T * decay * causal) W as two tensor-core dots plus lamb P, then per row

    alpha = r.r / p.Ap,   x += alpha p,   r -= alpha Ap,   beta = r'.r' / r.r,   p = r' + beta p

with cg_solve's freezing rule: a row whose residual reached ||r||^2 <= (32 eps ||b||)^2 takes zero steps from then
on, and a ratio with a denominator below float32's smallest normal number is zero (no 0/0 for b = 0 or masked
rows). Rows past T and columns past K are masked to zero. The chunk states come from simple_gla's state kernel;
the dots use the scan's precision (tf32 for bf16/fp16 inputs, IEEE float32 for float32 ones). Forward only: the
composed backend differentiates the solve implicitly, by a second solve on the transposed system.

``fused_cg_solve``: the per-step form, one launch per CG step of the step's vector updates given the product
y = G_t p from any scan (a step of :func:`linattn.ops.mesa_net.solve.cg_solve` is about fifteen elementwise and
reduction kernels over [B, T, H, K]; here it is one). Both compute cg_solve's iterates up to the order of float32
sums. On CPU tensors the kernels run in Triton's interpreter.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from ..common.registered_ops import define_op
from ..common.triton_launch import fast_launch
from ..common.triton_masking import is_finite
from ..common.triton_utils import block, cdiv, dot_precision, launch_overrides, mm, upcast_dots
from ..simple_gla.triton import simple_gla_triton_states
from .solve import cg_floor

ROWS_PER_PROGRAM = 32  # tokens x heads per program: a [32, K] tile of each of x, r, p, y


@triton.jit
def _cg_update(xt, rt, pt, ap, rr, floor, TINY: tl.constexpr):
    """One CG step per row from the product ap = A p: cg_solve's updates and freezing rule (a row whose squared
    residual is at or below ``floor`` takes zero steps; a ratio whose denominator is below ``TINY`` is zero, so no
    0/0). Returns (x, r, p, r.r) after the step. Both kernels below run their steps through it."""
    active = rr > floor
    pap = tl.sum(pt * ap, axis=1)
    ok = active & (pap > TINY)
    alpha = tl.where(ok, rr / tl.where(ok, pap, 1.0), 0.0)
    xt = xt + alpha[:, None] * pt
    rt = rt - alpha[:, None] * ap
    rr_new = tl.sum(rt * rt, axis=1)
    ok2 = active & (rr_new > floor) & (rr > TINY)
    beta = tl.where(ok2, rr_new / tl.where(ok2, rr, 1.0), 0.0)
    return xt, rt, rt + beta[:, None] * pt, rr_new


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
    xt, rt, pt, rr_new = _cg_update(tl.load(x + at, mask=m, other=0.0), tl.load(r + at, mask=m, other=0.0), pt, ap,
                                    tl.load(rr + rows, mask=m_r, other=0.0),
                                    tl.load(floor + rows, mask=m_r, other=0.0), TINY)
    tl.store(x + at, xt, mask=m)
    tl.store(r + at, rt, mask=m)
    tl.store(p + at, pt, mask=m)
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


# Launch settings of the chunk solve (override through ``linattn.settings(triton_launch={"mesa_net": {...}})``):
# "cg_rows" tokens per program (a power of two; a chunk's tokens split over chunk_size / cg_rows programs when it
# is smaller), "cg_warps" warps per program. x, r and p [rows, K] float32 stay in registers across the steps.
# Compiled for sm_90 (Triton 3.9, tf32 dots, K = 128, chunk 64; bench/triton_resources.py's compile): 32 rows and 8
# warps take 250 registers and no stack (Ampere-style mma); 64 rows, 8 warps use Hopper's warp-group mma but spill
# (800 B of stack), 4 warps more. Timed on an H100 (bf16 inputs, B 4, H 16, K 128, 30 steps, one solve): 32 rows and
# 4 warps 2.82 ms at T 2048 and 20.9 ms at T 16384; 32 rows and 8 warps 3.60 and 26.9; 64 rows 4.20-7.32 and
# 31.6-55.1; 16 rows 3.82-4.71 and 28.3-34.5.
LAUNCH = {"cg_rows": 32, "cg_warps": 4}
launch_overrides("mesa_net", LAUNCH)

# The widest key block the chunk solve takes: its dots stage S_n [K, K], k and w [C, K] float32 in shared memory,
# 224 KB at K = 128 and chunk 128 (an H100 has 227 KB per program); at K = 256 they took 352 KB
MAX_BLOCK_K = 128


def chunk_cg_fits(K: int) -> bool:
    """Whether :func:`chunk_cg_solve` takes head dim K (else the per-step form solves the system)."""
    return block(K) <= MAX_BLOCK_K


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
        xt, rt, pt, rr = _cg_update(xt, rt, pt, ap, rr, floor, TINY)
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


def _chunk_cg_fake(k, w, g, s0, lamb, b, steps, chunk_size, precision=None):
    B, _, H, K = b.shape
    return torch.empty_like(b), b.new_empty(B, H, K, K, dtype=torch.float32)


# chunk_cg_solve as an opaque op for torch.compile graphs (forward only: the composed backend differentiates the
# solve implicitly, by another solve)
_chunk_cg_op = define_op("mesa_net_chunk_cg", chunk_cg_solve, _chunk_cg_fake)
