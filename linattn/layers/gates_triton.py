"""A fused Triton kernel pair for the Mamba2-style decay gate (CUDA, or the CPU under TRITON_INTERPRET=1).

Per token and head, with a = W_a x (any float dtype) and per-head parameters A_log, dt_bias:

    z = a + dt_bias,   dt = softplus(z) (= z for z > 20, as F.softplus),   g = -exp(A_log) dt      (float32)

Backward, with dg and ddt the gradients of g and dt:

    dz = (ddt - exp(A_log) dg) sigmoid(z),   da = dz,   d dt_bias = sum dz,   d A_log = sum dg g

Gated DeltaNet's layer also takes beta = sigmoid(b) per token and head, and reads g and beta in the activation
dtype: :func:`mamba_gate_beta_triton` makes both in one launch (db = dbeta s (1 - s), s = sigmoid(b) in float32), so
the sigmoid and the casts add no kernels and no autograd nodes.

Mamba2's layer scales its keys by dt (B_t dt_t x_t^T): :func:`mamba_gate_keys_triton` makes g (in the activation
dtype) and k dt in one launch over the (token, head) rows, and its backward gives dk = dt dk~ and adds
sum_c k_c dk~_c to ddt, in one launch too.

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
from ..ops.common.triton_utils import cdiv, next_power_of_2, row_tile

patch_interpreter()

ROWS = 64  # tokens per program


@triton.jit
def _softplus(z):
    return tl.where(z > 20.0, z, tl.log(1.0 + tl.exp(tl.minimum(z, 20.0))))


@triton.jit
def _gate_inputs(a, a_log, dt_bias, offs, heads, m, m_h):
    """(z = a + dt_bias, A = exp(A_log)), float32, at a's offsets ``offs`` (mask m) and the heads ``heads`` (mask
    m_h, of offs's rank): dt = softplus(z), g = -A dt."""
    z = tl.load(a + offs, mask=m, other=0.0).to(tl.float32) + tl.load(dt_bias + heads, mask=m_h,
                                                                       other=0.0).to(tl.float32)
    return z, tl.exp(tl.load(a_log + heads, mask=m_h, other=0.0).to(tl.float32))


@fast_launch
@triton.jit(do_not_specialize=["N"])
def _gate_fwd_kernel(a, a_log, dt_bias, g, dt, b, beta, N, H: tl.constexpr, BR: tl.constexpr, BH: tl.constexpr,
                     WRITE_DT: tl.constexpr, HAS_B: tl.constexpr):
    """Grid (cdiv(N, BR),): g (in g's dtype) and, WRITE_DT, dt (float32) of BR tokens (rows of H heads); HAS_B:
    beta = sigmoid(b) too (in beta's dtype)."""
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    heads = tl.arange(0, BH)
    m = (rows < N)[:, None] & (heads < H)[None, :]
    offs = rows[:, None] * H + heads[None, :]
    z, A = _gate_inputs(a, a_log, dt_bias, offs, heads[None, :], m, (heads < H)[None, :])
    d = _softplus(z)
    if WRITE_DT:
        tl.store(dt + offs, d, mask=m)
    tl.store(g + offs, (-A * d).to(g.dtype.element_ty), mask=m)
    if HAS_B:
        bv = tl.load(b + offs, mask=m, other=0.0).to(tl.float32)
        tl.store(beta + offs, tl.sigmoid(bv).to(beta.dtype.element_ty), mask=m)


@fast_launch
@triton.jit(do_not_specialize=["N"])
def _gate_bwd_kernel(a, a_log, dt_bias, dg, ddt, da, part, b, dbeta, db, N, H: tl.constexpr, HAS_DDT: tl.constexpr,
                     HAS_B: tl.constexpr, HAS_DBETA: tl.constexpr, BR: tl.constexpr, BH: tl.constexpr):
    """Grid (cdiv(N, BR),): da for BR tokens; part[pid] = (sum dz, sum dg g) over them, per head; HAS_B: db from
    dbeta (zero without it: HAS_DBETA False)."""
    pid = tl.program_id(0).to(tl.int64)
    rows = pid * BR + tl.arange(0, BR)
    heads = tl.arange(0, BH)
    m_h = heads < H
    m = (rows < N)[:, None] & m_h[None, :]
    offs = rows[:, None] * H + heads[None, :]
    z, A = _gate_inputs(a, a_log, dt_bias, offs, heads[None, :], m, m_h[None, :])
    gd = tl.load(dg + offs, mask=m, other=0.0).to(tl.float32)
    up = -A * gd
    if HAS_DDT:
        up += tl.load(ddt + offs, mask=m, other=0.0).to(tl.float32)
    dz = tl.where(m, up * tl.sigmoid(z), 0.0)
    tl.store(da + offs, dz.to(da.dtype.element_ty), mask=m)
    tl.store(part + (pid * 2) * H + heads, tl.sum(dz, axis=0), mask=m_h)
    tl.store(part + (pid * 2 + 1) * H + heads, tl.sum(tl.where(m, gd * (-A * _softplus(z)), 0.0), axis=0), mask=m_h)
    if HAS_B:
        s = tl.sigmoid(tl.load(b + offs, mask=m, other=0.0).to(tl.float32))
        dbv = tl.zeros([BR, BH], dtype=tl.float32)
        if HAS_DBETA:
            dbv = tl.load(dbeta + offs, mask=m, other=0.0).to(tl.float32) * s * (1.0 - s)
        tl.store(db + offs, dbv.to(db.dtype.element_ty), mask=m)


