"""titans' in-mini-batch gate coefficients as two Triton kernels (forward and backward), in place of the ~60 small
PyTorch operations of :func:`titans_gate_coefficients` (the reference, below).

Per mini-batch of b tokens with a = 1 - alpha, the coefficients of the module docstring of chunk.py follow one row
recurrence (row r = token r of the mini-batch, columns s; c_{-1} = e_{-1} = 0, A_{-1} = E_{-1} = 1, d_{-1} = 0):

    e_r = eta_r e_{r-1} (s < r), e_rr = 1;      c_r = a_r c_{r-1} + e_r;
    A_r = a_r A_{r-1};   E_r = eta_r E_{r-1};   d_r = a_r d_{r-1} + E_r,

which is the unrolled S_t = eta_t S_{t-1} + w_t, M_t = a_t M_{t-1} + S_t, so every product of gates is formed by
multiplication alone: gates 0 and 1 stay exact, as in the reference. Outputs: G_rs = theta_s c_rs (s <= r, else 0),
cv = (A_r, d_r, theta_s c_xs, theta_s e_xs), cx = (A_x, d_x, E_x), x the mini-batch's exit row (its last token; the
sequence's last for the last mini-batch). The backward is the adjoint of the same recurrence, rows in reverse:

    g_c += dc_r (direct);  da_r = <c_{r-1}, g_c> + d_{r-1} g_d + A_{r-1} g_A;  g_e += g_c;  g_c <- a_r g_c;
    g_E += g_d;  g_d <- a_r g_d;  g_A <- a_r g_A;  deta_r = <e_{r-1}, g_e>_{s != r} + E_{r-1} g_E;
    g_e <- eta_r g_e (s != r, 0 at s = r);  g_E <- eta_r g_E;      dalpha_r = -da_r,

with the rows recomputed in registers (b x b floats), so nothing but the gate gradients is written. A program per
(batch-head, mini-batch); gates past the sequence's end read as 0 (theta, alpha, eta), as the reference pads them.
Checked against autograd of the reference (tests/ops/test_triton_titans.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common.registered_ops import define_op
from ..common.state_scan import chunks_heads_first
from ..common.triton_launch import fast_launch
from ..common.triton_ops import eager_backward, op_function
from ..common.triton_utils import cdiv
from .chunk import _coefficients


def titans_gate_coefficients(theta: torch.Tensor, alpha: torch.Tensor, eta: torch.Tensor, b: int
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The in-mini-batch coefficients of titans (chunk.py's docstring with chunks of one mini-batch), from gates
    [B, T, H] (differentiable; products taken directly, so gates at 0 and 1 are exact), in float32:

    G [B, H, N, b, b] = theta_s c_rs (0 above the diagonal);  cv [B, H, N, 4, b] = (A_r, d_r, theta_s c_xs,
    theta_s e_xs);  cx [B, H, N, 3] = (A_x, d_x, E_x), where x is the mini-batch's exit row: its last token, the
    sequence's last token for the last mini-batch (the end of the sequence closes it; padding never enters)."""
    T = theta.shape[1]
    th, al, et = (chunks_heads_first(x.float(), b) for x in (theta, alpha, eta))  # [B, H, N, b], zero-padded
    N = th.shape[2]
    c, A, d, e, E = _coefficients(al, et, b, th)
    causal = torch.ones(b, b, dtype=torch.bool, device=th.device).tril()
    G = (th[..., None, :] * c).masked_fill(~causal, 0.0)  # selected, so a non-finite theta_s stays in rows >= s
    x = torch.full((N,), b - 1, dtype=torch.long, device=th.device)
    x[-1] = (T - 1) - (N - 1) * b
    n = torch.arange(N, device=th.device)
    cv = torch.stack([A, d, th * c[..., n, x, :], th * e[..., n, x, :]], dim=-2)
    cx = torch.stack([A[..., n, x], d[..., n, x], E[..., n, x]], dim=-1)
    return G.contiguous(), cv.contiguous(), cx.contiguous()


