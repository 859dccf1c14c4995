"""Public entry points of path_attn: validation, backend dispatch, registry entry."""

from __future__ import annotations

import torch

from ..common.checks import (
    check_chunk_size,
    check_devices,
    check_qkv,
    check_scalar_gate,
    check_shape,
    check_step_qkv,
    check_vector_gate,
    resolve_scale,
)
from ..common.kv_cache import KVCache
from ..common.kv_checks import check_kv_cache
from ..common.registry import OpSpec, register_op
from ..common.values import check_bool, check_log_decay
from ..common.varlen import packable
from .chunk import path_attn_chunk
from .reference import path_attn_parallel, path_attn_recurrent

EQUATION = ("logit_ts = scale (q_t^T (prod_{r=t..s+1} (I - b_r w_r w_r^T)) k_s + G_t - G_s);  "
            "o_t = sum_{s<=t} softmax_s(logit_t.) v_s")

SPEC = register_op(
    OpSpec(
        name="path_attn",
        family="softmax",
        equation=EQUATION,
        op_args=("w", "beta", "g"),
        state_shape="KVCache(k = transformed keys [B, T0, H, K], v [B, T0, H, V], extras log_decay [B, T0, H])",
        implementations={"recurrent": path_attn_recurrent, "parallel": path_attn_parallel, "chunk": path_attn_chunk},
        notes="w must be unit-norm (the layer L2-normalises it, as in the paper); beta in (0, 2); arXiv 2505.16381",
    )
)


@packable("q", "k", "v", "w", "beta", "g")
def path_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    w: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    initial_state: KVCache | None = None,
    output_final_state: bool = False,
    backend: str = "auto",
    chunk_size: int = 64,
) -> tuple[torch.Tensor, KVCache | None]:
    """PaTH attention (Yang et al., arXiv 2505.16381): softmax attention with a data-dependent
    Householder position encoding and an optional FoX-style forget gate.

        logit_ts = scale (q_t^T H_t H_{t-1} ... H_{s+1} k_s + G_t - G_s)    (s <= t; H_r = I - b_r w_r w_r^T)
        o_t = sum_{s<=t} softmax_s(logit_t.) v_s,                           G = cumsum(g)

    The gate bias is inside the scale, as in FLA's ``parallel_path_attn`` (its kernel and its PyTorch reference
    ``naive_path_attn``): the same q, k, v, w, beta, g and scale give the same output (tested against FLA's
    reference in float32 where FLA is importable). So the forget bias is FoX's with g scaled: with beta = 0,
    path_attn(g) = forgetting_attn(scale * g), whose bias G_t - G_s is added after the scale.

    ``w`` is used as given: as in the paper, the caller (the layer) L2-normalises it (after its short
    convolution) and sets beta = 2 sigmoid(.) in (0, 2), which makes every H_r an orthogonal-like
    contraction (||H_r|| <= 1); the op does not renormalise, so w = 0 or beta = 0 means "no rotation".
    beta = 0 gives plain causal softmax attention (plus the scaled forget bias when g is given).

    Args: q, k, w [B, T, H, K]; v [B, T, H, V]; beta [B, T, H]; g [B, T, H] log forget gates (<= 0) or
    None; initial_state: a KVCache (keys already moved to the frame of its last position, values,
    extras["log_decay"] = G_end - G_s) continuing a sequence. Returns (o [B, T, H, V] in q's dtype,
    the KVCache at the end (float32, float64 for float64 inputs) or None).
    """
    d = check_qkv(q, k, v)
    check_devices("q", q, w=w, beta=beta, g=g, initial_state=initial_state)
    check_vector_gate("w", w, d)
    check_scalar_gate("beta", beta, d)
    if g is not None:
        check_scalar_gate("g", g, d)
    check_log_decay("g", g)
    check_kv_cache("initial_state", initial_state, d, extras=("log_decay",), device=q.device)
    check_bool("output_final_state", output_final_state)
    check_chunk_size(chunk_size)
    impl = SPEC.resolve(backend, q.device)
    return impl(q, k, v, w, beta, g, scale=resolve_scale(scale, d.K), initial_state=initial_state,
                output_final_state=output_final_state, chunk_size=chunk_size)


def path_attn_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    w: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor | None = None,
    *,
    state: KVCache | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, KVCache]:
    """One decoding step of :func:`path_attn`: one token's q, k, w [B, H, K], v [B, H, V], beta [B, H],
    g [B, H] or None (no forget gate); ``state`` the KVCache so far. Returns (o_t [B, H, V], the updated cache)."""
    d = check_step_qkv(q, k, v)
    check_devices("q", q, w=w, beta=beta, g=g, state=state)
    check_shape("w", w, (d.B, d.H, d.K), "[B, H, K]")
    check_shape("beta", beta, (d.B, d.H), "[B, H]")
    if g is not None:
        check_shape("g", g, (d.B, d.H), "[B, H]")
    check_log_decay("g", g)
    check_kv_cache("state", state, d, extras=("log_decay",), device=q.device)
    o, cache = path_attn_recurrent(q[:, None], k[:, None], v[:, None], w[:, None], beta[:, None],
                                   None if g is None else g[:, None], scale=resolve_scale(scale, d.K),
                                   initial_state=state, output_final_state=True)
    return o[:, 0], cache


def path_attn_example_inputs(
    B: int, T: int, H: int, K: int, V: int, *, dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu", seed: int = 0, g_value: float | None = None,
) -> dict[str, torch.Tensor]:
    """Random q, k, v, unit-norm w, beta = 2 sigmoid(normal) in (0, 2), log forget gates in [-0.5, 0)
    (or all ``g_value``)."""
    gen = torch.Generator().manual_seed(seed)
    q, k, w, v = (torch.randn(B, T, H, n, generator=gen) for n in (K, K, K, V))
    w = w / w.norm(dim=-1, keepdim=True).clamp_min(1e-6)
    beta = 2 * torch.sigmoid(torch.randn(B, T, H, generator=gen))
    g = -0.5 * torch.rand(B, T, H, generator=gen) if g_value is None else torch.full((B, T, H), float(g_value))
    out = dict(q=q, k=k, v=v, w=w, beta=beta, g=g)
    return {name: x.to(device=device, dtype=dtype) for name, x in out.items()}


SPEC.fn = path_attn
SPEC.example_inputs = path_attn_example_inputs
SPEC.step = path_attn_step
