"""Fused Triton kernels for the per-head normalisations around a mixer (CUDA, or the CPU under TRITON_INTERPRET=1).

Row-wise over the last dim (a head's K or V channels), arithmetic in float32 for every input dtype:

- L2 normalisation of q and k (delta rules):  y = x / max(||x||, eps)   (``F.normalize``); q and k together in
  one launch each way (:func:`l2norm_pair_triton`).
  Backward, r = 1 / max(||x||, eps):  dx = r dy - [||x|| > eps] r y (dy . y), from y and r alone, so the
  backward keeps the output (which the op after the norm keeps anyway) rather than a second tensor.
- Output RMSNorm with an optional SiLU gate:  n = o rsqrt(mean(o^2) + eps) ⊙ w,  y = n ⊙ SiLU(gate).
  Backward, ô = o rstd, dn = dy ⊙ SiLU(gate):  dgate = dy ⊙ n ⊙ SiLU'(gate),  dw = sum_rows dn ⊙ ô,
  do = rstd (dn ⊙ w - ô mean(dn ⊙ w ⊙ ô)).

In PyTorch each is a chain of elementwise kernels over float32 copies (under autocast, RMSNorm runs in float32):
about ten passes over the tensor forward and backward instead of one read and one write each. Each kernel keeps
the per-row reciprocal norm for its backward. Like the ops' kernels, they are custom ops with fake kernels under
torch.compile and plain autograd Functions eagerly (less host time).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..ops.common.registered_ops import define_op
from ..ops.common.triton_compat import patch_interpreter
from ..ops.common.triton_launch import fast_launch
from ..ops.common.triton_ops import eager_backward, op_function
from ..ops.common.triton_utils import cdiv, next_power_of_2

patch_interpreter()

ROWS_PER_PROGRAM = 16


@fast_launch
@triton.jit(do_not_specialize=["R"])
def _l2norm_fwd_kernel(x1, x2, y1, y2, r1, r2, R, D: tl.constexpr, eps, BR: tl.constexpr, BD: tl.constexpr):
    """Grid (cdiv(R, BR), n): y = x / max(||x||, eps) for BR rows of x1 (program_id(1) == 0) or of x2 (n = 2, same
    shape), r = 1 / max(||x||, eps) (float32); n = 1 for one tensor."""
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    cols = tl.arange(0, BD)
    m = (rows < R)[:, None] & (cols < D)[None, :]
    offs = rows[:, None] * D + cols[None, :]
    if tl.program_id(1) == 0:
        x, y, r = x1, y1, r1
    else:
        x, y, r = x2, y2, r2
    xv = tl.load(x + offs, mask=m, other=0.0).to(tl.float32)
    inv = 1.0 / tl.maximum(tl.sqrt(tl.sum(xv * xv, axis=1)), eps)
    tl.store(y + offs, (xv * inv[:, None]).to(y.dtype.element_ty), mask=m)
    tl.store(r + rows, inv, mask=rows < R)


@fast_launch
@triton.jit(do_not_specialize=["R"])
def _l2norm_bwd_kernel(y1, y2, r1, r2, dy1, dy2, dx1, dx2, R, D: tl.constexpr, eps, BR: tl.constexpr,
                       BD: tl.constexpr):
    """Grid (cdiv(R, BR), n): dx = r dy - [||x|| > eps] r y (dy . y), from the forward's output y and r, for the
    first tensor (program_id(1) == 0) or the second (n = 2); n = 1 for one tensor."""
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    cols = tl.arange(0, BD)
    m = (rows < R)[:, None] & (cols < D)[None, :]
    offs = rows[:, None] * D + cols[None, :]
    if tl.program_id(1) == 0:
        y, r, dy, dx = y1, r1, dy1, dx1
    else:
        y, r, dy, dx = y2, r2, dy2, dx2
    yv = tl.load(y + offs, mask=m, other=0.0).to(tl.float32)
    g = tl.load(dy + offs, mask=m, other=0.0).to(tl.float32)
    inv = tl.load(r + rows, mask=rows < R, other=1.0)
    through_norm = tl.where(inv < 1.0 / eps, tl.sum(g * yv, axis=1), 0.0)  # the norm is clamped below eps
    tl.store(dx + offs, (inv[:, None] * (g - yv * through_norm[:, None])).to(dx.dtype.element_ty), mask=m)


@fast_launch
@triton.jit(do_not_specialize=["R"])
def _rms_gate_fwd_kernel(o, w, gate, y, rstd, R, D: tl.constexpr, eps, HAS_GATE: tl.constexpr, BR: tl.constexpr,
                         BD: tl.constexpr):
    """Grid (cdiv(R, BR),): y = o rsqrt(mean(o^2) + eps) ⊙ w (⊙ SiLU(gate)); rstd per row (float32)."""
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    cols = tl.arange(0, BD)
    m = (rows < R)[:, None] & (cols < D)[None, :]
    ov = tl.load(o + rows[:, None] * D + cols[None, :], mask=m, other=0.0).to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(ov * ov, axis=1) / D + eps)
    n = ov * inv[:, None] * tl.load(w + cols, mask=cols < D, other=0.0).to(tl.float32)[None, :]
    if HAS_GATE:
        gv = tl.load(gate + rows[:, None] * D + cols[None, :], mask=m, other=0.0).to(tl.float32)
        n = n * gv * tl.sigmoid(gv)
    tl.store(y + rows[:, None] * D + cols[None, :], n.to(y.dtype.element_ty), mask=m)
    tl.store(rstd + rows, inv, mask=rows < R)


@fast_launch
@triton.jit(do_not_specialize=["R"])
def _rms_gate_bwd_kernel(o, w, gate, rstd, dy, do, dgate, dw_part, y, R, D: tl.constexpr, HAS_GATE: tl.constexpr,
                         BR: tl.constexpr, BD: tl.constexpr, NB: tl.constexpr, WRITE_Y: tl.constexpr):
    """Grid (cdiv(R, BR * NB),): do, dgate for NB blocks of BR rows, and this program's partial sum of dw;
    WRITE_Y: also the forward's output y, computed as the forward kernel computes it (the same float32 operations
    in the same order, so the same values), for a caller that needs y again and kept only o, gate and rstd."""
    pid = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BD)
    m_c = cols < D
    wv = tl.load(w + cols, mask=m_c, other=0.0).to(tl.float32)
    dw_acc = tl.zeros([BD], dtype=tl.float32)
    for j in range(NB):
        rows = (pid * NB + j) * BR + tl.arange(0, BR)
        m = (rows < R)[:, None] & m_c[None, :]
        offs = rows[:, None] * D + cols[None, :]
        ov = tl.load(o + offs, mask=m, other=0.0).to(tl.float32)
        inv = tl.load(rstd + rows, mask=rows < R, other=0.0)
        oh = ov * inv[:, None]
        dn = tl.load(dy + offs, mask=m, other=0.0).to(tl.float32)
        if WRITE_Y:
            yv = oh * wv[None, :]
        if HAS_GATE:
            gv = tl.load(gate + offs, mask=m, other=0.0).to(tl.float32)
            sig = tl.sigmoid(gv)
            if WRITE_Y:
                yv = yv * gv * sig
            tl.store(dgate + offs, (dn * oh * wv[None, :] * sig * (1.0 + gv * (1.0 - sig))).to(
                dgate.dtype.element_ty), mask=m)
            dn = dn * gv * sig
        dw_acc += tl.sum(dn * oh, axis=0)
        dnw = dn * wv[None, :]
        mean = tl.sum(dnw * oh, axis=1) / D
        tl.store(do + offs, (inv[:, None] * (dnw - oh * mean[:, None])).to(do.dtype.element_ty), mask=m)
        if WRITE_Y:
            tl.store(y + offs, yv.to(y.dtype.element_ty), mask=m)
    tl.store(dw_part + pid * D + cols, dw_acc, mask=m_c)


def _rows(x: torch.Tensor) -> tuple[int, int]:
    return x.numel() // x.shape[-1], x.shape[-1]


def _l2norm_fwd(x: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    R, D = _rows(x)
    y = torch.empty_like(x)
    r = torch.empty(x.shape[:-1], device=x.device, dtype=torch.float32)
    _l2norm_fwd_kernel[(cdiv(R, ROWS_PER_PROGRAM), 1)](
        x1=x, x2=x, y1=y, y2=y, r1=r, r2=r, R=R, D=D, eps=eps, BR=ROWS_PER_PROGRAM, BD=next_power_of_2(D))
    return y, r


def _l2norm_bwd(y: torch.Tensor, r: torch.Tensor, dy: torch.Tensor, eps: float) -> torch.Tensor:
    R, D = _rows(y)
    dx = torch.empty_like(y)
    _l2norm_bwd_kernel[(cdiv(R, ROWS_PER_PROGRAM), 1)](
        y1=y, y2=y, r1=r, r2=r, dy1=dy, dy2=dy, dx1=dx, dx2=dx, R=R, D=D, eps=eps, BR=ROWS_PER_PROGRAM,
        BD=next_power_of_2(D))
    return dx


def _l2norm_fwd_fake(x, eps):
    return torch.empty_like(x), x.new_empty(x.shape[:-1], dtype=torch.float32)


_l2norm_fwd_op = define_op("l2norm_fwd", _l2norm_fwd, _l2norm_fwd_fake)


def _l2norm_bwd_fake(y, r, dy, eps):
    return torch.empty_like(y)


_l2norm_bwd_op = define_op("l2norm_bwd", _l2norm_bwd, _l2norm_bwd_fake)


def _l2norm_setup(ctx, inputs, output):
    # the output (which the op after the norm keeps too: one tensor for both) and r, not the input
    ctx.save_for_backward(*output)
    ctx.eps = inputs[1]


def _l2norm_backward(ctx, dy, dr):
    y, r = ctx.saved_tensors
    run = _l2norm_bwd if eager_backward(ctx) else _l2norm_bwd_op
    return run(y, r, dy.contiguous(), ctx.eps), None


_l2norm_differentiable = op_function("L2NormTriton", _l2norm_fwd, _l2norm_fwd_op, _l2norm_setup, _l2norm_backward,
                                     non_differentiable=(1,))


def l2norm_triton(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / max(||x||, eps) over the last dim (at most 1024 wide), in x's dtype, computed in float32."""
    x = x.contiguous()
    return _l2norm_differentiable(x, float(eps))[0]


