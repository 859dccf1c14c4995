"""Conjugate gradient on (G_t + diag(lamb)) x_t = b_t for every token at once, in Triton.

``_chunk_cg_kernel``: a whole solve in one launch, given the chunk-entry states of the scan
S_t = exp(g_t) S_{t-1} + beta_t k_t k_t^T: G_t = S_t^T for S_0 = G_0^T (or G_t = S_t, the backward's transposed
system, reading the same states transposed), so with S_n the state entering token t's chunk and c the log gates
cumulated within the chunk,

    G_t p = exp(c_t) S_n^T p + sum_{s <= t in the chunk} exp(c_t - c_s) (p . k_s) w_s,

(w = beta k), which needs only the chunk's S_n [K, K], k [C, K], beta and c. A program takes ``cg_rows`` tokens of one
chunk of one batch-head, loads their b, keeps x, r and p in registers (S_n, the keys and w in shared memory) and runs
all the steps: per step the products P S_n (rows scaled by exp(c_t)) and (P K^T * decay * causal) W as two tensor-core
dots plus lamb P, then per row

    alpha = r.r / p.Ap,   x += alpha p,   r -= alpha Ap,   beta = r'.r' / r.r,   p = r' + beta p

with cg_solve's freezing rule: a row whose residual reached ||r||^2 <= (32 eps ||b||)^2 takes zero steps from then
on, and a ratio with a denominator below float32's smallest normal number is zero (no 0/0 for b = 0 or masked
rows). Rows past T and columns past K are masked to zero. The dots use the scan's precision (tf32 for bf16/fp16
inputs, IEEE float32 for float32 ones). Its caller, mesa_net's own path (triton_fused.py), passes the inputs as they
are, w = beta k formed in the kernel, the query scale folded into the load of b, and the chunk states of its own
scan kernel. Forward only: the solve is differentiated implicitly, by a second solve on the transposed system.

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

from ..common.triton_launch import fast_launch
from ..common.triton_masking import finite_part, is_finite, nonfinite_rows, rows_seeing
from ..common.triton_utils import block, cdiv, dot_precision, launch_choice, launch_overrides, mm
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


# Launch settings of mesa_net's kernels (override through ``linattn.settings(triton_launch={"mesa_net": {...}})``;
# one dict for the family: this module's chunk solve and triton_fused.py's kernels).
# The chunk solve: "cg_rows" tokens per program (a power of two; a chunk's tokens split over chunk_size / cg_rows
# programs when it is smaller), "cg_warps" warps. x, r and p [rows, K] float32 stay in registers across the steps; the
# chunk's state S_n and keys are loop-invariant, and the compiler loads them once, into shared memory, before the
# steps (Triton 3.9, sm_90, K = 128, chunk 64, 32 rows, 4 warps, bf16 keys: 152 KB of shared memory, so one program
# per SM; 242-255 registers, no spills; per step and warp 256 tensor-core instructions in about 1,500). Timed on an
# H100 when each step also read w = beta k from float32 copies of the inputs (bf16 inputs, B 4,
# H 16, K 128, 30 steps, one solve): 32 rows and 4 warps 2.82 ms at T 2048 and 20.9 ms at T 16384; 32 rows and 8
# warps 3.60 and 26.9; 64 rows 4.20-7.32 and 31.6-55.1; 16 rows 3.82-4.71 and 28.3-34.5.
# triton_fused.py's kernels, "<kernel>_BV" (value block), "<kernel>_warps", "<kernel>_stages": "scan" the forward
# state scans (G's and H's in one launch), "out" the read-out o_t = H_t^T x_t, "bscan" the reverse scans of the state
# gradients, "grads" the per-chunk gradients of the read-out ("grads_BK": a block of k's columns), "kk" those
# through the solve (BV: a block of k's columns); "chunk": the largest chunk they take (a larger chunk_size runs in
# chunks of this many tokens: the same sums in another order; 32 halves the solve's key tiles and doubles the
# states' size).
# "cg_dots": for bf16 inputs the solve's products take operands rounded to bf16 ("input", the default: p, S, w and
# the decayed scores rounded at each product, as FLA's chunk_mesa_net multiplies; twice the tensor-core rate and half
# the shared memory for S and the keys) or float32 operands at the scan's precision ("tf32"). float32 inputs always
# take IEEE float32 dots, fp16 inputs tf32 ones: the state S can exceed fp16's range where it does not exceed bf16's.
# Emulated on the CPU (bf16 inputs, K = 128, T = 1024, float64 exact solve as reference): the solution's relative
# error 1.5e-5 (tf32) and 1.2e-4 ("input") with lamb = 1 and decays in [-0.5, 0); 1.7e-4 and 1.35e-3 with
# lamb = 0.25 and g = -0.01; bf16's unit roundoff is 3.9e-3. On an H200 (bf16, K = V = 128, 30 CG steps, against
# the float32 chunk backend with the same solve) the op's output and every gradient are as far from the reference
# either way (relative RMS 1.8e-3 with tf32, 2.0e-3 with "input", FLA 2.6e-3; the gates' gradient at T = 16384 was
# 3.2e-2 and 2.8e-2 against FLA's 2.2e-3, when triton_fused.py still summed it over the whole sequence), and the
# solve takes 17.2 ms instead of 43.3 (B 4, T 16384, H 16), the op's forward and backward 31.4 ms instead of 57.8
# (FLA 43.9 in the tf32 run's process; the "input" run was a second process on the same GPU).
# The values of triton_fused.py's kernels are the per-kernel best of ``python -m linattn.bench.triton_tune --family
# mesa_net`` on an H200 (bf16, B 4, T 16384, H 16, K = V = 128): state scans 2.38 -> 2.15 ms, read-out 2.45 -> 1.59,
# reverse scans 1.90 -> 1.48, read-out gradients 5.93 -> 3.74; the op's forward+backward 61.5 -> 57.9 ms (one process).
# The solve's 32 rows and 4 warps stayed best (43.6 ms for both solves; 64 rows 44.5-44.9, 16 rows 53.8-72.1).
CG_DOTS = ("tf32", "input")
LAUNCH = {"cg_rows": 32, "cg_warps": 4, "cg_dots": "input", "scan_BV": 32, "scan_warps": 2, "scan_stages": 2,
          "out_BV": 64, "out_warps": 4, "out_stages": 3, "bscan_BV": 32, "bscan_warps": 4, "bscan_stages": 2,
          "grads_BV": 32, "grads_BK": 32, "grads_warps": 4, "grads_stages": 2, "kk_BV": 32, "kk_warps": 8,
          "kk_stages": 1, "chunk": 64}
launch_overrides("mesa_net", LAUNCH)

# The widest key block the chunk solve takes: its dots stage S_n [K, K] and the keys [C, K] float32 in shared memory
# (at K = 256 they took 352 KB; an H100 has 227 KB per program)
MAX_BLOCK_K = 128


def chunk_cg_fits(K: int) -> bool:
    """Whether the one-launch solve (and so the fused path, triton_fused.py) takes head dim K (else mesa_net's
    composed path solves the system step by step)."""
    return block(K) <= MAX_BLOCK_K


@fast_launch
@triton.jit(do_not_specialize=["T", "steps"])
def _chunk_cg_kernel(k, beta, g, h, lamb, b, x, scale, steps, T, H: tl.constexpr, K: tl.constexpr,
                     C: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr, TRANS: tl.constexpr,
                     NAN_B: tl.constexpr, FLOOR: tl.constexpr, TINY: tl.constexpr, PREC: tl.constexpr,
                     UP: tl.constexpr, LOW: tl.constexpr):
    """Grid (cdiv(T, C) * (C // BR), B*H): ``steps`` CG steps on (G_t + diag(lamb)) x_t = scale b_t for BR tokens of
    one chunk n, every step's product from the chunk's entering state S = h[b, h, n] [K, K] (G_t = S_t^T; TRANS:
    G_t = S_t, S read transposed) and its keys:

        G_t p = exp(c_t) S^T p + sum_{s <= t in the chunk} exp(c_t - c_s) (p . k_s) w_s

    (c: the log gates cumulated within the chunk), w_s = beta_s k_s made in the kernel from k and beta. A token's
    product reads only its own p, so the BR rows of a program are independent systems, which all take the same steps
    (cg_solve's freezing rule per row). NAN_B: a row whose b is not finite is NaN in x (CG's zero steps would hide it).
    LOW: the products' operands (p, S, the keys, w and the decayed scores) rounded to k's dtype (bf16), as FLA's
    chunk_mesa_net multiplies; else float32 operands at PREC. Inputs in any float dtype, computed in float32 (the
    products accumulate in float32 either way); x float32."""
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
    m_ck = m_c[:, None] & m_k[None, :]
    c = tl.cumsum(tl.load(g + row_c, mask=m_c, other=0.0).to(tl.float32), axis=0)
    c_r = tl.sum(tl.where(o_r[:, None] == o_c[None, :], c[None, :], 0.0), axis=1)  # selected: exactly the c_t above
    causal = o_r[:, None] >= o_c[None, :]
    D = tl.where(causal, tl.exp(tl.where(causal, c_r[:, None] - c[None, :], 0.0)), 0.0)  # [t, s]
    decay = tl.exp(c_r)
    # a non-finite key (or beta_s) reaches rows t >= s only: the dots read the finite parts (a NaN times a
    # zero weight would reach every row) and the rows that may read it are made NaN
    kc = tl.load(k + row_c[:, None] * K + o_k[None, :], mask=m_ck, other=0.0)
    bad = nonfinite_rows(kc)
    # times the rows' 0/1 mask (a runtime vector): with only constants in the chain from the load, the compiler keeps
    # bf16 keys in shared memory and converts them to float32 at every step (Triton 3.9: 400 more instructions a
    # step); this way the float32 keys are made once
    kc = finite_part(kc) * m_c.to(tl.float32)[:, None]
    bet = tl.load(beta + row_c, mask=m_c, other=0.0).to(tl.float32)
    bad = tl.maximum(bad, tl.where(is_finite(bet), 0.0, 1.0))
    wc = kc * finite_part(bet)[:, None]  # w = beta k
    poison = rows_seeing(bad, causal)
    lam = tl.load(lamb + i_h * K + o_k, mask=m_k, other=0.0).to(tl.float32)
    bt = tl.load(b + row_r[:, None] * K + o_k[None, :], mask=m_rk, other=0.0).to(tl.float32) * scale
    if TRANS:
        at_S = h + (i_bh * N + n) * K * K + o_k[None, :] * K + o_k[:, None]
    else:
        at_S = h + (i_bh * N + n) * K * K + o_k[:, None] * K + o_k[None, :]
    S = tl.load(at_S, mask=m_k[:, None] & m_k[None, :], other=0.0).to(tl.float32)
    # the products' operand dtype: with LOW, k's (bf16: the keys are exact in it; S and w are rounded once,
    # p and the scores at every step)
    DT: tl.constexpr = k.dtype.element_ty if LOW else tl.float32
    kd, wd, Sd = kc.to(DT), wc.to(DT), S.to(DT)
    xt = tl.zeros([BR, BK], dtype=tl.float32)
    rt = bt
    pt = bt
    rr = tl.sum(bt * bt, axis=1)
    floor = rr * FLOOR
    if NAN_B:
        nan_b = tl.where(nonfinite_rows(bt) > 0, float("nan"), 0.0)
    # S, the keys and w are loop-invariant: the compiler keeps them in shared memory across the steps
    for _ in range(steps):
        # D is 0 above the diagonal and the keys are finite: a non-finite entry of A can only come from p's own row
        pd = pt.to(DT)
        A = mm(pd, tl.trans(kd), PREC, UP) * D
        ap = mm(pd, Sd, PREC, UP) * decay[:, None] + mm(A.to(DT), wd, PREC, UP)  # exp(c_t) S^T p: rows scaled after
        ap = ap + poison[:, None] + lam[None, :] * pt
        xt, rt, pt, rr = _cg_update(xt, rt, pt, ap, rr, floor, TINY)
    if NAN_B:
        xt = xt + nan_b[:, None]
    tl.store(x + row_r[:, None] * K + o_k[None, :], xt, mask=m_rk)


def cg_launch(dtype: torch.dtype, C: int, precision: str | None, keys: torch.dtype) -> dict:
    """The chunk solve's dtype-dependent constants and launch options (rows per program, warps, the products'
    operands: LOW for bf16 keys when ``cg_dots`` is "input"). ``dtype``: the CG vectors'."""
    low = launch_choice(LAUNCH, "mesa_net", "cg_dots", CG_DOTS) == "input" and keys == torch.bfloat16
    return dict(BR=min(C, LAUNCH["cg_rows"]), FLOOR=(32 * torch.finfo(dtype).eps) ** 2, TINY=torch.finfo(dtype).tiny,
                PREC=precision or dot_precision(dtype), LOW=low, num_warps=LAUNCH["cg_warps"])