@fast_launch
@triton.jit(do_not_specialize=["R"])
def _gate_keys_fwd_kernel(a, a_log, dt_bias, k, g, kd, R, H: tl.constexpr, K: tl.constexpr, BR: tl.constexpr,
                          BK: tl.constexpr):
    """Grid (cdiv(R, BR),) over the R = N H (token, head) rows r, head r % H: g[r] = -exp(A_log) dt[r] (in g's
    dtype) and kd[r, :] = dt[r] k[r, :] (in kd's dtype), dt = softplus(a[r] + dt_bias) in float32."""
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    m = rows < R
    heads = rows % H
    z, A = _gate_inputs(a, a_log, dt_bias, rows, heads, m, m)
    d = _softplus(z)
    tl.store(g + rows, (-A * d).to(g.dtype.element_ty), mask=m)
    o_k = tl.arange(0, BK)
    m_k = m[:, None] & (o_k < K)[None, :]
    offs = rows[:, None] * K + o_k[None, :]
    kv = tl.load(k + offs, mask=m_k, other=0.0).to(tl.float32)
    tl.store(kd + offs, (kv * d[:, None]).to(kd.dtype.element_ty), mask=m_k)


@fast_launch
@triton.jit(do_not_specialize=["R"])
def _gate_keys_bwd_kernel(a, a_log, dt_bias, k, dg, dkd, da, dk, part, R, H: tl.constexpr, K: tl.constexpr,
                          BR: tl.constexpr, BK: tl.constexpr, BH: tl.constexpr, HAS_DG: tl.constexpr,
                          HAS_DKD: tl.constexpr):
    """Grid (cdiv(R, BR),): da and dk = dt dkd for BR (token, head) rows; part[pid] = (sum dz, sum dg g) over them,
    per head (missing gradients count as zeros)."""
    pid = tl.program_id(0).to(tl.int64)
    rows = pid * BR + tl.arange(0, BR)
    m = rows < R
    heads = rows % H
    z, A = _gate_inputs(a, a_log, dt_bias, rows, heads, m, m)
    d = _softplus(z)
    gd = tl.zeros([BR], dtype=tl.float32)
    if HAS_DG:
        gd = tl.load(dg + rows, mask=m, other=0.0).to(tl.float32)
    up = -A * gd
    o_k = tl.arange(0, BK)
    m_k = m[:, None] & (o_k < K)[None, :]
    offs = rows[:, None] * K + o_k[None, :]
    dkv = tl.zeros([BR, BK], dtype=tl.float32)
    if HAS_DKD:
        dkv = tl.load(dkd + offs, mask=m_k, other=0.0).to(tl.float32)
        up += tl.sum(dkv * tl.load(k + offs, mask=m_k, other=0.0).to(tl.float32), axis=1)
    tl.store(dk + offs, (dkv * d[:, None]).to(dk.dtype.element_ty), mask=m_k)
    dz = tl.where(m, up * tl.sigmoid(z), 0.0)
    tl.store(da + rows, dz.to(da.dtype.element_ty), mask=m)
    o_h = tl.arange(0, BH)
    hot = (heads[:, None] == o_h[None, :]) & m[:, None]
    tl.store(part + (pid * 2) * H + o_h, tl.sum(tl.where(hot, dz[:, None], 0.0), axis=0), mask=o_h < H)
    tl.store(part + (pid * 2 + 1) * H + o_h, tl.sum(tl.where(hot, (gd * -A * d)[:, None], 0.0), axis=0),
             mask=o_h < H)


