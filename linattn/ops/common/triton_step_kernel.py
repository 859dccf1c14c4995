"""Fused Triton kernel for one decoding step of the matrix-state linear RNNs (import only with Triton).

For one token and one head, with S the state [K, V] (float32), a_t the decay and b_t the step size:

    decay:   S <- a_t ⊙ S          a_t = exp(g_t): a scalar (simple_gla, retention), a vector on the
                                   key dimension (gla: row i of S times exp(g_t[i])), or 1 (no gate)
    update:  u = v_t                              (additive: simple_gla, gla, linear_attn)
             u = b_t (v_t - S^T k_t)              (delta correction: delta_rule, gated_delta_rule)
             S <- S + k_t u^T
    read:    o_t = S^T (scale q_t)

The decay is applied before the correction, so the delta rule reads the decayed state (exp(g_t)
(I - b_t k_t k_t^T) S + b_t k_t v_t^T expanded). One program per (value block, batch * head) holds
the [K, BV] tile of S in registers: the state is read once and written once, and the value blocks
are independent (S^T k_t for a block needs only that block's columns). All arithmetic is float32;
q, k, v, g, beta may be float32, bfloat16 or float16, and only exp(g_t) with g_t <= 0 is taken.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_compat import patch_interpreter
from .triton_launch import fast_launch
from .triton_utils import block, block_and_index, cdiv

patch_interpreter()

GATES = {"none": 0, "scalar": 1, "vector": 2}
# Launch settings (one compiled kernel per family, head dims and value block; batch size and heads are not
# specialised). BV = 16 gives B*H*V/16 programs: 128 for B=1, H=16, V=128, about one per SM of an H100, where
# one step is latency-bound; `python -m linattn.bench.decode_step --sweep` times the alternatives.
LAUNCH = {"BV": 16, "num_warps": 4, "max_tile": 8192}


@fast_launch
@triton.jit
def _step_kernel(q, k, v, g, beta, s_in, s_out, o, scale, H,
                 sq_b, sq_h, sk_b, sk_h, sv_b, sv_h, sg_b, sg_h, sb_b, sb_h,
                 K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                 GATE: tl.constexpr, DELTA: tl.constexpr, HAS_STATE: tl.constexpr):
    """Grid (cdiv(V, BV) * B*H) (triton_utils.block_and_index). Strides s*_b, s*_h are those of the batch and head
    dims (last dim contiguous); the states s_in, s_out and the output o are contiguous [B, H, K, V] and [B, H, V]."""
    i_v, i_bh = block_and_index(tl.cdiv(V, BV))
    i_bh = i_bh.to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    kv = i_bh * K * V + o_k[:, None] * V + o_v[None, :]
    m_kv = m_k[:, None] & m_v[None, :]
    if HAS_STATE:
        S = tl.load(s_in + kv, mask=m_kv, other=0.0).to(tl.float32)
    else:
        S = tl.zeros([BK, BV], dtype=tl.float32)
    k_t = tl.load(k + i_b * sk_b + i_h * sk_h + o_k, mask=m_k, other=0.0).to(tl.float32)
    v_t = tl.load(v + i_b * sv_b + i_h * sv_h + o_v, mask=m_v, other=0.0).to(tl.float32)
    q_t = tl.load(q + i_b * sq_b + i_h * sq_h + o_k, mask=m_k, other=0.0).to(tl.float32) * scale
    if GATE == 1:
        S = S * tl.exp(tl.load(g + i_b * sg_b + i_h * sg_h).to(tl.float32))
    if GATE == 2:
        g_t = tl.load(g + i_b * sg_b + i_h * sg_h + o_k, mask=m_k, other=0.0).to(tl.float32)
        S = S * tl.exp(g_t)[:, None]
    if DELTA:
        b_t = tl.load(beta + i_b * sb_b + i_h * sb_h).to(tl.float32)
        u = b_t * (v_t - tl.sum(S * k_t[:, None], axis=0))
    else:
        u = v_t
    S = S + k_t[:, None] * u[None, :]
    tl.store(s_out + kv, S, mask=m_kv)
    o_t = tl.sum(S * q_t[:, None], axis=0)
    tl.store(o + i_bh * V + o_v, o_t.to(o.dtype.element_ty), mask=m_v)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x with a contiguous last dim (batch and head dims may have any strides, e.g. an expanded gate)."""
    return x if x.dim() < 3 or x.stride(-1) == 1 else x.contiguous()


def _bh_strides(name: str, x: torch.Tensor | None) -> dict[str, int]:
    """The kernel's stride parameters s<name>_b, s<name>_h of x's batch and head dims (0 for an absent x)."""
    b, h = (0, 0) if x is None else (x.stride(0), x.stride(1))
    return {f"s{name}_b": b, f"s{name}_h": h}


