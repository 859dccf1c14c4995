"""backend="triton" for deltaformer: the pseudo-values U by a chunked triangular solve on the GPU, then flash attention.

    kappa_ts = softmax_{s<t}(scale k_t.k_s),   u_t = v_t - b_t sum_{s<t} kappa_ts u_s,
    o_t = sum_{s<=t} softmax_{s<=t}(scale q_t.k_s) u_s

Three steps, each a few kernel launches and no host loop: (1) the kernel rows' log-normalisers lse_t over the keys
strictly before t (forgetting_attn's flash forward with strict visibility, zero gates); (2) the solve
(``triton_kernels.py``: one sequential pass over the chunks per value block and batch*head); (3) the output
attention over (K, U) (the flash kernels with zero gates). The solve is an autograd Function whose backward runs
the adjoint kernel (psi = (I + A)^-T dU) and then the flash backward kernels with strict visibility for the kernel
logits' share of dk (the attention backward with dO = -b psi, O = r; see ``triton_kernels.py``); the attention's
backward is forgetting_attn's. Memory: U, r (float32) and the log-normalisers are kept: linear in T.

The cache (KVCache of keys and u's) is the past of both the kernel rows and the attention. Runs as plain autograd
Functions: under torch.compile these are traced through, with graph breaks around the kernels.
"""

from __future__ import annotations

import torch
import triton

from ..common.checks import compute_dtype
from ..common.kv_cache import KVCache
from ..common.triton_utils import block, dot_precision, launch_options, launch_overrides, upcast_dots
from ..forgetting_attn.triton import KERNEL_DTYPES, MAX_HEAD_DIM, _FoxFunction, fox_backward, fox_forward
from .triton_kernels import deltaformer_psi_kernel, deltaformer_solve_kernel

# "C": rows per chunk of the solve (16, 32 or 64: the in-kernel inverse); "BN" keys per step over the past;
# "BV" value columns per program; LINATTN_TRITON_LAUNCH='{"deltaformer": {...}}' overrides them.
LAUNCH = {"C": 64, "BN": 64, "BV": 64, "solve_warps": 4, "solve_stages": 2, "psi_warps": 4, "psi_stages": 2}
launch_overrides("deltaformer", LAUNCH)


def _zero_gates(k: torch.Tensor, H: int) -> torch.Tensor:
    return torch.zeros(k.shape[0], H, k.shape[1], device=k.device, dtype=torch.float64)


class _Solve(torch.autograd.Function):
    """U_all [B, Tk, H, V] float32 (the cache's u's, then the new ones) from k_all [B, Tk, H, K], the new values
    v [B, T, H, V], beta [B, T, H] and the cache's u's [B, T0, H, V]; differentiable in all four."""

    @staticmethod
    def forward(ctx, k_all, v, beta, u_cache, scale):
        B, Tk, H, K = k_all.shape
        T, V = v.shape[1], v.shape[-1]
        T0 = Tk - T
        k_new = k_all[:, T0:].contiguous()
        dummy = k_all.new_zeros(B, Tk, H, 1)  # the normalisers need no values
        G0 = _zero_gates(k_all, H)
        _, lse = fox_forward(k_new, k_all, dummy, G0, scale, 0, strict=True)
        U = torch.empty(B, Tk, H, V, device=k_all.device, dtype=torch.float32)
        U[:, :T0] = u_cache
        r = torch.empty(B, T, H, V, device=k_all.device, dtype=torch.float32)
        BV = min(LAUNCH["BV"], block(V))
        deltaformer_solve_kernel[(triton.cdiv(V, BV), B * H)](
            k=k_all, v=v, beta=beta, lse=lse, u=U, r=r, scale=scale, T=T, Tk=Tk, H=H, K=K, V=V, C=LAUNCH["C"],
            BN=LAUNCH["BN"], BK=block(K), BV=BV, PREC=dot_precision(k_all.dtype), UP=upcast_dots(k_all.dtype),
            **launch_options(LAUNCH, "solve", k_all.dtype, 1))
        ctx.save_for_backward(k_all, beta, lse, U, r)
        ctx.scale, ctx.v_dtype = scale, v.dtype
        return U

    @staticmethod
    def backward(ctx, dU):
        k_all, beta, lse, U, r = ctx.saved_tensors
        B, Tk, H, K = k_all.shape
        T, V = r.shape[1], r.shape[-1]
        T0 = Tk - T
        psi = torch.empty_like(r)
        BV = min(LAUNCH["BV"], block(V))
        deltaformer_psi_kernel[(triton.cdiv(V, BV), B * H)](
            k=k_all, beta=beta, lse=lse, du=dU[:, T0:].float().contiguous(), psi=psi, scale=ctx.scale, T=T,
            Tk=Tk, H=H, K=K, V=V, C=LAUNCH["C"], BM=LAUNCH["C"], BK=block(K), BV=BV,
            PREC=dot_precision(k_all.dtype), UP=upcast_dots(k_all.dtype),
            **launch_options(LAUNCH, "psi", k_all.dtype, 1))
        # the kernel logits' gradient is an attention backward: queries and keys k, values U, dO = -b psi, O = r
        dt = k_all.dtype
        do = -(beta[..., None].float() * psi)
        dq, dk, du_kernel, _ = fox_backward(k_all[:, T0:].contiguous(), k_all, U.to(dt), _zero_gates(k_all, H),
                                            r.to(dt), lse, do, ctx.scale, 0, strict=True)
        dk = dk.clone()
        dk[:, T0:] += dq
        dbeta = -(psi * r).sum(-1)
        du_cache = dU[:, :T0] + du_kernel[:, :T0].float()
        return dk, psi.to(ctx.v_dtype), dbeta.to(beta.dtype), du_cache, None


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
    U = _Solve.apply(k_all, v.to(dt).contiguous(), beta.float().contiguous(), u_cache, float(scale))
    o, _ = _FoxFunction.apply(q.to(dt).contiguous(), k_all, U.to(dt), _zero_gates(k_all, H), float(scale), 0)
    state = None
    if output_final_state:
        keys = k.to(sdt) if initial_state is None else torch.cat([initial_state.k.to(sdt), k.to(sdt)], dim=1)
        state = KVCache(keys, U.to(sdt))
    return o.to(in_dtype), state


TRITON_BACKENDS = {"deltaformer": deltaformer_triton}
