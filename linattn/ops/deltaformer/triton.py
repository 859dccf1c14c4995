"""backend="triton" for deltaformer: the pseudo-values U by a chunked triangular solve on the GPU, then flash attention.

    kappa_ts = softmax_{s<t}(scale k_t.k_s),   u_t = v_t - b_t sum_{s<t} kappa_ts u_s,
    o_t = sum_{s<=t} softmax_{s<=t}(scale q_t.k_s) u_s

Three steps, each a few kernel launches and no host loop: (1) the kernel rows' log-normalisers lse_t over the keys
strictly before t (forgetting_attn's flash forward with strict visibility, no gates); (2) the solve
(``triton_kernels.py``: one sequential pass over the chunks per value block and batch*head); (3) the output
attention over (K, U) (the flash kernels without gates). The solve is an autograd Function whose backward runs
the adjoint kernel (psi = (I + A)^-T dU) and then the flash backward kernels with strict visibility for the kernel
logits' share of dk (the attention backward with dO = -b psi, O = r; see ``triton_kernels.py``); the attention's
backward is forgetting_attn's. On CUDA with bf16 / fp16 inputs and no cache, the output attention and the kernel
logits' backward run through torch's SDPA instead (``sdpa_passes.py``: its fused kernels are faster). Memory: U,
r (float32) and the log-normalisers are kept: linear in T.
Both steps are ops registered with torch.library, with fake kernels (torch.compile(fullgraph=True) traces them),
differentiated by autograd Functions that call the implementations directly in eager mode (common/triton_ops.py).

The cache (KVCache of keys and u's) is the past of both the kernel rows and the attention.
"""

from __future__ import annotations

import torch

from ..common.checks import compute_dtype
from ..common.kv_cache import KVCache
from ..common.registered_ops import define_op
from ..common.triton_ops import eager_backward, op_function
from ..common.triton_utils import block, cdiv, dot_precision, launch_options, launch_overrides, upcast_dots
from ..forgetting_attn.triton import KERNEL_DTYPES, MAX_HEAD_DIM, fox_attention, fox_backward, fox_forward
from ..softmax_attn.core import causal_attention
from .sdpa_passes import sdpa_passes_apply, strict_attention_key_grad
from .triton_kernels import (
    deltaformer_psi_kernel,
    deltaformer_psi_update_kernel,
    deltaformer_solve_kernel,
    deltaformer_update_kernel,
)

# "C": rows per chunk of the solve (16, 32 or 64: the in-kernel inverse); "BN" keys per step over the past;
# "BV" value columns per program of the solve and its adjoint, "update_BV" per program of the panel updates (each
# value block's program recomputes its rows' logits: wider blocks compute fewer; not yet timed wider than 64);
# "panel": chunks per panel of the blocked solve (triton_kernels.py; 0: one pass over the whole sequence per
# program). On an H200 (bf16, B 4, H 16, K = V = 128; one process per panel size) the op's forward and backward
# took 18.7 / 17.7 / 16.1 / 15.3 / 15.6 / 16.4 ms at T = 4096 with panels of 0 (one pass) / 2 / 4 / 8 / 16 / 32
# chunks of 64 rows, and 237.8 / 215.3 / 189.8 / 179.5 / 175.0 / 175.9 ms at T = 16384; the model's step (8 x 2048)
# 0.77x the Transformer's with panels of 8 against 0.70x with 4 (separate runs). Then, at T = 4096 (a process per
# setting, on one machine): the solve and its adjoint unpipelined (stages 1) 12.26 against 12.59 ms, and with update
# blocks of 128 (the adjoint's updates 1.46 against 1.91 ms in a kernel sweep) 11.82 ms.
# LINATTN_TRITON_LAUNCH='{"deltaformer": {...}}' overrides them.
LAUNCH = {"C": 64, "BN": 64, "BV": 64, "update_BV": 128, "panel": 8, "solve_warps": 4, "solve_stages": 1,
          "psi_warps": 4, "psi_stages": 1, "update_warps": 4, "update_stages": 2}
launch_overrides("deltaformer", LAUNCH)