def _l2norm_pair_fwd(x1: torch.Tensor, x2: torch.Tensor, eps: float
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    R, D = _rows(x1)
    y1, y2 = torch.empty_like(x1), torch.empty_like(x2)
    r1 = torch.empty(x1.shape[:-1], device=x1.device, dtype=torch.float32)
    r2 = torch.empty_like(r1)
    _l2norm_fwd_kernel[(cdiv(R, ROWS_PER_PROGRAM), 2)](
        x1=x1, x2=x2, y1=y1, y2=y2, r1=r1, r2=r2, R=R, D=D, eps=eps, BR=ROWS_PER_PROGRAM, BD=next_power_of_2(D))
    return y1, y2, r1, r2


def _l2norm_pair_bwd(y1: torch.Tensor, y2: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor, dy1: torch.Tensor,
                     dy2: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    R, D = _rows(y1)
    dx1, dx2 = torch.empty_like(y1), torch.empty_like(y2)
    _l2norm_bwd_kernel[(cdiv(R, ROWS_PER_PROGRAM), 2)](
        y1=y1, y2=y2, r1=r1, r2=r2, dy1=dy1, dy2=dy2, dx1=dx1, dx2=dx2, R=R, D=D, eps=eps, BR=ROWS_PER_PROGRAM,
        BD=next_power_of_2(D))
    return dx1, dx2


def _l2norm_pair_fwd_fake(x1, x2, eps):
    r = x1.new_empty(x1.shape[:-1], dtype=torch.float32)
    return torch.empty_like(x1), torch.empty_like(x2), r, torch.empty_like(r)


def _l2norm_pair_bwd_fake(y1, y2, r1, r2, dy1, dy2, eps):
    return torch.empty_like(y1), torch.empty_like(y2)


_l2norm_pair_fwd_op = define_op("l2norm_pair_fwd", _l2norm_pair_fwd, _l2norm_pair_fwd_fake)
_l2norm_pair_bwd_op = define_op("l2norm_pair_bwd", _l2norm_pair_bwd, _l2norm_pair_bwd_fake)


def _l2norm_pair_setup(ctx, inputs, output):
    ctx.save_for_backward(*output)  # the outputs (which the op keeps too) and the reciprocal norms, as l2norm's
    ctx.eps = inputs[2]


def _l2norm_pair_backward(ctx, dy1, dy2, dr1, dr2):
    y1, y2, r1, r2 = ctx.saved_tensors
    run = _l2norm_pair_bwd if eager_backward(ctx) else _l2norm_pair_bwd_op
    dy1 = torch.zeros_like(y1) if dy1 is None else dy1.contiguous()
    dy2 = torch.zeros_like(y2) if dy2 is None else dy2.contiguous()
    return (*run(y1, y2, r1, r2, dy1, dy2, ctx.eps), None)


_l2norm_pair_differentiable = op_function("L2NormPairTriton", _l2norm_pair_fwd, _l2norm_pair_fwd_op,
                                          _l2norm_pair_setup, _l2norm_pair_backward, non_differentiable=(2, 3))


def l2norm_pair_triton(x1: torch.Tensor, x2: torch.Tensor, eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """(:func:`l2norm_triton` of x1, of x2) for two tensors of one shape and dtype (q and k), in one launch each
    way: the same values and gradients as two calls."""
    y1, y2, _, _ = _l2norm_pair_differentiable(x1.contiguous(), x2.contiguous(), float(eps))
    return y1, y2


def rms_norm_gated_forward(o: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor | None, eps: float
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, rstd [rows] float32) of :func:`rms_norm_gated_triton` for contiguous o and gate, without autograd."""
    R, D = _rows(o)
    y = torch.empty(o.shape, device=o.device, dtype=o.dtype if gate is None else gate.dtype)
    rstd = torch.empty(o.shape[:-1], device=o.device, dtype=torch.float32)
    _rms_gate_fwd_kernel[(cdiv(R, ROWS_PER_PROGRAM),)](
        o=o, w=weight, gate=o if gate is None else gate, y=y, rstd=rstd, R=R, D=D, eps=eps, HAS_GATE=gate is not None,
        BR=ROWS_PER_PROGRAM, BD=next_power_of_2(D))
    return y, rstd


def _rms_gate_bwd(o: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor | None, rstd: torch.Tensor,
                  dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(do, dweight, dgate (empty without a gate))."""
    return rms_norm_gated_backward(o, weight, gate, rstd, dy)[:3]


def rms_norm_gated_backward(o: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor | None, rstd: torch.Tensor,
                            dy: torch.Tensor, output: bool = False
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(do, dweight, dgate (empty without a gate), the forward's output y or None) of :func:`rms_norm_gated_triton`
    from o, gate (contiguous), the forward's per-row ``rstd`` and dy (contiguous, o's shape); y (``output``) in one
    launch with the gradients, equal to the forward kernel's y."""
    R, D = _rows(o)
    blocks = cdiv(R, ROWS_PER_PROGRAM)
    NB = max(1, min(64, blocks // 1024))  # about a thousand programs; few float32 partial rows of dw
    programs = cdiv(blocks, NB)
    do = torch.empty_like(o)
    dgate = torch.empty_like(gate) if gate is not None else o.new_empty(0)
    dw_part = torch.empty(programs, D, device=o.device, dtype=torch.float32)
    y = torch.empty(o.shape, device=o.device, dtype=o.dtype if gate is None else gate.dtype) if output else None
    _rms_gate_bwd_kernel[(programs,)](
        o=o, w=weight, gate=o if gate is None else gate, rstd=rstd, dy=dy, do=do, dgate=o if gate is None else dgate,
        dw_part=dw_part, y=do if y is None else y, R=R, D=D, HAS_GATE=gate is not None, BR=ROWS_PER_PROGRAM,
        BD=next_power_of_2(D), NB=NB, WRITE_Y=output)
    return do, dw_part.sum(0).to(weight.dtype), dgate, y


def _rms_fwd_fake(o, weight, gate, eps):
    y = o.new_empty(o.shape, dtype=o.dtype if gate is None else gate.dtype)
    return y, o.new_empty(o.shape[:-1], dtype=torch.float32)


_rms_fwd_op = define_op("rms_norm_gated_fwd", rms_norm_gated_forward, _rms_fwd_fake)


def _rms_bwd_fake(o, weight, gate, rstd, dy):
    return torch.empty_like(o), torch.empty_like(weight), (torch.empty_like(gate) if gate is not None
                                                           else o.new_empty(0))


_rms_bwd_op = define_op("rms_norm_gated_bwd", _rms_gate_bwd, _rms_bwd_fake)


def _rms_setup(ctx, inputs, output):
    o, weight, gate, eps = inputs
    ctx.save_for_backward(o, weight, gate, output[1])


def _rms_backward(ctx, dy, drstd):
    o, weight, gate, rstd = ctx.saved_tensors
    run = _rms_gate_bwd if eager_backward(ctx) else _rms_bwd_op
    do, dw, dgate = run(o, weight, gate, rstd, dy.contiguous())
    return do, dw, (dgate if gate is not None else None), None


_rms_gate_differentiable = op_function("RMSNormGatedTriton", rms_norm_gated_forward, _rms_fwd_op, _rms_setup,
                                       _rms_backward, non_differentiable=(1,))


def rms_norm_gated_triton(o: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor | None, eps: float
                          ) -> torch.Tensor:
    """RMSNorm of o [..., D] over the last dim with ``weight`` [D], times SiLU(gate) (same shape as o) when given;
    float32 arithmetic; returns gate's dtype (o's without a gate)."""
    o = o.contiguous()
    gate = None if gate is None else gate.contiguous()
    return _rms_gate_differentiable(o, weight.contiguous(), gate, float(eps))[0]