@triton.jit
def _mini_batch(theta, alpha, eta, T, N, H: tl.constexpr, BT: tl.constexpr):
    """This program's mini-batch (grid (B*H, mini-batches)): theta, a = 1 - alpha and eta as float32 vectors (0, 1, 0
    past the sequence's end), the token offsets, the exit row x, the mini-batch's index among all (batch-head
    major), its tokens' rows into [B, T, H] and which of them lie inside the sequence."""
    i_bh = tl.program_id(0).to(tl.int64)
    m = tl.program_id(1).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    o = tl.arange(0, BT)
    t0 = m * BT
    inside = t0 + o < T
    ptr = (i_b * T + t0 + o) * H + i_h
    th = tl.load(theta + ptr, mask=inside, other=0.0).to(tl.float32)
    a = 1.0 - tl.load(alpha + ptr, mask=inside, other=0.0).to(tl.float32)
    n = tl.load(eta + ptr, mask=inside, other=0.0).to(tl.float32)
    return th, a, n, o, tl.minimum(BT - 1, T - 1 - t0), i_bh * N + m, ptr, inside


@triton.jit
def coefficient_loads(G, cv, cx, cb, o, BT: tl.constexpr):
    """Mini-batch ``cb``'s G [BT, BT], the four rows of cv and the three values of cx (or of their gradients), from
    the layouts G [.., BT, BT], cv [.., 4, BT], cx [.., 3] (``o``: arange(BT))."""
    Gm = tl.load(G + cb * BT * BT + o[:, None] * BT + o[None, :])
    rows = cv + cb * 4 * BT + o
    return (Gm, tl.load(rows), tl.load(rows + BT), tl.load(rows + 2 * BT), tl.load(rows + 3 * BT), tl.load(cx + cb * 3),
            tl.load(cx + cb * 3 + 1), tl.load(cx + cb * 3 + 2))


@triton.jit
def _pick(v, o, r):
    """v[r] as a scalar (0 when r is out of range)."""
    return tl.sum(tl.where(o == r, v, 0.0), axis=0)


@triton.jit
def _first_row(BT: tl.constexpr):
    """(c, e, A, E, d) before row 0: zeros, and A = E = 1."""
    e = tl.zeros([BT], dtype=tl.float32)
    one = tl.sum(e, axis=0) + 1.0
    return e, e, one, one, one - 1.0


@triton.jit
def _next_row(c, e, A, E, d, a, n, o, r):
    """(c, e, A, E, d) of row r from those of row r - 1."""
    a_r = _pick(a, o, r)
    n_r = _pick(n, o, r)
    e = tl.where(o == r, 1.0, n_r * e)
    A = a_r * A
    E = n_r * E
    return a_r * c + e, e, A, E, a_r * d + E


@fast_launch
@triton.jit(do_not_specialize=["T", "N"])
def _coef_fwd_kernel(theta, alpha, eta, G, cv, cx, T, N, H: tl.constexpr, BT: tl.constexpr):
    """Grid (B*H, mini-batches): G [B*H*N, BT, BT], cv [B*H*N, 4, BT], cx [B*H*N, 3] of one mini-batch."""
    th, a, n, o, x, cb, ptr, inside = _mini_batch(theta, alpha, eta, T, N, H, BT)
    c, e, A, E, d = _first_row(BT)
    A_row = tl.zeros([BT], dtype=tl.float32)
    d_row = tl.zeros([BT], dtype=tl.float32)
    for r in tl.static_range(BT):
        c, e, A, E, d = _next_row(c, e, A, E, d, a, n, o, r)
        tl.store(G + (cb * BT + r) * BT + o, tl.where(o <= r, th * c, 0.0))
        A_row = tl.where(o == r, A, A_row)
        d_row = tl.where(o == r, d, d_row)
        at_exit = o * 0 + x == r  # (a vector: the interpreter takes no scalar mask for a vector store)
        tl.store(cv + (cb * 4 + 2) * BT + o, th * c, mask=at_exit)
        tl.store(cv + (cb * 4 + 3) * BT + o, th * e, mask=at_exit)
        if x == r:
            tl.store(cx + cb * 3, A)
            tl.store(cx + cb * 3 + 1, d)
            tl.store(cx + cb * 3 + 2, E)
    tl.store(cv + (cb * 4 + 0) * BT + o, A_row)
    tl.store(cv + (cb * 4 + 1) * BT + o, d_row)


