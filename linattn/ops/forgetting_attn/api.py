"""Public entry points of forgetting_attn (FoX): validation, backend dispatch, registry entry.

FoX (Lin et al. 2025, arXiv 2503.02130) adds a data-dependent ALiBi to causal softmax attention:

    o_t = sum_{s <= t} softmax_s(q_t . k_s scale + G_t - G_s) v_s,   G_t = sum_{r <= t} g_r,

with g = log f <= 0 the log forget gate of each query head (f = sigmoid(w^T x + b) in the paper), so the
weight of key s decays by prod_{r=s+1..t} f_r. g = 0 is plain causal softmax attention. The backends are
those of softmax_attn (common/blockwise_softmax.py forms the bias from in-block differences of gates).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..common.checks import check_chunk_size, check_devices, check_shape, resolve_scale
from ..common.kv_cache import KVCache
from ..common.positions import rope_config
from ..common.registry import OpSpec, register_op
from ..common.values import check_bool, check_log_decay
from ..common.varlen import packable
from ..softmax_attn.checks import check_grouped_qkv, check_kv_cache, check_window_size
from ..softmax_attn.core import run_attention

EXTRAS = {"g": "[B, T0, H]"}


def _implementation(backend: str) -> Callable:
    def impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, *, scale: float,
             window_size: int | None = None, rope: dict | None = None, initial_state: KVCache | None = None,
             output_final_state: bool = False, chunk_size: int = 64) -> tuple[torch.Tensor, KVCache | None]:
        return run_attention(backend, q, k, v, g, scale=scale, causal=True, window_size=window_size, rope=rope,
                             alibi=False, initial_state=initial_state, output_final_state=output_final_state,
                             chunk_size=chunk_size)

    impl.__name__ = impl.__qualname__ = f"forgetting_attn_{backend}"
    impl.__doc__ = f"forgetting_attn through the {backend!r} kernel (inputs validated by :func:`forgetting_attn`)."
    return impl


SPEC = register_op(
    OpSpec(
        name="forgetting_attn",
        family="softmax",
        equation="o_t = sum_{s<=t} softmax_s(q_t.k_s scale + G_t - G_s) v_s,  G = cumsum(g)",
        op_args=("g",),
        state_shape="KVCache(k [B, T0, H_kv, K], v [B, T0, H_kv, V], extras g [B, T0, H])",
        implementations={b: _implementation(b) for b in ("recurrent", "parallel", "chunk")},
        notes="FoX, arXiv 2503.02130: data-dependent ALiBi. recurrent = explicit masked softmax; parallel = SDPA "
              "with an additive mask; chunk = blockwise online softmax (in-block gate differences).",
    )
)


def _check_options(window_size: object, rope: object, K: int) -> None:
    check_window_size(window_size)
    if rope_config(rope) is not None and K % 2:
        raise ValueError(f"rope needs an even head dim K, got K = {K}")


@packable("q", "k", "v", "g")
def forgetting_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    *,
    scale: float | None = None,
    window_size: int | None = None,
    rope: dict | None = None,
    initial_state: KVCache | None = None,
    output_final_state: bool = False,
    backend: str = "auto",
    chunk_size: int = 64,
) -> tuple[torch.Tensor, KVCache | None]:
    """Forgetting attention (FoX): causal softmax attention with a data-dependent decay bias.

    o_t = sum_{s <= t} softmax_s(q_t . k_s scale + G_t - G_s) v_s,  G_t = sum_{r <= t} g_r (over the cached
    and the new positions), keys limited to the last ``window_size`` (itself included) when given.

    Args: q [B, T, H, K]; k [B, T, H_kv, K]; v [B, T, H_kv, V] with H_kv dividing H (grouped-query
    attention); g [B, T, H] log forget gates (<= 0; g = 0 is softmax_attn); scale defaults to K^-1/2;
    rope: None (FoX's default) or dict(theta=..., interpolation_factor=..., ntk_factor=...); initial_state:
    a :class:`KVCache` with extras {"g": [B, T0, H]}. backend: "recurrent" (explicit masked softmax),
    "parallel" (SDPA with an additive mask), "chunk" (blockwise online softmax), "auto". Returns
    (o [B, T, H, V] in q's dtype, the cache with this call's k, v, g appended or None).
    """
    d, H_kv = check_grouped_qkv(q, k, v)
    check_devices("q", q, g=g, initial_state=initial_state)
    check_shape("g", g, (d.B, d.T, d.H), "[B, T, H]")
    check_log_decay("g", g)
    _check_options(window_size, rope, d.K)
    check_kv_cache("initial_state", initial_state, d, H_kv, EXTRAS, q.device)
    check_bool("output_final_state", output_final_state)
    check_chunk_size(chunk_size)
    impl = SPEC.resolve(backend, q.device)
    return impl(q, k, v, g, scale=resolve_scale(scale, d.K), window_size=window_size, rope=rope,
                initial_state=initial_state, output_final_state=output_final_state, chunk_size=chunk_size)


def forgetting_attn_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    *,
    state: KVCache | None = None,
    scale: float | None = None,
    window_size: int | None = None,
    rope: dict | None = None,
) -> tuple[torch.Tensor, KVCache]:
    """One decoding step of :func:`forgetting_attn`: append token t's k, v, g to the cache, then
    o_t = sum_{s <= t} softmax_s(q_t . k_s scale + G_t - G_s) v_s. One token's q [B, H, K], k [B, H_kv, K],
    v [B, H_kv, V], g [B, H]; returns (o_t [B, H, V], the cache one token longer)."""
    d, H_kv = check_grouped_qkv(q, k, v, step=True)
    check_devices("q", q, g=g, state=state)
    check_shape("g", g, (d.B, d.H), "[B, H]")
    check_log_decay("g", g)
    _check_options(window_size, rope, d.K)
    check_kv_cache("state", state, d, H_kv, EXTRAS, q.device)
    # on CUDA the Triton kernel (one launch, no host synchronisation), else the explicit softmax
    impl = SPEC.implementations["triton" if q.is_cuda and "triton" in SPEC.implementations else "recurrent"]
    o, cache = impl(q[:, None], k[:, None], v[:, None], g[:, None], scale=resolve_scale(scale, d.K),
                    window_size=window_size, rope=rope, initial_state=state, output_final_state=True)
    return o[:, 0], cache


def forgetting_attn_example_inputs(
    B: int, T: int, H: int, K: int, V: int, *, dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu", seed: int = 0, g_value: float | None = None,
) -> dict[str, torch.Tensor]:
    """Random q, k, v and log forget gates g = logsigmoid(N(3, 1)) (forget gates around sigmoid(3) = 0.95),
    or all ``g_value``, for tests and benchmarks."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, T, H, n, generator=gen) for n in (K, K, V))
    if g_value is None:
        g = torch.nn.functional.logsigmoid(3.0 + torch.randn(B, T, H, generator=gen))
    else:
        g = torch.full((B, T, H), float(g_value))
    return {name: x.to(device=device, dtype=dtype) for name, x in dict(q=q, k=k, v=v, g=g).items()}


SPEC.fn = forgetting_attn
SPEC.step = forgetting_attn_step
SPEC.example_inputs = forgetting_attn_example_inputs
