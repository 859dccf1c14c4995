"""linear_attn: linear attention with a feature map and an optional normaliser, no decay.

    S_t = S_{t-1} + phi(k_t) v_t^T,      o_t = S_t^T (scale * phi(q_t))

and with ``normalize=True``

    z_t = z_{t-1} + phi(k_t),            o_t = S_t^T phi(q_t) / (z_t^T phi(q_t) + eps).

The normaliser lives in the state as one extra value column: the state is [B, H, M, V + 1] with
S = state[..., :V] and z = state[..., V] (M is the feature dimension, see ``feature_maps``). Every
PyTorch backend is simple_gla's with g = 0 applied to (phi(q), phi(k), [v, 1]), in float32 (float64
for float64 inputs); the division runs in that dtype too. ``scale`` multiplies phi(q), so with the
normaliser it cancels up to eps. The triton backend (``triton.py``) runs simple_gla's kernels on the
features in the input's dtype and computes the normaliser with its own float32 kernels.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..common.checks import (
    check_chunk_size,
    check_devices,
    check_qkv,
    check_shape,
    check_step_qkv,
    compute_dtype,
    resolve_scale,
)
from ..common.registry import OpSpec, register_op
from ..common.triton_step import check_inplace, select_step
from ..common.values import check_bool
from ..common.varlen import packable
from ..simple_gla.api import SPEC as SIMPLE_GLA_SPEC
from ..simple_gla.reference import simple_gla_step_reference
from .feature_maps import apply_feature_map, resolve_feature_map


def _features(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, feature_map: str, W: torch.Tensor | None,
              normalize: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """phi(q), phi(k) and v (with a ones column when normalising), all in the compute dtype."""
    dt = compute_dtype(q)
    q, k, v = (x.to(dt) for x in (q, k, v))
    if normalize:
        v = torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)
    return apply_feature_map(q, feature_map, W), apply_feature_map(k, feature_map, W), v


def _read(o: torch.Tensor, normalize: bool, eps: float) -> torch.Tensor:
    """Split the normaliser column off and divide (identity when not normalising)."""
    return o[..., :-1] / (o[..., -1:] + eps) if normalize else o


def _on_simple_gla(impl: Callable) -> Callable:
    """Turn a simple_gla implementation into a linear_attn one (features, g = 0, normaliser)."""

    def linear_attn_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, feature_map: str,
                         feature_map_weight: torch.Tensor | None, normalize: bool, eps: float, **kwargs) -> tuple:
        fq, fk, fv = _features(q, k, v, feature_map, feature_map_weight, normalize)
        o, S = impl(fq, fk, fv, fq.new_zeros(fq.shape[:3]), **kwargs)
        return _read(o, normalize, eps).to(q.dtype), S

    linear_attn_impl.__name__ = linear_attn_impl.__qualname__ = (
        f"linear_attn_{impl.__name__.removeprefix('simple_gla_')}"
    )
    return linear_attn_impl


SPEC = register_op(
    OpSpec(
        name="linear_attn",
        family="decay",
        equation=(
            "S_t = S_{t-1} + phi(k_t) v_t^T;  o_t = S_t^T phi(q_t)  [/ (z_t^T phi(q_t) + eps), z_t = sum phi(k_s)]"
        ),
        op_args=(),
        state_shape="[B, H, M, V] ([B, H, M, V + 1] with normalize=True: z is the last column)",
        implementations={name: _on_simple_gla(fn) for name, fn in SIMPLE_GLA_SPEC.implementations.items()},
        notes="feature_map: identity, elu (elu+1), relu, performer, fourier; M = K, or m / 2m for random features",
    )
)


def _check_normalize(normalize: object, eps: object) -> None:
    if not isinstance(normalize, bool):
        raise TypeError(f"normalize must be a bool, got {type(normalize).__name__}")
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not eps >= 0:
        raise ValueError(f"eps must be a float >= 0, got {eps!r}")


@packable("q", "k", "v")
def linear_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    feature_map: str = "identity",
    feature_map_weight: torch.Tensor | None = None,
    num_features: int | None = None,
    feature_map_seed: int = 0,
    normalize: bool = False,
    eps: float = 1e-6,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    backend: str = "auto",
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Linear attention (Katharopoulos et al., 2020) with a feature map and an optional normaliser.

    S_t = S_{t-1} + phi(k_t) v_t^T,   o_t = S_t^T (scale phi(q_t));
    normalize=True: o_t = S_t^T phi(q_t) / (z_t^T phi(q_t) + eps), z_t = sum_{s <= t} phi(k_s).

    Args: q, k [B, T, H, K]; v [B, T, H, V]; feature_map "identity", "elu" (elu + 1), "relu",
    "performer" (exp(W x - |x|^2/2) / sqrt(m)) or "fourier" ([cos W x, sin W x] / sqrt(m));
    feature_map_weight W [m, K] or [H, m, K] for the random maps (default: drawn from
    feature_map_seed, [num_features (default K), K], N(0, 1)); normalize, eps; initial_state
    [B, H, M, V] ([B, H, M, V + 1] with normalize: z is the last column), M = K, m (performer) or
    2m (fourier); backend "recurrent", "parallel", "chunk" or "auto" (triton on CUDA, else chunk).
    Returns (o [B, T, H, V] in q's dtype, final state float32 or None). For the performer map to
    estimate softmax attention exp(q.k / sqrt(K)), pass q and k multiplied by K^-1/4 and scale=1.
    """
    d = check_qkv(q, k, v)
    check_devices("q", q, feature_map_weight=feature_map_weight, initial_state=initial_state)
    check_bool("output_final_state", output_final_state)
    W, M = resolve_feature_map(feature_map, feature_map_weight, num_features, feature_map_seed, d.K, d.H)
    _check_normalize(normalize, eps)
    if initial_state is not None:
        Vs = d.V + int(normalize)
        check_shape("initial_state", initial_state, (d.B, d.H, M, Vs), "[B, H, M, V + 1]" if normalize else
                    "[B, H, M, V]")
    check_chunk_size(chunk_size)
    impl = SPEC.resolve(backend, q.device)
    return impl(
        q, k, v,
        feature_map=feature_map,
        feature_map_weight=W,
        normalize=normalize,
        eps=float(eps),
        scale=resolve_scale(scale, d.K),
        initial_state=initial_state,
        output_final_state=output_final_state,
        chunk_size=chunk_size,
    )


