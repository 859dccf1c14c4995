"""Chunkwise DeltaFormer: the triangular solve chunk by chunk (hand-written backward), then blockwise SDPA.

For the chunk of rows [a, a + C) (a counts the cached positions too) the kernel rows
kappa_t. (softmax over keys s < t) are computed against all keys [0, a + C) at once; the solve

    U_c = (I + diag(b_c) kappa_cc)^-1 (V_c - diag(b_c) kappa_c,past U_past)

needs only the previous chunks' u's, as one matmul. Then Q attends over (K, U) with causal SDPA in the
input dtype (flash / memory-efficient kernels: memory linear in T).

The solve is a :class:`torch.autograd.Function` that saves only U, the kernel rows' log-normalisers
lse_t and m_t = sum_{s<t} kappa_ts u_s (so u_t = v_t - b_t m_t), and recomputes each chunk's kernel
rows in the backward. With psi = (I + A)^-T dU (solved chunk by chunk backwards in time, the later
chunks' sum_{r} A_rs psi_r carried in one [P, V] buffer):

    dv_t = psi_t,   db_t = -psi_t.m_t,   dl_ts = -b_t kappa_ts psi_t.(u_s - m_t),   l_ts = scale k_t.k_s

so training memory is linear in T too: O((T0 + T)(K + V)) plus one C x (T0 + T) block at a time.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..common.causal_softmax import ChunkMasks
from ..common.checks import compute_dtype
from ..common.kv_cache import KVCache
from ..common.masking import confined_attention, tril_matmul
from ..common.triangular import solve_unit_lower
from .reference import _past


def _kernel_rows(keys: torch.Tensor, start: int, end: int, scale: float, lse: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """kappa rows of positions [start, end) over keys [0, end) (strictly causal), and their log-normaliser.

    In place on one [rows, end] buffer (this runs inside an autograd.Function): only the last
    rows x rows block needs the causal mask, the keys before ``start`` are all in the past.
    """
    rows = end - start
    logits = (keys[:, :, start:end] @ keys[:, :, :end].transpose(-1, -2)).mul_(scale)
    diag = torch.ones(rows, rows, dtype=torch.bool, device=keys.device).triu()
    logits[..., start:].masked_fill_(diag, float("-inf"))
    if lse is None:
        lse = torch.logsumexp(logits, dim=-1)
        lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))  # a row with no past: kappa = 0
    return logits.sub_(lse[..., None]).exp_(), lse


class _DeltaValues(torch.autograd.Function):
    """(keys [B, H, T0 + T, K], v [B, H, T, V], b [B, H, T], u0 [B, H, T0, V]) -> all u's [B, H, T0 + T, V]."""

    @staticmethod
    def forward(ctx, keys, v, b, u0, scale, C):
        T0, T = u0.shape[2], v.shape[2]
        U = torch.cat([u0, torch.empty_like(v)], dim=2)
        m, lse = torch.empty_like(v), torch.empty_like(b)
        for a in range(0, T, C):
            e = min(a + C, T)
            s0, s1 = T0 + a, T0 + e
            kappa, lse[:, :, a:e] = _kernel_rows(keys, s0, s1, scale)
            m_past = kappa[..., :s0] @ U[:, :, :s0]
            U[:, :, s0:s1] = solve_unit_lower(b[:, :, a:e, None] * kappa[..., s0:],
                                              v[:, :, a:e] - b[:, :, a:e, None] * m_past)
            m[:, :, a:e] = m_past + tril_matmul(kappa[..., s0:], U[:, :, s0:s1])
        ctx.save_for_backward(keys, b, U, m, lse)
        ctx.scale, ctx.C = scale, C
        return U

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dU):
        keys, b, U, m, lse = ctx.saved_tensors
        scale, C = ctx.scale, ctx.C
        T = b.shape[2]
        P = keys.shape[2]
        T0 = P - T
        later = torch.zeros_like(U)  # later[s] = sum over rows r of later chunks of A_rs psi_r
        dK, dv, db = torch.zeros_like(keys), torch.empty_like(U[:, :, T0:]), torch.empty_like(b)
        for a in reversed(range(0, T, C)):
            e = min(a + C, T)
            s0, s1 = T0 + a, T0 + e
            kappa, _ = _kernel_rows(keys, s0, s1, scale, lse[:, :, a:e])
            bc = b[:, :, a:e, None]
            psi = torch.linalg.solve_triangular((bc * kappa[..., s0:]).transpose(-1, -2),
                                                dU[:, :, s0:s1] - later[:, :, s0:s1], upper=True, unitriangular=True)
            later[:, :, :s0] += kappa[..., :s0].transpose(-1, -2) @ (bc * psi)
            psi_m = (psi * m[:, :, a:e]).sum(-1, keepdim=True)
            dv[:, :, a:e], db[:, :, a:e] = psi, -psi_m[..., 0]
            dl = (psi @ U[:, :, :s1].transpose(-1, -2)).sub_(psi_m).mul_(kappa).mul_(-scale * bc)
            dK[:, :, s0:s1] += dl @ keys[:, :, :s1]
            dK[:, :, :s1] += dl.transpose(-1, -2) @ keys[:, :, s0:s1]
        return dK, dv, db, dU[:, :, :T0] - later[:, :, :T0], None, None


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, T0: int, C: int, scale: float) -> torch.Tensor:
    """Causal SDPA of q [B, H, T, K] (the last T of the P = T0 + T positions) over k, v [B, H, P, *].

    Runs in the input dtype (bf16 inputs: SDPA's flash kernels, float32 accumulation). Without a cache
    one call with ``is_causal``; with one, query blocks of C with additive causal masks that are views
    of one shared tensor (a bool mask would be converted to a new float tensor and saved per call).
    """
    if T0 == 0:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    T, P = q.shape[2], k.shape[2]
    masks = ChunkMasks(C, P, device=q.device, dtype=q.dtype)
    blocks = []
    for a in range(0, T, C):
        e = min(a + C, T)
        blocks.append(F.scaled_dot_product_attention(q[:, :, a:e], k[:, :, :T0 + e], v[:, :, :T0 + e],
                                                     attn_mask=masks(T0 + e, e - a), scale=scale))
    return torch.cat(blocks, dim=2)


def deltaformer_chunk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float,
    initial_state: KVCache | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, KVCache | None]:
    """Chunkwise-parallel DeltaFormer (see the module docstring); any T, any device."""
    dt, in_dtype = compute_dtype(q), q.dtype
    q, k, v, beta = (x.to(dt) for x in (q, k, v, beta))
    k0, u0 = _past(initial_state, k, v.shape[-1], dt)
    T0, C = k0.shape[1], chunk_size
    keys = torch.cat([k0, k], dim=1).transpose(1, 2)  # [B, H, P, K]
    qh, vh = q.transpose(1, 2), v.transpose(1, 2)
    us = _DeltaValues.apply(keys, vh, beta.transpose(1, 2), u0.transpose(1, 2), scale, C)  # [B, H, P, V]
    o = confined_attention(lambda q_, k_, v_: _attend(q_, k_, v_, T0, C, scale),
                           qh.to(in_dtype), keys.to(in_dtype), us.to(in_dtype)).transpose(1, 2)
    state = KVCache(keys.transpose(1, 2), us.transpose(1, 2)) if output_final_state else None
    return o, state