@fast_launch
@triton.jit(do_not_specialize=["T", "N"])
def _coef_bwd_kernel(theta, alpha, eta, dG, dcv, dcx, dtheta, dalpha, deta, T, N, H: tl.constexpr,
                     BT: tl.constexpr):
    """Grid (B*H, mini-batches): the gate gradients of one mini-batch from those of G, cv and cx."""
    th, a, n, o, x, cb, ptr, inside = _mini_batch(theta, alpha, eta, T, N, H, BT)
    # the rows of the forward recurrence, kept in registers: C, Em [r, s]; A, E, d per row
    c, e, A, E, d = _first_row(BT)
    Cm = tl.zeros([BT, BT], dtype=tl.float32)
    Em = tl.zeros([BT, BT], dtype=tl.float32)
    A_row = tl.zeros([BT], dtype=tl.float32)
    E_row = tl.zeros([BT], dtype=tl.float32)
    d_row = tl.zeros([BT], dtype=tl.float32)
    for r in tl.static_range(BT):
        c, e, A, E, d = _next_row(c, e, A, E, d, a, n, o, r)
        Cm = tl.where(o[:, None] == r, c[None, :], Cm)
        Em = tl.where(o[:, None] == r, e[None, :], Em)
        A_row = tl.where(o == r, A, A_row)
        E_row = tl.where(o == r, E, E_row)
        d_row = tl.where(o == r, d, d_row)
    dGm, dA_row, dd_row, dcM, deM, dAx, ddx, dEx = coefficient_loads(dG, dcv, dcx, cb, o, BT)
    gc = tl.zeros([BT], dtype=tl.float32)
    ge = tl.zeros([BT], dtype=tl.float32)
    dth = tl.zeros([BT], dtype=tl.float32)
    da_row = tl.zeros([BT], dtype=tl.float32)
    dn_row = tl.zeros([BT], dtype=tl.float32)
    gA = tl.sum(gc, axis=0)
    gE = gA
    gd = gA
    for i in tl.static_range(BT):
        r = BT - 1 - i
        at_exit = x == r
        a_r = _pick(a, o, r)
        n_r = _pick(n, o, r)
        c_r = tl.sum(tl.where(o[:, None] == r, Cm, 0.0), axis=0)
        e_r = tl.sum(tl.where(o[:, None] == r, Em, 0.0), axis=0)
        dG_r = tl.sum(tl.where(o[:, None] == r, dGm, 0.0), axis=0)
        below = o <= r
        gc += tl.where(below, th * dG_r, 0.0) + tl.where(at_exit, th * dcM, 0.0)
        ge += tl.where(at_exit, th * deM, 0.0)
        dth += tl.where(below, c_r * dG_r, 0.0) + tl.where(at_exit, c_r * dcM + e_r * deM, 0.0)
        gA += _pick(dA_row, o, r) + tl.where(at_exit, dAx, 0.0)
        gd += _pick(dd_row, o, r) + tl.where(at_exit, ddx, 0.0)
        gE += tl.where(at_exit, dEx, 0.0)
        if r == 0:
            c_prev = tl.zeros([BT], dtype=tl.float32)
            e_prev = c_prev
            A_prev = tl.sum(c_prev, axis=0) + 1.0
            E_prev = A_prev
            d_prev = A_prev - 1.0
        else:
            c_prev = tl.sum(tl.where(o[:, None] == r - 1, Cm, 0.0), axis=0)
            e_prev = tl.sum(tl.where(o[:, None] == r - 1, Em, 0.0), axis=0)
            A_prev = _pick(A_row, o, r - 1)
            E_prev = _pick(E_row, o, r - 1)
            d_prev = _pick(d_row, o, r - 1)
        da = tl.sum(c_prev * gc, axis=0) + d_prev * gd + A_prev * gA
        ge += gc
        gc = a_r * gc
        gE += gd
        gd = a_r * gd
        gA = a_r * gA
        dn = tl.sum(tl.where(o != r, e_prev * ge, 0.0), axis=0) + E_prev * gE
        ge = tl.where(o != r, n_r * ge, 0.0)
        gE = n_r * gE
        da_row = tl.where(o == r, da, da_row)
        dn_row = tl.where(o == r, dn, dn_row)
    tl.store(dtheta + ptr, dth.to(dtheta.dtype.element_ty), mask=inside)
    tl.store(dalpha + ptr, (-da_row).to(dalpha.dtype.element_ty), mask=inside)
    tl.store(deta + ptr, dn_row.to(deta.dtype.element_ty), mask=inside)


