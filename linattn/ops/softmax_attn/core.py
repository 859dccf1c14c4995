"""One call of softmax attention around a kernel: dtype, RoPE and ALiBi at the cache's offset, the KV cache.

Shared by softmax_attn and forgetting_attn (inputs already validated). Keys are cached *after* RoPE
(rotated at their own absolute positions), so a continued call rotates only its own tokens; FoX's
log forget gates are cached in ``extras["g"]``.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch

from ..common.blockwise_softmax import blockwise_attention
from ..common.checks import compute_dtype
from ..common.kv_cache import KVCache
from ..common.masking import (
    attention_guard_skipped,
    confine_attention,
    finite_part,
    fused_guard_applies,
    nonfinite_rows,
)
from ..common.positions import alibi_slopes, apply_rope, rope_config
from .reference import masked_softmax_attention, sdpa_attention

KERNELS: dict[str, Callable[..., torch.Tensor]] = {
    "recurrent": masked_softmax_attention,
    "parallel": sdpa_attention,
    "chunk": blockwise_attention,
}
HALF = (torch.float16, torch.bfloat16)


def run_attention(
    backend: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None,
    *,
    scale: float,
    causal: bool,
    window_size: int | None,
    rope: dict | None,
    alibi: bool,
    initial_state: KVCache | None,
    output_final_state: bool,
    chunk_size: int,
) -> tuple[torch.Tensor, KVCache | None]:
    """Attend q [B, T, H, K] to the cached and the new keys/values with the kernel of ``backend``.

    Math in float32 (float64 for float64 inputs); the "parallel" backend keeps float16/bfloat16 inputs in
    their dtype on CUDA when there is no additive bias (SDPA's fused kernels accumulate in float32).
    Returns (o in q's dtype, the cache with this call's keys/values (and gates) appended, or None).
    """
    dt, in_dtype = compute_dtype(q), q.dtype
    T0 = 0 if initial_state is None else initial_state.length
    q, k, v = (x.to(dt) for x in (q, k, v))
    cfg = rope_config(rope)
    if cfg is not None:
        q, k = apply_rope(q, T0, **cfg), apply_rope(k, T0, **cfg)
    gates = None if g is None else g.to(dt)
    if initial_state is not None:
        k = torch.cat([initial_state.k.to(dt), k], dim=1)
        v = torch.cat([initial_state.v.to(dt), v], dim=1)
        if gates is not None:
            gates = torch.cat([initial_state.extras["g"].to(dt), gates], dim=1)
    slopes = alibi_slopes(q.shape[2]).to(device=q.device, dtype=dt) if alibi else None
    # SDPA's fused CUDA kernels take half inputs (accumulating in float32); an additive bias would be rounded
    # to the half dtype there, so ALiBi / forgetting gates keep the float32 math
    native = backend == "parallel" and in_dtype in HALF and q.is_cuda and gates is None and slopes is None
    run_dt = in_dtype if native else dt
    keys, values = k.to(run_dt), v.to(run_dt)
    kernel = partial(KERNELS[backend], scale=scale, causal=causal, window_size=window_size, alibi_slopes=slopes,
                     log_gates=gates, chunk_size=chunk_size)
    if attention_guard_skipped(keys, values):
        o = kernel(q.to(run_dt), keys, values)
    elif fused_guard_applies(keys, window_size):
        # the same guard in two fused kernels (common/triton_confine.py): eager CUDA, where the PyTorch form's
        # dozen small kernels would cost more than the attention of a short sequence
        from ..common.triton_confine import confine_rows, finite_keys_values

        keys, values, bad = finite_keys_values(keys, values)
        o = confine_rows(kernel(q.to(run_dt), keys, values), bad, causal=causal)
    else:
        # A hidden key's weight is 0, but 0 x NaN = NaN inside P V, and NaN + (-inf) = NaN where a mask is added
        # to the logits (SDPA's float masks): the kernels read the finite part of the keys and values, and the
        # rows that see a non-finite key or value are set to NaN afterwards (common/masking.py).
        o = kernel(q.to(run_dt), finite_part(keys), finite_part(values))
        bad = nonfinite_rows(keys.transpose(1, 2)) | nonfinite_rows(values.transpose(1, 2))  # [B, H_kv, Tk]
        bad = bad.repeat_interleave(q.shape[2] // bad.shape[1], dim=1)  # query head h reads kv head h // group
        o = confine_attention(o.transpose(1, 2), bad, causal=causal, window_size=window_size).transpose(1, 2)
    state = None
    if output_final_state:
        state = KVCache(k, v, {} if gates is None else {"g": gates})
    return o.to(in_dtype), state


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Plain causal softmax attention o [B, T, H, V] of q [B, T, H, K] over k [B, T, H_kv, K], v [B, T, H_kv, V]
    (no cache, gate, window or position bias): SDPA ("parallel") with the confinement guard, the kernel other ops
    hand their plain attention passes to; differentiable."""
    o, _ = run_attention("parallel", q, k, v, None, scale=scale, causal=True, window_size=None, rope=None,
                         alibi=False, initial_state=None, output_final_state=False, chunk_size=64)
    return o
