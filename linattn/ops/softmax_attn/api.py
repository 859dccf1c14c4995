"""Public entry points of softmax_attn: validation, backend dispatch, registry entry."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..common.checks import check_chunk_size, check_devices, resolve_scale
from ..common.kv_cache import KVCache
from ..common.positions import rope_config
from ..common.registry import OpSpec, register_op
from ..common.values import check_bool
from ..common.varlen import packable
from .checks import check_grouped_qkv, check_kv_cache, check_window_size
from .core import run_attention

EQUATION = "o_i = sum_j softmax_j(q_i.k_j scale + mask_ij + alibi_ij) v_j  (RoPE on q, k; j over cache + new keys)"


def _implementation(backend: str) -> Callable:
    def impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, causal: bool = True,
             window_size: int | None = None, rope: dict | None = None, alibi: bool = False,
             initial_state: KVCache | None = None, output_final_state: bool = False,
             chunk_size: int = 64) -> tuple[torch.Tensor, KVCache | None]:
        return run_attention(backend, q, k, v, None, scale=scale, causal=causal, window_size=window_size, rope=rope,
                             alibi=alibi, initial_state=initial_state, output_final_state=output_final_state,
                             chunk_size=chunk_size)

    impl.__name__ = impl.__qualname__ = f"softmax_attn_{backend}"
    impl.__doc__ = f"softmax_attn through the {backend!r} kernel (inputs validated by :func:`softmax_attn`)."
    return impl


SPEC = register_op(
    OpSpec(
        name="softmax_attn",
        family="softmax",
        equation=EQUATION,
        op_args=(),
        state_shape="KVCache(k [B, T0, H_kv, K], v [B, T0, H_kv, V])",
        implementations={b: _implementation(b) for b in ("recurrent", "parallel", "chunk")},
        auto_cuda="parallel",  # SDPA (flash attention) on the GPU; the blockwise PyTorch path is for the CPU
        notes="recurrent = explicit masked softmax; parallel = torch SDPA; chunk = blockwise online softmax "
              "(memory T x chunk_size). Keywords causal, window_size, rope, alibi; GQA via H_kv | H. "
              "'auto' is chunk on the CPU and parallel (SDPA) on CUDA.",
    )
)


def _check_options(causal: object, window_size: object, rope: object, alibi: object, K: int) -> None:
    check_bool("causal", causal)
    check_window_size(window_size)
    check_bool("alibi", alibi)
    if rope_config(rope) is not None and K % 2:
        raise ValueError(f"rope needs an even head dim K, got K = {K}")


@packable("q", "k", "v")
def softmax_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float | None = None,
    causal: bool = True,
    window_size: int | None = None,
    rope: dict | None = None,
    alibi: bool = False,
    initial_state: KVCache | None = None,
    output_final_state: bool = False,
    backend: str = "auto",
    chunk_size: int = 64,
) -> tuple[torch.Tensor, KVCache | None]:
    """Softmax attention: O = softmax(Q K^T scale + M + A) V per head.

    o_i = sum_j softmax_j(q_i . k_j scale + M_ij + A_ij) v_j over the cached and the new keys, with
    M_ij = 0 where key j is visible to query i, else -inf (causal: j <= i; window_size w: i - w < j <= i,
    or |i - j| < w when not causal) and A_ij = -slope_h |i - j| with ALiBi (``alibi=True``, standard slopes).
    ``rope``: None or dict(theta=10000, interpolation_factor=1, ntk_factor=1) rotates q and k by their
    absolute positions (see common/positions.py). Positions of this call start at the cache length.

    Args: q [B, T, H, K]; k [B, T, H_kv, K]; v [B, T, H_kv, V], H_kv dividing H (grouped-query attention:
    query head h reads key/value head h // (H / H_kv)); scale defaults to K^-1/2; initial_state: a
    :class:`KVCache` of past (rotated) keys/values. backend: "recurrent" (explicit masked softmax),
    "parallel" (torch scaled_dot_product_attention), "chunk" (blockwise online softmax over key blocks of
    ``chunk_size``), "auto". Returns (o [B, T, H, V] in q's dtype, the cache with this call appended
    (float32, float64 for float64 inputs) or None).
    """
    d, H_kv = check_grouped_qkv(q, k, v)
    check_devices("q", q, initial_state=initial_state)
    _check_options(causal, window_size, rope, alibi, d.K)
    check_kv_cache("initial_state", initial_state, d, H_kv, {}, q.device)
    check_bool("output_final_state", output_final_state)
    check_chunk_size(chunk_size)
    impl = SPEC.resolve(backend, q.device)
    return impl(q, k, v, scale=resolve_scale(scale, d.K), causal=causal, window_size=window_size, rope=rope,
                alibi=alibi, initial_state=initial_state, output_final_state=output_final_state,
                chunk_size=chunk_size)


def softmax_attn_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    state: KVCache | None = None,
    scale: float | None = None,
    causal: bool = True,
    window_size: int | None = None,
    rope: dict | None = None,
    alibi: bool = False,
) -> tuple[torch.Tensor, KVCache]:
    """One decoding step of :func:`softmax_attn` (causal): append token t's k, v to the cache, then
    o_t = sum_j softmax_j(q_t . k_j scale + A_tj) v_j over the cache. One token's q [B, H, K], k [B, H_kv, K],
    v [B, H_kv, V]; ``causal`` must be True (a decoding step sees only the past);
    returns (o_t [B, H, V], the cache one token longer)."""
    d, H_kv = check_grouped_qkv(q, k, v, step=True)
    check_devices("q", q, state=state)
    if causal is not True:
        raise ValueError(f"softmax_attn_step decodes causally: causal must be True, got {causal!r}")
    _check_options(True, window_size, rope, alibi, d.K)
    check_kv_cache("state", state, d, H_kv, {}, q.device)
    o, cache = run_attention("recurrent", q[:, None], k[:, None], v[:, None], None,
                             scale=resolve_scale(scale, d.K), causal=True, window_size=window_size, rope=rope,
                             alibi=alibi, initial_state=state, output_final_state=True, chunk_size=64)
    return o[:, 0], cache


def softmax_attn_example_inputs(
    B: int, T: int, H: int, K: int, V: int, *, dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu", seed: int = 0, g_value: float | None = None,
) -> dict[str, torch.Tensor]:
    """Random q, k, v (H heads for keys and values too) for tests and benchmarks; softmax_attn has no gate,
    so ``g_value`` is ignored."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, T, H, n, generator=gen) for n in (K, K, V))
    return {name: x.to(device=device, dtype=dtype) for name, x in dict(q=q, k=k, v=v).items()}


SPEC.fn = softmax_attn
SPEC.step = softmax_attn_step
SPEC.example_inputs = softmax_attn_example_inputs
