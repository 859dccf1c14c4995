"""backend="triton" for forgetting_attn (FoX): flash-attention kernels with the cumulative log-gate bias.

    o_t = sum_{s <= t} softmax_s(q_t . k_s scale + G_t - G_s) v_s,   G = cumsum(g) over the cached and new positions

(and s > t - window_size with a sliding window). The kernels are in ``triton_kernels.py``; this module prepares
their inputs (RoPE at the cache's offset, the cache prepended, G as a float64 cumulative sum, which autograd
differentiates into dg = reverse cumulative sum of dG), registers the forward and backward with ``torch.library``
(fake kernels: ``torch.compile(fullgraph=True)`` traces them) and differentiates the pair by an autograd Function
that calls the implementations directly in eager mode (``common/triton_ops.py`` says why). Nothing reads a tensor
on the host, so decoding steps (one query against the cache) do not synchronise.

Memory: the forward keeps q, k, v, G, o and the row log-sum-exp; no Tq x Tk tile exists anywhere. While it runs,
it also holds a cleaned copy of the values its masked blocks can reach (:func:`clean_values`) and the float32
column terms of G (:func:`gate_columns`).
"""

from __future__ import annotations

import torch

from ..common.checks import compute_dtype
from ..common.kv_cache import KVCache
from ..common.positions import apply_rope, rope_config
from ..common.registered_ops import define_op
from ..common.triton_ops import eager_backward, op_function
from ..common.triton_utils import block, cdiv, dot_precision, launch_options, launch_overrides, upcast_dots
from .triton_kernels import (
    fox_clean_values_kernel,
    fox_delta_kernel,
    fox_dkv_kernel,
    fox_dq_kernel,
    fox_fwd_kernel,
    fox_gate_columns_kernel,
)

# Block sizes and warps per kernel, fixed per head size (never per sequence length); "fwd_BM" query rows per
# forward program and "fwd_BN" keys per inner step; "dkv_BN" keys per dK/dV program, "dkv_BM" query rows per step;
# "dq_BM" / "dq_BN" likewise. float32 inputs run unpipelined (stages 1: their tiles take twice the shared memory).
# LINATTN_TRITON_LAUNCH='{"forgetting_attn": {...}}' overrides them.
# Chosen on an H100 (bf16, B4 H16 D128, T 4096 and 16384) by timing each kernel group over block sizes x warps x
# stages with the others fixed: forward 4 warps and 2 stages (13.9 against 18.3 ms at T 16384), dK/dV 4 warps and 3
# stages (fwd+bwd 81 against 107 ms), dQ 128 query rows (89 against 107 ms). With the dK/dV tiles transposed (H200,
# fwd+bwd ms at T 4096 / 16384, one process): 4.81 / 57.35 at these settings, 4.97 / 57.73 with dK/dV at 2 stages,
# 4.87 / 56.77 with 128 keys at 8 warps.
LAUNCH = {"fwd_BM": 128, "fwd_BN": 64, "fwd_warps": 4, "fwd_stages": 2,
          "dkv_BM": 32, "dkv_BN": 64, "dkv_warps": 4, "dkv_stages": 3,
          "dq_BM": 128, "dq_BN": 64, "dq_warps": 8, "dq_stages": 2,
          "delta_BM": 64, "delta_warps": 4, "delta_stages": 1}
launch_overrides("forgetting_attn", LAUNCH)
MAX_HEAD_DIM = 256  # q/k rows and v rows are held whole in registers
CLEAN_ROWS = 32  # value rows per program of fox_clean_values_kernel (memory-bound: any size that fills the GPU)