def solve_forward(k_all: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, u_cache: torch.Tensor, scale: float
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(U_all [B, Tk, H, V] float32: the cache's u's then the new ones, r [B, T, H, V] float32, the kernel rows'
    base-2 log-normalisers [B, H, T]) from k_all [B, Tk, H, K] (cache then new keys), the new values v, beta
    [B, T, H] float32 and the cache's u's [B, T0, H, V] float32."""
    B, Tk, H, K = k_all.shape
    T, V = v.shape[1], v.shape[-1]
    T0 = Tk - T
    dummy = k_all.new_zeros(B, Tk, H, 1)  # the normalisers need no values
    _, lse = fox_forward(k_all[:, T0:].contiguous(), k_all, dummy, None, scale, 0, strict=True)
    U = torch.empty(B, Tk, H, V, device=k_all.device, dtype=torch.float32)
    U[:, :T0] = u_cache
    r = torch.empty(B, T, H, V, device=k_all.device, dtype=torch.float32)
    C, BV = LAUNCH["C"], min(LAUNCH["BV"], block(V))
    common = dict(scale=scale, T=T, Tk=Tk, H=H, K=K, V=V, C=C, BN=LAUNCH["BN"], BK=block(K), BV=BV,
                  PREC=dot_precision(k_all.dtype), UP=upcast_dots(k_all.dtype))
    solve = launch_options(LAUNCH, "solve", k_all.dtype, 1)
    NC = cdiv(T, C)
    P = _panel(NC)
    if P >= NC:  # one pass over the whole sequence
        deltaformer_solve_kernel[(cdiv(V, BV), B * H)](
            k=k_all, v=v, beta=beta, lse=lse, u=U, r=r, acc_in=r, c0=0, c1=NC, past0=0, HAS_ACC=False, **common,
            **solve)
        return U, r, lse
    acc = torch.empty(B, T, H, V, device=k_all.device, dtype=torch.float32)  # each row's sum over earlier panels
    update = launch_options(LAUNCH, "update", k_all.dtype, 1)
    BVu = min(LAUNCH["update_BV"], block(V))
    by_update = {**common, "BV": BVu}
    deltaformer_update_kernel[(NC, cdiv(V, BVu), B * H)](  # the cache's share (none: zeros)
        k=k_all, u=U, lse=lse, acc=acc, m0=0, n0=0, n1=T0, HAS_ACC=False, **by_update, **update)
    for c0 in range(0, NC, P):
        c1 = min(c0 + P, NC)
        deltaformer_solve_kernel[(cdiv(V, BV), B * H)](
            k=k_all, v=v, beta=beta, lse=lse, u=U, r=r, acc_in=acc, c0=c0, c1=c1, past0=T0 + c0 * C, HAS_ACC=True,
            **common, **solve)
        if c1 < NC:
            deltaformer_update_kernel[(NC - c1, cdiv(V, BVu), B * H)](
                k=k_all, u=U, lse=lse, acc=acc, m0=c1, n0=T0 + c0 * C, n1=T0 + c1 * C, HAS_ACC=True, **by_update,
                **update)
    return U, r, lse


def _panel(NC: int) -> int:
    """Chunks per panel of the blocked solve over NC chunks (LAUNCH["panel"]; 0: all of them, one pass)."""
    P = LAUNCH["panel"]
    if not isinstance(P, int) or isinstance(P, bool) or P < 0:
        raise ValueError(f"deltaformer launch setting panel must be an int >= 0 (0: one pass), got {P!r}")
    return P or NC


def solve_backward(k_all: torch.Tensor, beta: torch.Tensor, lse: torch.Tensor, U: torch.Tensor, r: torch.Tensor,
                   dU: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dk_all, psi = dv (float32), dbeta, du_cache) from dU = the gradient of U_all."""
    B, Tk, H, K = k_all.shape
    T, V = r.shape[1], r.shape[-1]
    T0 = Tk - T
    psi = torch.empty_like(r)
    C, BV = LAUNCH["C"], min(LAUNCH["BV"], block(V))
    du = dU[:, T0:].float().contiguous()
    common = dict(scale=scale, T=T, Tk=Tk, H=H, K=K, V=V, C=C, BM=C, BK=block(K), BV=BV,
                  PREC=dot_precision(k_all.dtype), UP=upcast_dots(k_all.dtype))
    adjoint = launch_options(LAUNCH, "psi", k_all.dtype, 1)
    NC = cdiv(T, C)
    P = _panel(NC)
    if P >= NC:
        deltaformer_psi_kernel[(cdiv(V, BV), B * H)](
            k=k_all, beta=beta, lse=lse, du=du, psi=psi, acc_in=psi, c0=0, c1=NC, t_end=T, HAS_ACC=False, **common,
            **adjoint)
    else:  # panels from the last one; acc: each row's sum over the later panels' rows
        acc = torch.empty_like(psi)
        update = launch_options(LAUNCH, "update", k_all.dtype, 1)
        BVu = min(LAUNCH["update_BV"], block(V))
        by_update = {**common, "BV": BVu}
        last = (NC - 1) // P * P  # the first chunk of the last panel
        for c0 in range(last, -1, -P):
            c1 = min(c0 + P, NC)
            deltaformer_psi_kernel[(cdiv(V, BV), B * H)](
                k=k_all, beta=beta, lse=lse, du=du, psi=psi, acc_in=acc, c0=c0, c1=c1, t_end=min(c1 * C, T),
                HAS_ACC=c1 < NC, **common, **adjoint)
            if c0 > 0:
                deltaformer_psi_update_kernel[(c0, cdiv(V, BVu), B * H)](
                    k=k_all, beta=beta, lse=lse, psi=psi, acc=acc, t0=c0 * C, t1=min(c1 * C, T),
                    HAS_ACC=c1 < NC, **by_update, **update)
    # the kernel logits' gradient is an attention backward: queries and keys k, values U, dO = -b psi, O = r
    dt = k_all.dtype
    # dO = -b psi, written once in the dtype the attention's backward reads it in (the float32 product rounded once)
    do = torch.mul(psi, beta.neg()[..., None], out=torch.empty_like(psi, dtype=dt))
    dbeta = -(psi * r).sum(-1)
    if sdpa_passes_apply(k_all, V, T0):
        return strict_attention_key_grad(k_all, U.to(dt), do, scale), psi, dbeta, dU[:, :0].float()
    dq, dk, du_kernel, _ = fox_backward(k_all[:, T0:].contiguous(), k_all, U.to(dt), None, r.to(dt), lse, do,
                                        scale, 0, strict=True)
    dk[:, T0:] += dq  # in dk's dtype: the sum is rounded once, as a float32 sum rounded back would be
    du_cache = dU[:, :T0].float() + du_kernel[:, :T0].float()
    return dk, psi, dbeta, du_cache


def _solve_fwd_fake(k_all, v, beta, u_cache, scale):
    B, Tk, H, _ = k_all.shape
    T, V = v.shape[1], v.shape[-1]
    f32 = torch.float32
    return k_all.new_empty(B, Tk, H, V, dtype=f32), k_all.new_empty(B, T, H, V, dtype=f32), \
        k_all.new_empty(B, H, T, dtype=f32)


_solve_fwd_op = define_op("deltaformer_solve_fwd", solve_forward, _solve_fwd_fake)


def _solve_bwd_fake(k_all, beta, lse, U, r, dU, scale):
    return torch.empty_like(k_all), torch.empty_like(r), torch.empty_like(beta), \
        U.new_empty(U.shape[0], U.shape[1] - r.shape[1], *U.shape[2:])


_solve_bwd_op = define_op("deltaformer_solve_bwd", solve_backward, _solve_bwd_fake)


def _setup_context(ctx, inputs, output):
    k_all, v, beta, u_cache, scale = inputs
    U, r, lse = output
    ctx.save_for_backward(k_all, beta, lse, U, r)
    ctx.scale, ctx.v_dtype = scale, v.dtype


def _backward_rule(ctx, dU, dr, dlse):
    k_all, beta, lse, U, r = ctx.saved_tensors
    run = solve_backward if eager_backward(ctx) else _solve_bwd_op
    dU = torch.zeros_like(U) if dU is None else dU
    dk, psi, dbeta, du_cache = run(k_all, beta, lse, U, r, dU, ctx.scale)
    return dk, psi.to(ctx.v_dtype), dbeta, du_cache, None


_solve_differentiable = op_function("DeltaFormerSolve", solve_forward, _solve_fwd_op, _setup_context, _backward_rule,
                                    non_differentiable=(1, 2))


def deltaformer_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, *, scale: float,
                       initial_state: KVCache | None = None, output_final_state: bool = False,
                       chunk_size: int = 64) -> tuple[torch.Tensor, KVCache | None]:
    """deltaformer through the Triton kernels (inputs validated by :func:`deltaformer`; ``chunk_size`` is not used:
    the solve's chunk comes from ``LAUNCH``). bf16 / fp16 / float32 inputs run in their dtype (float32 solve and
    accumulation), float64 in float32; the output is in q's dtype, the cache in float32 (float64 for float64)."""
    K, V = q.shape[-1], v.shape[-1]
    if K > MAX_HEAD_DIM or V > MAX_HEAD_DIM:
        raise ValueError(f"backend='triton' takes head dims K, V <= {MAX_HEAD_DIM}, got K = {K}, V = {V}")
    in_dtype, sdt = q.dtype, compute_dtype(q)
    dt = in_dtype if in_dtype in KERNEL_DTYPES else torch.float32
    B, T, H, _ = q.shape
    if initial_state is not None:
        k_all = torch.cat([initial_state.k.to(dt), k.to(dt)], dim=1).contiguous()
        u_cache = initial_state.v.float()
    else:
        k_all = k.to(dt).contiguous()
        u_cache = k.new_zeros(B, 0, H, V, dtype=torch.float32)
    U, _, _ = _solve_differentiable(k_all, v.to(dt).contiguous(), beta.float().contiguous(), u_cache, float(scale))
    if sdpa_passes_apply(k_all, V, k_all.shape[1] - T):
        o = causal_attention(q.to(dt), k_all, U.to(dt), scale)
    else:
        o = fox_attention(q.to(dt).contiguous(), k_all, U.to(dt), None, scale)
    state = None
    if output_final_state:
        keys = k.to(sdt) if initial_state is None else torch.cat([initial_state.k.to(sdt), k.to(sdt)], dim=1)
        state = KVCache(keys, U.to(sdt))
    return o.to(in_dtype), state


TRITON_BACKENDS = {"deltaformer": deltaformer_triton}