def _gate_fwd(a: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor, b: torch.Tensor | None,
              dtype: torch.dtype, with_dt: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(g in ``dtype``, dt float32 (empty unless ``with_dt``), sigmoid(b) in ``dtype`` (empty without b))."""
    H = a.shape[-1]
    N = a.numel() // H
    g = torch.empty(a.shape, device=a.device, dtype=dtype)
    dt = torch.empty(a.shape if with_dt else (0,), device=a.device, dtype=torch.float32)
    beta = torch.empty(a.shape if b is not None else (0,), device=a.device, dtype=dtype)
    _gate_fwd_kernel[(cdiv(N, ROWS),)](a=a, a_log=a_log, dt_bias=dt_bias, g=g, dt=dt if with_dt else g,
                                       b=a if b is None else b, beta=g if b is None else beta, N=N, H=H, BR=ROWS,
                                       BH=next_power_of_2(H), WRITE_DT=with_dt, HAS_B=b is not None)
    return g, dt, beta


def _gate_bwd(a: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor, b: torch.Tensor | None, dg: torch.Tensor,
              ddt: torch.Tensor | None, dbeta: torch.Tensor | None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(da, d A_log, d dt_bias, db (empty without b)); ddt and dbeta None or shaped like a (the kernel reads them
    where it reads a)."""
    for name, grad in (("dg", dg), ("ddt", ddt), ("dbeta", dbeta)):
        if grad is not None and grad.shape != a.shape:
            raise ValueError(f"{name} must be shaped like a {tuple(a.shape)}, got {tuple(grad.shape)}")
    H = a.shape[-1]
    N = a.numel() // H
    programs = cdiv(N, ROWS)
    da = torch.empty_like(a)
    db = torch.empty_like(b) if b is not None else a.new_empty(0)
    part = torch.empty(programs, 2, H, device=a.device, dtype=torch.float32)
    _gate_bwd_kernel[(programs,)](a=a, a_log=a_log, dt_bias=dt_bias, dg=dg, ddt=dg if ddt is None else ddt, da=da,
                                  part=part, b=a if b is None else b, dbeta=dg if dbeta is None else dbeta,
                                  db=da if b is None else db, N=N, H=H, HAS_DDT=ddt is not None, HAS_B=b is not None,
                                  HAS_DBETA=dbeta is not None, BR=ROWS, BH=next_power_of_2(H))
    # two separate reductions: a custom op's outputs must not alias one another (as two rows of one sum would)
    return da, part[:, 1].sum(0).to(a_log.dtype), part[:, 0].sum(0).to(dt_bias.dtype), db


def _fwd_fake(a, a_log, dt_bias, b, dtype, with_dt):
    return (a.new_empty(a.shape, dtype=dtype), a.new_empty(a.shape if with_dt else (0,), dtype=torch.float32),
            a.new_empty(a.shape if b is not None else (0,), dtype=dtype))


_fwd_op = define_op("mamba_gate_fwd", _gate_fwd, _fwd_fake)


def _bwd_fake(a, a_log, dt_bias, b, dg, ddt, dbeta):
    return (torch.empty_like(a), torch.empty_like(a_log), torch.empty_like(dt_bias),
            torch.empty_like(b) if b is not None else a.new_empty(0))


_bwd_op = define_op("mamba_gate_bwd", _gate_bwd, _bwd_fake)


def _setup(ctx, inputs, output):
    a, a_log, dt_bias, b, dtype, with_dt = inputs
    ctx.save_for_backward(a, a_log, dt_bias, b)
    ctx.with_dt = with_dt


def _backward(ctx, dg, ddt, dbeta):
    a, a_log, dt_bias, b = ctx.saved_tensors
    run = _gate_bwd if eager_backward(ctx) else _bwd_op
    # an output the forward left empty (dt without with_dt, beta without b) has no gradient to read; compiled
    # autograd hands it one anyway, as zeros of the empty shape
    ddt = ddt if ctx.with_dt else None
    dbeta = dbeta if b is not None else None
    dg = torch.zeros(a.shape, device=a.device, dtype=torch.float32) if dg is None else dg.contiguous()
    da, da_log, ddt_bias, db = run(a, a_log, dt_bias, b, dg, None if ddt is None else ddt.contiguous(),
                                   None if dbeta is None else dbeta.contiguous())
    return da, da_log, ddt_bias, (db if b is not None else None), None, None


_differentiable = op_function("MambaGateTriton", _gate_fwd, _fwd_op, _setup, _backward)


def mamba_gate_triton(a: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """(g, dt) float32 shaped like a [..., H]: dt = softplus(a + dt_bias), g = -exp(A_log) dt (module docstring)."""
    g, dt, _ = _differentiable(a.contiguous(), a_log.contiguous(), dt_bias.contiguous(), None, torch.float32, True)
    return g, dt


def mamba_gate_beta_triton(a: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor, b: torch.Tensor,
                           dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(g, beta) in ``dtype`` from one launch (one each way): g = -exp(A_log) softplus(a + dt_bias) and
    beta = sigmoid(b), both [..., H] like a and b, computed in float32 (Gated DeltaNet's per-token gates)."""
    g, _, beta = _differentiable(a.contiguous(), a_log.contiguous(), dt_bias.contiguous(), b.contiguous(), dtype,
                                 False)
    return g, beta


def _check_keys(a: torch.Tensor, k: torch.Tensor) -> None:
    if k.shape[:-1] != a.shape:
        raise ValueError(f"k must be shaped like a with a trailing key dim, a {tuple(a.shape)} -> k [..., K], got "
                         f"{tuple(k.shape)}")


def _keys_fwd(a: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor, k: torch.Tensor,
              dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(g in ``dtype`` shaped like a, dt k in k's dtype)."""
    _check_keys(a, k)
    H, K, R = a.shape[-1], k.shape[-1], a.numel()
    g = torch.empty(a.shape, device=a.device, dtype=dtype)
    kd = torch.empty_like(k)
    BR, BK = row_tile(K)
    _gate_keys_fwd_kernel[(cdiv(R, BR),)](a=a, a_log=a_log, dt_bias=dt_bias, k=k, g=g, kd=kd, R=R, H=H, K=K, BR=BR,
                                          BK=BK)
    return g, kd


def _keys_bwd(a: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor, k: torch.Tensor, dg: torch.Tensor | None,
              dkd: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(da, d A_log, d dt_bias, dk); dg None or shaped like a, dkd None or like k."""
    _check_keys(a, k)
    for name, grad, like in (("dg", dg, a), ("dkd", dkd, k)):
        if grad is not None and grad.shape != like.shape:
            raise ValueError(f"{name} must be shaped {tuple(like.shape)}, got {tuple(grad.shape)}")
    H, K, R = a.shape[-1], k.shape[-1], a.numel()
    BR, BK = row_tile(K)
    programs = cdiv(R, BR)
    da, dk = torch.empty_like(a), torch.empty_like(k)
    part = torch.empty(programs, 2, H, device=a.device, dtype=torch.float32)
    _gate_keys_bwd_kernel[(programs,)](a=a, a_log=a_log, dt_bias=dt_bias, k=k, dg=a if dg is None else dg,
                                       dkd=k if dkd is None else dkd, da=da, dk=dk, part=part, R=R, H=H, K=K, BR=BR,
                                       BK=BK, BH=next_power_of_2(H), HAS_DG=dg is not None, HAS_DKD=dkd is not None)
    return da, part[:, 1].sum(0).to(a_log.dtype), part[:, 0].sum(0).to(dt_bias.dtype), dk


def _keys_fwd_fake(a, a_log, dt_bias, k, dtype):
    return a.new_empty(a.shape, dtype=dtype), torch.empty_like(k)


def _keys_bwd_fake(a, a_log, dt_bias, k, dg, dkd):
    return torch.empty_like(a), torch.empty_like(a_log), torch.empty_like(dt_bias), torch.empty_like(k)


_keys_fwd_op = define_op("mamba_gate_keys_fwd", _keys_fwd, _keys_fwd_fake)
_keys_bwd_op = define_op("mamba_gate_keys_bwd", _keys_bwd, _keys_bwd_fake)


def _keys_setup(ctx, inputs, output):
    a, a_log, dt_bias, k, dtype = inputs
    ctx.save_for_backward(a, a_log, dt_bias, k)


def _keys_backward(ctx, dg, dkd):
    a, a_log, dt_bias, k = ctx.saved_tensors
    run = _keys_bwd if eager_backward(ctx) else _keys_bwd_op
    da, da_log, ddt_bias, dk = run(a, a_log, dt_bias, k, None if dg is None else dg.contiguous(),
                                   None if dkd is None else dkd.contiguous())
    return da, da_log, ddt_bias, dk, None


_keys_differentiable = op_function("MambaGateKeysTriton", _keys_fwd, _keys_fwd_op, _keys_setup, _keys_backward)


def mamba_gate_keys_triton(a: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor, k: torch.Tensor,
                           dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(g in ``dtype`` [..., H] like a, dt k in k's dtype [..., H, K]) from one launch (one each way):
    dt = softplus(a + dt_bias), g = -exp(A_log) dt, in float32 (Mamba2's decay and its keys B_t dt_t)."""
    return _keys_differentiable(a.contiguous(), a_log.contiguous(), dt_bias.contiguous(), k.contiguous(), dtype)