def _dims(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[int, ...]:
    B, Tq, H, K = q.shape
    return B, Tq, k.shape[1], H, k.shape[2], K, v.shape[-1]


def gate_columns(G: torch.Tensor | None, BN: int) -> torch.Tensor | None:
    """The bias's column terms [B, H, Tk] float32 of G [B, H, Tk] float64 for key blocks of BN keys (None without
    G): formed once per call by a kernel of its own instead of by every program of the attention kernels at each
    key block (triton_kernels.py, ``_gate_terms``)."""
    if G is None:
        return None
    B, H, Tk = G.shape
    Gc = torch.empty(B, H, Tk, device=G.device, dtype=torch.float32)
    fox_gate_columns_kernel[(cdiv(Tk, BN), B * H)](G=G, Gc=Gc, Tk=Tk, BN=BN)
    return Gc


def clean_values(v: torch.Tensor, k0: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(vc [B, Tk - k0, H_kv, V], flags [B, H_kv, Tk - k0] int8) of the values v [B, Tk, H_kv, V] from key k0 on:
    rows holding a NaN or an infinity zeroed in vc and flagged 1 (the forward's masked blocks read these,
    triton_kernels.py, ``_fwd_blocks``)."""
    B, Tk, Hkv, V = v.shape
    vc = v.new_empty(B, Tk - k0, Hkv, V)
    flags = torch.empty(B, Hkv, Tk - k0, device=v.device, dtype=torch.int8)
    if Tk > k0:
        fox_clean_values_kernel[(cdiv(Tk - k0, CLEAN_ROWS), B * Hkv)](
            v=v, vc=vc, flags=flags, Tk=Tk, k0=k0, HKV=Hkv, V=V, BT=CLEAN_ROWS, BV=block(V))
    return vc, flags


def masked_keys_start(Tq: int, Tk: int, window: int, strict: bool, BN: int) -> int:
    """The first key any of the forward's masked blocks (blocks of BN keys) reaches: the first query's diagonal
    block, or with a window its window's first block (triton_kernels.py, ``_key_ranges``; later queries' blocks
    start later). A decoding step's masked keys are the cache's last block or its window's."""
    first_position = Tk - Tq - (1 if strict else 0)
    if window > 0:
        return max(0, first_position - window + 1) // BN * BN
    return max(0, (first_position + 1) // BN * BN)


def fox_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, G: torch.Tensor | None, scale: float,
                window: int, strict: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """o [B, Tq, H, V] (q's dtype) and the base-2 row log-sum-exp [B, H, Tq] (float32). q [B, Tq, H, K],
    k [B, Tk, H_kv, K], v [B, Tk, H_kv, V] contiguous in one dtype; G [B, H, Tk] float64, or None: no gate bias
    (plain causal attention, which the kernels then run without reading a G); window 0: none.
    ``strict``: each query sees the keys strictly before its position (a row seeing none: o = 0, lse = +inf)."""
    B, Tq, Tk, H, Hkv, K, V = _dims(q, k, v)
    o = q.new_empty(B, Tq, H, V)
    lse = q.new_empty(B, H, Tq, dtype=torch.float32)
    # a decoding step (a few queries against a long cache) would leave most of a 128-row block idle
    BM = LAUNCH["fwd_BM"] if Tq > 16 else 16
    BN = LAUNCH["fwd_BN"]
    Gc = gate_columns(G, BN)
    k0 = masked_keys_start(Tq, Tk, window, strict, BN)
    vc, flags = clean_values(v, k0)
    fox_fwd_kernel[(cdiv(Tq, BM), B * H)](
        q=q, k=k, v=v, vc=vc, flags=flags, G=lse if G is None else G, Gc=lse if Gc is None else Gc, o=o, lse=lse,
        scale=scale, Tq=Tq, Tk=Tk, W=window, k0=k0, H=H, HKV=Hkv, K=K, V=V, BM=BM, BN=BN, BK=block(K), BV=block(V),
        HAS_WINDOW=window > 0, HAS_GATE=G is not None, STRICT=strict, PREC=dot_precision(q.dtype),
        UP=upcast_dots(q.dtype), **launch_options(LAUNCH, "fwd", q.dtype, 1))
    return o, lse


def fox_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, G: torch.Tensor | None, o: torch.Tensor,
                 lse: torch.Tensor, do: torch.Tensor, scale: float, window: int, strict: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(dq, dk, dv, dG): dG [B, H, Tk] float64, the gradient of G (row sums minus column sums of dS); None
    without G."""
    B, Tq, Tk, H, Hkv, K, V = _dims(q, k, v)
    do = do.to(q.dtype).contiguous()
    delta = q.new_empty(B, H, Tq, dtype=torch.float32)
    BMd = LAUNCH["delta_BM"]
    fox_delta_kernel[(cdiv(Tq, BMd), B * H)](
        o=o, do=do, delta=delta, Tq=Tq, H=H, V=V, BM=BMd, BV=block(V), **launch_options(LAUNCH, "delta", q.dtype, 1))
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    gated = G is not None
    dG = torch.empty(B, H, Tk, device=q.device, dtype=torch.float64) if gated else None
    # without gates the kernels read no G and write no dG: any tensor stands in for the pointers
    common = dict(scale=scale, Tq=Tq, Tk=Tk, W=window, H=H, HKV=Hkv, K=K, V=V, BK=block(K), BV=block(V),
                  G=G if gated else delta, dG=dG if gated else delta, HAS_WINDOW=window > 0, HAS_GATE=gated,
                  STRICT=strict, PREC=dot_precision(q.dtype), UP=upcast_dots(q.dtype))
    BN = LAUNCH["dkv_BN"]
    fox_dkv_kernel[(cdiv(Tk, BN), B * Hkv)](
        q=q, k=k, v=v, do=do, lse=lse, delta=delta, dk=dk, dv=dv, BM=LAUNCH["dkv_BM"], BN=BN,
        **common, **launch_options(LAUNCH, "dkv", q.dtype, 1))
    BM, BN = LAUNCH["dq_BM"], LAUNCH["dq_BN"]
    Gc = gate_columns(G, BN)
    fox_dq_kernel[(cdiv(Tq, BM), B * H)](
        q=q, k=k, v=v, Gc=delta if Gc is None else Gc, do=do, lse=lse, delta=delta, dq=dq, BM=BM, BN=BN, **common,
        **launch_options(LAUNCH, "dq", q.dtype, 1))
    return dq, dk, dv, dG


def _fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, G: torch.Tensor | None, scale: float, window: int
         ) -> tuple[torch.Tensor, torch.Tensor]:
    return fox_forward(q, k, v, G, scale, window)


def _bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, G: torch.Tensor | None, o: torch.Tensor,
         lse: torch.Tensor, do: torch.Tensor, scale: float, window: int
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """fox_backward as an op returns tensors only: without G, dG is an empty tensor (its gradient is None)."""
    dq, dk, dv, dG = fox_backward(q, k, v, G, o, lse, do, scale, window)
    return dq, dk, dv, _no_gate_gradient(q) if dG is None else dG


def _no_gate_gradient(q: torch.Tensor) -> torch.Tensor:
    return q.new_empty(0, dtype=torch.float64)


def _fwd_fake(q, k, v, G, scale, window):
    B, Tq, H, _ = q.shape
    return q.new_empty(B, Tq, H, v.shape[-1]), q.new_empty(B, H, Tq, dtype=torch.float32)


_fwd_op = define_op("forgetting_attn_triton_fwd", _fwd, _fwd_fake)


def _bwd_fake(q, k, v, G, o, lse, do, scale, window):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), \
        _no_gate_gradient(q) if G is None else torch.empty_like(G)


_bwd_op = define_op("forgetting_attn_triton_bwd", _bwd, _bwd_fake)


def _setup_context(ctx, inputs, output):
    q, k, v, G, scale, window = inputs
    ctx.save_for_backward(q, k, v, G, output[0], output[1])
    ctx.scale, ctx.window = scale, window


def _backward_rule(ctx, do, dlse):
    q, k, v, G, o, lse = ctx.saved_tensors
    run = _bwd if eager_backward(ctx) else _bwd_op
    do = torch.zeros_like(o) if do is None else do
    dq, dk, dv, dG = run(q, k, v, G, o, lse, do, ctx.scale, ctx.window)
    return dq, dk, dv, None if G is None else dG, None, None


_fox_differentiable = op_function("ForgettingAttnTriton", _fwd, _fwd_op, _setup_context, _backward_rule,
                                  non_differentiable=(1,))
KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def fox_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, G: torch.Tensor | None, scale: float,
                  window: int = 0) -> torch.Tensor:
    """Differentiable o of :func:`fox_forward` (kernel dtypes, contiguous; G [B, H, Tk] float64 or None: no gate
    bias): the custom op
    under torch.compile (and for tensor subclasses), the eager autograd Function otherwise."""
    return _fox_differentiable(q, k, v, G, float(scale), int(window))[0]


def forgetting_attn_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, *, scale: float,
                           window_size: int | None = None, rope: dict | None = None,
                           initial_state: KVCache | None = None, output_final_state: bool = False,
                           chunk_size: int = 64) -> tuple[torch.Tensor, KVCache | None]:
    """forgetting_attn through the Triton kernels (inputs validated by :func:`forgetting_attn`; ``chunk_size`` is
    not used: block sizes come from ``LAUNCH``). bf16 / fp16 / float32 inputs run in their dtype (float32
    accumulation), float64 in float32; the output is in q's dtype, the cache in float32 (float64 for float64)."""
    K, V = q.shape[-1], v.shape[-1]
    if K > MAX_HEAD_DIM or V > MAX_HEAD_DIM:
        raise ValueError(f"backend='triton' takes head dims K, V <= {MAX_HEAD_DIM}, got K = {K}, V = {V}")
    in_dtype, sdt = q.dtype, compute_dtype(q)
    dt = in_dtype if in_dtype in KERNEL_DTYPES else torch.float32
    T0 = 0 if initial_state is None else initial_state.length
    cfg = rope_config(rope)
    if cfg is not None:  # rotated in the cache's dtype (as the other backends do), then rounded for the kernels
        q, k = apply_rope(q.to(sdt), T0, **cfg), apply_rope(k.to(sdt), T0, **cfg)
    if initial_state is not None:
        k = torch.cat([initial_state.k.to(sdt), k.to(sdt)], dim=1)
        v = torch.cat([initial_state.v.to(sdt), v.to(sdt)], dim=1)
        g = torch.cat([initial_state.extras["g"].to(sdt), g.to(sdt)], dim=1)
    # G along the last dim ([B, H, Tk]): autograd's reverse cumulative sum then runs along it too (fast on a GPU)
    G = torch.cumsum(g.transpose(1, 2).to(torch.float64), dim=-1)
    o = fox_attention(*(x.to(dt).contiguous() for x in (q, k, v)), G, scale, window_size or 0)
    state = KVCache(k.to(sdt), v.to(sdt), {"g": g.to(sdt)}) if output_final_state else None
    return o.to(in_dtype), state


TRITON_BACKENDS = {"forgetting_attn": forgetting_attn_triton}