def linear_attn_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    state: torch.Tensor | None = None,
    feature_map: str = "identity",
    feature_map_weight: torch.Tensor | None = None,
    num_features: int | None = None,
    feature_map_seed: int = 0,
    normalize: bool = False,
    eps: float = 1e-6,
    scale: float | None = None,
    inplace: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decoding step of :func:`linear_attn` (same feature-map keywords): one token's q, k
    [B, H, K], v [B, H, V]; state [B, H, M, V] ([B, H, M, V + 1] with normalize).

    S = S + phi(k_t) v_t^T,  o_t = S^T (scale phi(q_t))  [/ (z^T phi(q_t) + eps)].
    ``inplace=True`` writes the new state into ``state`` (a tensor) and returns it (static decoding).
    """
    d = check_step_qkv(q, k, v)
    check_devices("q", q, feature_map_weight=feature_map_weight, state=state)
    W, M = resolve_feature_map(feature_map, feature_map_weight, num_features, feature_map_seed, d.K, d.H)
    _check_normalize(normalize, eps)
    if state is not None:
        check_shape("state", state, (d.B, d.H, M, d.V + int(normalize)),
                    "[B, H, M, V + 1]" if normalize else "[B, H, M, V]")
    fq, fk, fv = _features(q, k, v, feature_map, W, normalize)
    g = fq.new_zeros(d.B, d.H)
    check_inplace(inplace, state)
    step = select_step("simple_gla", simple_gla_step_reference, fq, fk, fv, g, state,
                       inplace=inplace)  # fused kernel on CUDA
    o_t, S = step(fq, fk, fv, g, state, scale=resolve_scale(scale, d.K))
    return _read(o_t, normalize, float(eps)).to(q.dtype), S


def linear_attn_example_inputs(
    B: int, T: int, H: int, K: int, V: int, *, dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu", seed: int = 0, g_value: float | None = None,
) -> dict[str, torch.Tensor]:
    """Random q, k, v (``g_value`` is ignored: linear_attn has no decay)."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, T, H, d, generator=gen) for d in (K, K, V))
    return {name: x.to(device=device, dtype=dtype) for name, x in dict(q=q, k=k, v=v).items()}


SPEC.fn = linear_attn
SPEC.example_inputs = linear_attn_example_inputs
SPEC.step = linear_attn_step
