"""A fused Triton kernel pair for the Mamba2-style decay gate (CUDA, or the CPU under TRITON_INTERPRET=1).

Per token and head, with a = W_a x (any float dtype) and per-head parameters A_log, dt_bias:

    z = a + dt_bias,   dt = softplus(z) (= z for z > 20, as F.softplus),   g = -exp(A_log) dt      (float32)

Backward, with dg and ddt the gradients of g and dt:

    dz = (ddt - exp(A_log) dg) sigmoid(z),   da = dz,   d dt_bias = sum dz,   d A_log = sum dg g

In PyTorch this is a chain of about six elementwise kernels forward and as many autograd nodes backward over a
small [B, T, H] tensor: host time, not device time, on a GPU. Here it is one launch each way (the per-head sums
as per-program partial rows added by PyTorch). Custom ops under torch.compile, an autograd Function eagerly.
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

ROWS = 64  # tokens per program


@triton.jit
def _softplus(z):
    return tl.where(z > 20.0, z, tl.log(1.0 + tl.exp(tl.minimum(z, 20.0))))


@fast_launch
@triton.jit(do_not_specialize=["N"])
def _gate_fwd_kernel(a, a_log, dt_bias, g, dt, N, H: tl.constexpr, BR: tl.constexpr, BH: tl.constexpr):
    """Grid (cdiv(N, BR),): g and dt of BR tokens (rows of H heads)."""
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    heads = tl.arange(0, BH)
    m = (rows < N)[:, None] & (heads < H)[None, :]
    offs = rows[:, None] * H + heads[None, :]
    z = tl.load(a + offs, mask=m, other=0.0).to(tl.float32) + tl.load(dt_bias + heads, mask=heads < H,
                                                                       other=0.0).to(tl.float32)[None, :]
    d = _softplus(z)
    A = tl.exp(tl.load(a_log + heads, mask=heads < H, other=0.0).to(tl.float32))
    tl.store(dt + offs, d, mask=m)
    tl.store(g + offs, -A[None, :] * d, mask=m)


@fast_launch
@triton.jit(do_not_specialize=["N"])
def _gate_bwd_kernel(a, a_log, dt_bias, dg, ddt, da, part, N, H: tl.constexpr, HAS_DDT: tl.constexpr,
                     BR: tl.constexpr, BH: tl.constexpr):
    """Grid (cdiv(N, BR),): da for BR tokens; part[pid] = (sum dz, sum dg g) over them, per head."""
    pid = tl.program_id(0).to(tl.int64)
    rows = pid * BR + tl.arange(0, BR)
    heads = tl.arange(0, BH)
    m_h = heads < H
    m = (rows < N)[:, None] & m_h[None, :]
    offs = rows[:, None] * H + heads[None, :]
    z = tl.load(a + offs, mask=m, other=0.0).to(tl.float32) + tl.load(dt_bias + heads, mask=m_h,
                                                                       other=0.0).to(tl.float32)[None, :]
    A = tl.exp(tl.load(a_log + heads, mask=m_h, other=0.0).to(tl.float32))
    gd = tl.load(dg + offs, mask=m, other=0.0).to(tl.float32)
    up = -A[None, :] * gd
    if HAS_DDT:
        up += tl.load(ddt + offs, mask=m, other=0.0).to(tl.float32)
    dz = tl.where(m, up * tl.sigmoid(z), 0.0)
    tl.store(da + offs, dz.to(da.dtype.element_ty), mask=m)
    tl.store(part + (pid * 2) * H + heads, tl.sum(dz, axis=0), mask=m_h)
    tl.store(part + (pid * 2 + 1) * H + heads, tl.sum(tl.where(m, gd * (-A[None, :] * _softplus(z)), 0.0), axis=0),
             mask=m_h)


def _gate_fwd(a: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    H = a.shape[-1]
    N = a.numel() // H
    g = torch.empty(a.shape, device=a.device, dtype=torch.float32)
    dt = torch.empty_like(g)
    _gate_fwd_kernel[(cdiv(N, ROWS),)](a=a, a_log=a_log, dt_bias=dt_bias, g=g, dt=dt, N=N, H=H, BR=ROWS,
                                              BH=next_power_of_2(H))
    return g, dt


def _gate_bwd(a: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor, dg: torch.Tensor,
              ddt: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(da, d A_log, d dt_bias)."""
    H = a.shape[-1]
    N = a.numel() // H
    programs = cdiv(N, ROWS)
    da = torch.empty_like(a)
    part = torch.empty(programs, 2, H, device=a.device, dtype=torch.float32)
    _gate_bwd_kernel[(programs,)](a=a, a_log=a_log, dt_bias=dt_bias, dg=dg, ddt=dg if ddt is None else ddt, da=da,
                                  part=part, N=N, H=H, HAS_DDT=ddt is not None, BR=ROWS, BH=next_power_of_2(H))
    # two separate reductions: a custom op's outputs must not alias one another (as two rows of one sum would)
    return da, part[:, 1].sum(0).to(a_log.dtype), part[:, 0].sum(0).to(dt_bias.dtype)


def _fwd_fake(a, a_log, dt_bias):
    g = a.new_empty(a.shape, dtype=torch.float32)
    return g, torch.empty_like(g)


_fwd_op = define_op("mamba_gate_fwd", _gate_fwd, _fwd_fake)


def _bwd_fake(a, a_log, dt_bias, dg, ddt):
    return torch.empty_like(a), torch.empty_like(a_log), torch.empty_like(dt_bias)


_bwd_op = define_op("mamba_gate_bwd", _gate_bwd, _bwd_fake)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, dg, ddt):
    a, a_log, dt_bias = ctx.saved_tensors
    run = _gate_bwd if eager_backward(ctx) else _bwd_op
    dg = torch.zeros(a.shape, device=a.device, dtype=torch.float32) if dg is None else dg.contiguous()
    return run(a, a_log, dt_bias, dg, None if ddt is None else ddt.contiguous())


_differentiable = op_function("MambaGateTriton", _gate_fwd, _fwd_op, _setup, _backward)


def mamba_gate_triton(a: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """(g, dt) float32 shaped like a [..., H]: dt = softplus(a + dt_bias), g = -exp(A_log) dt (module docstring)."""
    a = a.contiguous()
    return _differentiable(a, a_log.contiguous(), dt_bias.contiguous())
