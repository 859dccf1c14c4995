"""backend="triton" for linear_attn: simple_gla's kernels for the numerator, a small kernel pair for the normaliser.

    S_t = S_{t-1} + phi(k_t) v_t^T,   o_t = S_t^T (scale phi(q_t))   [/ (z_t^T (scale phi(q_t)) + eps)]
    z_t = z_{t-1} + phi(k_t)

The feature map runs in float32 (as in the other backends) and its result is rounded once to the input dtype, so
bf16/fp16 inputs run simple_gla's bf16/fp16 kernels (float32 and float64 inputs its float32 ones). The numerator is
simple_gla with g = 0 on (phi(q), phi(k), v). The normaliser is not a value column of that state: V + 1 columns
would add a mostly empty value block to every simple_gla kernel, and its output would be rounded to the input dtype
before the division. Instead den_t = scale phi(q_t) . z_t comes from its own kernels in float32:

    forward:   den_t = scale q_t . (z_0 + sum_{s <= t} k_s),        z_T = z_0 + sum_s k_s
    backward:  dq_t = scale dden_t (z_0 + sum_{s <= t} k_s),        dk_s = dz_T + scale sum_{t >= s} dden_t q_t,
               dz_0 = dz_T + scale sum_t dden_t q_t

(q, k standing for phi(q), phi(k)). A program per key block of 32 and batch-head walks the chunks of 64 tokens
in order (in-chunk cumulative sums plus the carried z); the forward's per-block partial sums of den are added in
PyTorch. The state with the normaliser is [B, H, M, V + 1], z in the last column, as in the other backends.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common.registered_ops import define_op
from ..common.triton_launch import fast_launch
from ..common.triton_ops import eager_backward, op_function
from ..common.triton_utils import cdiv
from ..simple_gla.triton import simple_gla_triton
from .feature_maps import apply_feature_map

# Key block and chunk of the normaliser kernels: [64, 32] float32 tiles, and K / 32 programs per batch-head.
LAUNCH = {"BK": 32, "C": 64, "warps": 4}


@fast_launch
@triton.jit(do_not_specialize=["T"])
def _normaliser_fwd_kernel(q, k, z0, den, zt, scale, T, H: tl.constexpr, K: tl.constexpr, C: tl.constexpr,
                           BK: tl.constexpr, HAS_Z0: tl.constexpr):
    """Grid (cdiv(K, BK), B*H): den[i_k, b, t, h] = this key block's share of den_t; zt = z_T."""
    i_k, i_bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    o_k, o_c = i_k * BK + tl.arange(0, BK), tl.arange(0, C)
    m_k = o_k < K
    z = tl.zeros([BK], dtype=tl.float32)
    if HAS_Z0:
        z += tl.load(z0 + i_bh * K + o_k, mask=m_k, other=0.0)
    part = den + i_k * (tl.num_programs(1) // H) * T * H  # this key block's [B, T, H] slice
    for n in range(tl.cdiv(T, C)):
        t = n * C + o_c
        m_t = t < T
        row = (i_b * T + t) * H + i_h
        m = m_t[:, None] & m_k[None, :]
        qc = tl.load(q + row[:, None] * K + o_k[None, :], mask=m, other=0.0).to(tl.float32)
        kc = tl.load(k + row[:, None] * K + o_k[None, :], mask=m, other=0.0).to(tl.float32)
        zc = tl.cumsum(kc, axis=0) + z[None, :]  # z_t for every token of the chunk
        tl.store(part + row, tl.sum(qc * zc, axis=1) * scale, mask=m_t)
        z += tl.sum(kc, axis=0)
    tl.store(zt + i_bh * K + o_k, z, mask=m_k)


@fast_launch
@triton.jit(do_not_specialize=["T"])
def _normaliser_bwd_kernel(q, k, z0, dden, dzt, dq, dk, dz0, scale, T, H: tl.constexpr, K: tl.constexpr,
                           C: tl.constexpr, BK: tl.constexpr, HAS_Z0: tl.constexpr, HAS_DZT: tl.constexpr):
    """Grid (cdiv(K, BK), B*H): dq, dk of one key block (a forward pass for dq, a reverse one for dk) and dz0."""
    i_k, i_bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    o_k, o_c = i_k * BK + tl.arange(0, BK), tl.arange(0, C)
    m_k = o_k < K
    N = tl.cdiv(T, C)
    z = tl.zeros([BK], dtype=tl.float32)
    if HAS_Z0:
        z += tl.load(z0 + i_bh * K + o_k, mask=m_k, other=0.0)
    for n in range(N):
        t = n * C + o_c
        m_t = t < T
        row = (i_b * T + t) * H + i_h
        m = m_t[:, None] & m_k[None, :]
        kc = tl.load(k + row[:, None] * K + o_k[None, :], mask=m, other=0.0).to(tl.float32)
        dd = tl.load(dden + row, mask=m_t, other=0.0)
        zc = tl.cumsum(kc, axis=0) + z[None, :]
        tl.store(dq + row[:, None] * K + o_k[None, :], (zc * (dd * scale)[:, None]).to(dq.dtype.element_ty), mask=m)
        z += tl.sum(kc, axis=0)
    r = tl.zeros([BK], dtype=tl.float32)  # dz of the state after the chunk being walked
    if HAS_DZT:
        r += tl.load(dzt + i_bh * K + o_k, mask=m_k, other=0.0)
    for i in range(N):
        n = N - 1 - i
        t = n * C + o_c
        m_t = t < T
        row = (i_b * T + t) * H + i_h
        m = m_t[:, None] & m_k[None, :]
        qc = tl.load(q + row[:, None] * K + o_k[None, :], mask=m, other=0.0).to(tl.float32)
        dd = tl.load(dden + row, mask=m_t, other=0.0)
        w = qc * (dd * scale)[:, None]
        tl.store(dk + row[:, None] * K + o_k[None, :], (tl.cumsum(w, axis=0, reverse=True) + r[None, :]).to(
            dk.dtype.element_ty), mask=m)
        r += tl.sum(w, axis=0)
    tl.store(dz0 + i_bh * K + o_k, r, mask=m_k)


def _grid(K: int, B: int, H: int) -> tuple[int, int]:
    return cdiv(K, LAUNCH["BK"]), B * H


def normaliser_forward(q: torch.Tensor, k: torch.Tensor, z0: torch.Tensor | None, scale: float
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """(den [B, T, H] float32, z_T [B, H, K] float32) for contiguous features q, k [B, T, H, K]."""
    B, T, H, K = q.shape
    grid = _grid(K, B, H)
    parts = torch.empty(grid[0], B, T, H, device=q.device, dtype=torch.float32)
    zt = torch.empty(B, H, K, device=q.device, dtype=torch.float32)
    _normaliser_fwd_kernel[grid](
        q=q, k=k, z0=z0 if z0 is not None else zt, den=parts, zt=zt, scale=scale, T=T, H=H, K=K, C=LAUNCH["C"],
        BK=LAUNCH["BK"], HAS_Z0=z0 is not None, num_warps=LAUNCH["warps"])
    return (parts[0] if grid[0] == 1 else parts.sum(0)), zt


def normaliser_backward(q: torch.Tensor, k: torch.Tensor, z0: torch.Tensor | None, scale: float, dden: torch.Tensor,
                        dzt: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk in the features' dtype, dz0 [B, H, K] float32)."""
    B, T, H, K = q.shape
    dq, dk = torch.empty_like(q), torch.empty_like(k)
    dz0 = torch.empty(B, H, K, device=q.device, dtype=torch.float32)
    _normaliser_bwd_kernel[_grid(K, B, H)](
        q=q, k=k, z0=z0 if z0 is not None else dz0, dden=dden, dzt=dzt if dzt is not None else dz0, dq=dq, dk=dk,
        dz0=dz0, scale=scale, T=T, H=H, K=K, C=LAUNCH["C"], BK=LAUNCH["BK"], HAS_Z0=z0 is not None,
        HAS_DZT=dzt is not None, num_warps=LAUNCH["warps"])
    return dq, dk, dz0


def _normaliser_fwd_fake(q, k, z0, scale):
    B, T, H, K = q.shape
    return q.new_empty(B, T, H, dtype=torch.float32), q.new_empty(B, H, K, dtype=torch.float32)


def _normaliser_bwd_fake(q, k, z0, scale, dden, dzt):
    B, T, H, K = q.shape
    return torch.empty_like(q), torch.empty_like(k), q.new_empty(B, H, K, dtype=torch.float32)


_normaliser_fwd_op = define_op("linear_attn_normaliser_fwd", normaliser_forward, _normaliser_fwd_fake)
_normaliser_bwd_op = define_op("linear_attn_normaliser_bwd", normaliser_backward, _normaliser_bwd_fake)


def _setup_context(ctx, inputs, output):
    q, k, z0, scale = inputs
    ctx.save_for_backward(q, k, z0)
    ctx.scale = scale


def _backward(ctx, dden, dzt):
    q, k, z0 = ctx.saved_tensors
    run = normaliser_backward if eager_backward(ctx) else _normaliser_bwd_op
    dden = torch.zeros(q.shape[:3], device=q.device, dtype=torch.float32) if dden is None else dden.float().contiguous()
    dq, dk, dz0 = run(q, k, z0, ctx.scale, dden, None if dzt is None else dzt.float().contiguous())
    return dq, dk, (dz0 if z0 is not None else None), None


_normaliser_differentiable = op_function("linear_attn_normaliser_function", normaliser_forward, _normaliser_fwd_op,
                                         _setup_context, _backward)


def normaliser(q: torch.Tensor, k: torch.Tensor, z0: torch.Tensor | None, scale: float
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Differentiable (den_t = scale q_t . z_t [B, T, H], z_T [B, H, K]), both float32; q, k [B, T, H, K]."""
    q, k = q.contiguous(), k.contiguous()
    z0 = None if z0 is None else z0.float().contiguous()
    return _normaliser_differentiable(q, k, z0, float(scale))


def _kernel_dtype(x: torch.Tensor) -> torch.dtype:
    """bf16/fp16 inputs run the half-precision kernels; float32 and float64 the float32 ones."""
    return x.dtype if x.dtype in (torch.bfloat16, torch.float16) else torch.float32


def _phi(x: torch.Tensor, feature_map: str, W: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """The feature map in float32, rounded once to the kernels' dtype (the identity map leaves x as it is)."""
    if feature_map == "identity":
        return x.to(dtype)
    return apply_feature_map(x.float(), feature_map, W).to(dtype)


def linear_attn_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, feature_map: str,
                       feature_map_weight: torch.Tensor | None, normalize: bool, eps: float, scale: float,
                       initial_state: torch.Tensor | None = None, output_final_state: bool = False,
                       chunk_size: int = 64) -> tuple[torch.Tensor, torch.Tensor | None]:
    """backend='triton' for linear_attn (inputs validated by the public op): see the module docstring."""
    dtype = _kernel_dtype(q)
    fq, fk = (_phi(x, feature_map, feature_map_weight, dtype) for x in (q, k))
    V = v.shape[-1]
    S0, z0 = initial_state, None
    if normalize and initial_state is not None:
        S0, z0 = initial_state[..., :V], initial_state[..., V]
    g = fq.new_zeros(fq.shape[:3])
    o, S = simple_gla_triton(fq, fk, v.to(dtype), g, scale=scale, initial_state=S0,
                             output_final_state=output_final_state, chunk_size=chunk_size)
    if not normalize:
        return o.to(q.dtype), S
    den, z = normaliser(fq, fk, z0, scale)
    o = (o.float() / (den + eps).unsqueeze(-1)).to(q.dtype)
    return o, (torch.cat([S, z.unsqueeze(-1)], dim=-1) if output_final_state else None)


TRITON_BACKENDS = {"linear_attn": linear_attn_triton}