def _shapes(theta: torch.Tensor, b: int) -> tuple[int, int, int, int]:
    B, T, H = theta.shape
    return B, T, H, cdiv(T, b)


def _coef_fwd_impl(theta: torch.Tensor, alpha: torch.Tensor, eta: torch.Tensor, b: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    B, T, H, N = _shapes(theta, b)
    f32 = dict(device=theta.device, dtype=torch.float32)
    G, cv, cx = torch.empty(B, H, N, b, b, **f32), torch.empty(B, H, N, 4, b, **f32), torch.empty(B, H, N, 3, **f32)
    _coef_fwd_kernel[(B * H, N)](theta=theta, alpha=alpha, eta=eta, G=G, cv=cv, cx=cx, T=T, N=N, H=H, BT=b,
                                 num_warps=1)
    return G, cv, cx


def _coef_fwd_fake(theta, alpha, eta, b):
    B, T, H, N = _shapes(theta, b)
    return (theta.new_empty(B, H, N, b, b, dtype=torch.float32), theta.new_empty(B, H, N, 4, b, dtype=torch.float32),
            theta.new_empty(B, H, N, 3, dtype=torch.float32))


def _coef_bwd_impl(theta: torch.Tensor, alpha: torch.Tensor, eta: torch.Tensor, b: int, dG: torch.Tensor,
                   dcv: torch.Tensor, dcx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    B, T, H, N = _shapes(theta, b)
    dtheta, dalpha, deta = torch.empty_like(theta), torch.empty_like(alpha), torch.empty_like(eta)
    _coef_bwd_kernel[(B * H, N)](theta=theta, alpha=alpha, eta=eta, dG=dG, dcv=dcv, dcx=dcx, dtheta=dtheta,
                                 dalpha=dalpha, deta=deta, T=T, N=N, H=H, BT=b, num_warps=1)
    return dtheta, dalpha, deta


def _coef_bwd_fake(theta, alpha, eta, b, dG, dcv, dcx):
    return torch.empty_like(theta), torch.empty_like(alpha), torch.empty_like(eta)


_coef_fwd_op = define_op("titans_coefficients_fwd", _coef_fwd_impl, _coef_fwd_fake)
_coef_bwd_op = define_op("titans_coefficients_bwd", _coef_bwd_impl, _coef_bwd_fake)


def _setup_context(ctx, inputs, output):
    theta, alpha, eta, b = inputs
    ctx.save_for_backward(theta, alpha, eta)
    ctx.b = b


def _backward(ctx, dG, dcv, dcx):
    theta, alpha, eta = ctx.saved_tensors
    run = _coef_bwd_impl if eager_backward(ctx) else _coef_bwd_op
    B, T, H, N = _shapes(theta, ctx.b)
    zeros = {"dG": (B, H, N, ctx.b, ctx.b), "dcv": (B, H, N, 4, ctx.b), "dcx": (B, H, N, 3)}
    grads = [torch.zeros(zeros[name], device=theta.device, dtype=torch.float32) if g is None else g.contiguous()
             for name, g in (("dG", dG), ("dcv", dcv), ("dcx", dcx))]
    return (*run(theta, alpha, eta, ctx.b, *grads), None)


_differentiable = op_function("titans_coefficients_function", _coef_fwd_impl, _coef_fwd_op, _setup_context,
                            _backward)


def titans_coefficients_triton(theta: torch.Tensor, alpha: torch.Tensor, eta: torch.Tensor, b: int
                               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(G [B, H, N, b, b], cv [B, H, N, 4, b], cx [B, H, N, 3]) float32, differentiable in the gates [B, T, H]: the
    values of :func:`titans_gate_coefficients`, from one kernel each way."""
    return _differentiable(*(x.contiguous() for x in (theta, alpha, eta)), b)