def fits(K: int) -> bool:
    """True when a [K, V] state's tile fits the kernel (K <= LAUNCH["max_tile"] / 16, i.e. 512)."""
    return block(K) * 16 <= LAUNCH["max_tile"]


def fused_step(q_t: torch.Tensor, k_t: torch.Tensor, v_t: torch.Tensor, state: torch.Tensor | None, *,
               scale: float, gate: str = "none", g_t: torch.Tensor | None = None,
               beta_t: torch.Tensor | None = None, inplace: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of S <- a_t S (+ delta correction) + k_t u^T, o_t = S^T (scale q_t) in one kernel launch.

    q_t, k_t [B, H, K]; v_t [B, H, V]; g_t [B, H] (gate "scalar") or [B, H, K] ("vector"), log decays;
    beta_t [B, H] turns the delta correction on; state [B, H, K, V] or None (zeros). Inputs are
    validated by the caller (same device, float16/bfloat16/float32). Returns (o_t [B, H, V] in q_t's
    dtype, new state [B, H, K, V] float32). With ``inplace`` the new state is written into ``state`` and
    ``state`` is returned: a contiguous float32 state is read and written by the kernel itself (each program
    loads its [K, BV] tile before it stores it, and no program touches another's tile), any other is copied
    into (static decoding allocates contiguous float32 states, so the copy does not happen there).
    """
    B, H, K = q_t.shape
    V = v_t.shape[-1]
    q_t, k_t, v_t = _rows(q_t), _rows(k_t), _rows(v_t)
    g_t = None if g_t is None else _rows(g_t)
    S_in = None if state is None else state.contiguous()
    if inplace and S_in is not None and S_in is state and state.dtype == torch.float32:
        S_out = state
    else:
        S_out = torch.empty(B, H, K, V, device=q_t.device, dtype=torch.float32)
    o_t = torch.empty(B, H, V, device=q_t.device, dtype=q_t.dtype)
    BK = block(K)
    BV = min(LAUNCH["BV"], block(V), max(16, LAUNCH["max_tile"] // BK))
    _step_kernel[(cdiv(V, BV) * B * H,)](
        q=q_t, k=k_t, v=v_t, g=q_t if g_t is None else g_t, beta=q_t if beta_t is None else beta_t,
        s_in=S_out if S_in is None else S_in, s_out=S_out, o=o_t, scale=float(scale), H=H,
        **_bh_strides("q", q_t), **_bh_strides("k", k_t), **_bh_strides("v", v_t), **_bh_strides("g", g_t),
        **_bh_strides("b", beta_t), K=K, V=V, BK=BK, BV=BV, GATE=GATES[gate], DELTA=beta_t is not None,
        HAS_STATE=S_in is not None, num_warps=LAUNCH["num_warps"])
    if inplace and state is not None and S_out is not state:
        state.copy_(S_out)
        S_out = state
    return o_t, S_out


def simple_gla_step_triton(q_t: torch.Tensor, k_t: torch.Tensor, v_t: torch.Tensor, g_t: torch.Tensor,
                           state: torch.Tensor | None, *, scale: float,
                           inplace: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """S = exp(g_t) S + k_t v_t^T, o_t = S^T (scale q_t); g_t [B, H] (the signature of simple_gla_step_reference;
    ``inplace``: the new state is written into ``state``)."""
    return fused_step(q_t, k_t, v_t, state, scale=scale, gate="scalar", g_t=g_t, inplace=inplace)


def gla_step_triton(q_t: torch.Tensor, k_t: torch.Tensor, v_t: torch.Tensor, g_t: torch.Tensor,
                    state: torch.Tensor | None, *, scale: float,
                    inplace: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """S = diag(exp(g_t)) S + k_t v_t^T, o_t = S^T (scale q_t); g_t [B, H, K] (signature of gla_step_reference;
    ``inplace``: the new state is written into ``state``)."""
    return fused_step(q_t, k_t, v_t, state, scale=scale, gate="vector", g_t=g_t, inplace=inplace)


def gated_delta_step_triton(q_t: torch.Tensor, k_t: torch.Tensor, v_t: torch.Tensor, g_t: torch.Tensor | None,
                            beta_t: torch.Tensor, state: torch.Tensor | None, *, scale: float,
                            inplace: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """S = exp(g_t) S; S = S + b_t k_t (v_t - S^T k_t)^T; o_t = S^T (scale q_t); g_t None: the plain delta rule
    (the signature of gated_delta_step_reference without the read key p_t; ``inplace``: the new state is written
    into ``state``)."""
    return fused_step(q_t, k_t, v_t, state, scale=scale, gate="none" if g_t is None else "scalar", g_t=g_t,
                      beta_t=beta_t, inplace=inplace)


STEP_KERNELS = {"simple_gla": simple_gla_step_triton, "gla": gla_step_triton,
                "gated_delta_rule": gated_delta_step_triton}
