"""Feature maps phi of linear attention, applied to queries and keys [..., H, K] -> [..., H, M].

* "identity": phi(x) = x (M = K)
* "elu":      phi(x) = elu(x) + 1 (Katharopoulos et al., 2020; M = K)
* "relu":     phi(x) = max(x, 0) (M = K)
* "performer": positive random features phi(x) = exp(W x - |x|^2 / 2) / sqrt(m), W [m, K] with
  rows ~ N(0, I): E[phi(q)^T phi(k)] = exp(q^T k) (Choromanski et al., 2021, FAVOR+; M = m)
* "fourier":  random Fourier features phi(x) = [cos W x, sin W x] / sqrt(m):
  E[phi(q)^T phi(k)] = exp(-|q - k|^2 / 2) (Rahimi & Recht, 2007; M = 2m)

The random projection W is either given (``[m, K]`` shared by all heads, or ``[H, m, K]`` one per
head) or drawn from a seed: i.i.d. N(0, 1) entries, ``[num_features, K]`` shared by all heads,
drawn in float64 on the CPU by ``torch.Generator().manual_seed(seed)`` (the same seed gives the
same W on every device and dtype). The maps are applied in the compute dtype (float32 or float64).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..common.checks import check_choice, check_float_tensor

FEATURE_MAPS = ("identity", "elu", "relu", "performer", "fourier")
RANDOM_FEATURE_MAPS = ("performer", "fourier")


def draw_feature_map_weight(num_features: int, K: int, seed: int) -> torch.Tensor:
    """The random projection W [num_features, K] (float64, N(0, 1) entries) drawn from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(num_features, K, dtype=torch.float64, generator=gen)


def resolve_feature_map(
    feature_map: object, feature_map_weight: object, num_features: object, feature_map_seed: object, K: int, H: int
) -> tuple[torch.Tensor | None, int]:
    """Validate the feature-map arguments; return (W [m, K] or [H, m, K] or None, feature dim M)."""
    check_choice("feature_map", feature_map, FEATURE_MAPS)
    if num_features is not None and (not isinstance(num_features, int) or isinstance(num_features, bool)
                                     or num_features < 1):
        raise ValueError(f"num_features must be a positive int or None, got {num_features!r}")
    if not isinstance(feature_map_seed, int) or isinstance(feature_map_seed, bool):
        raise TypeError(f"feature_map_seed must be an int, got {type(feature_map_seed).__name__}")
    if feature_map not in RANDOM_FEATURE_MAPS:
        if feature_map_weight is not None or num_features is not None:
            raise ValueError(
                f"feature_map_weight and num_features apply to the random feature maps "
                f"{', '.join(repr(m) for m in RANDOM_FEATURE_MAPS)} only; got feature_map={feature_map!r}"
            )
        return None, K
    if feature_map_weight is None:
        W = draw_feature_map_weight(K if num_features is None else num_features, K, feature_map_seed)
    else:
        W = feature_map_weight
        if not isinstance(W, torch.Tensor) or W.dim() not in (2, 3):
            shape = list(W.shape) if isinstance(W, torch.Tensor) else type(W).__name__
            raise ValueError(f"feature_map_weight must have shape [m, K] or [H, m, K] = [H={H}, m, K={K}], got {shape}")
        check_float_tensor("feature_map_weight", W, W.dim(), "[m, K] or [H, m, K]")
        if W.shape[-1] != K or (W.dim() == 3 and W.shape[0] != H):
            raise ValueError(
                f"feature_map_weight must have shape [m, K] or [H, m, K] with H = {H}, K = {K}, got {list(W.shape)}"
            )
        if num_features is not None and W.shape[-2] != num_features:
            raise ValueError(f"num_features={num_features} does not match feature_map_weight's m = {W.shape[-2]}")
    m = W.shape[-2]
    return W, (2 * m if feature_map == "fourier" else m)


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward passes the gradient on contiguous (same values).

    Placed after F.elu: elu's backward kernel lays its result out like the incoming gradient, which the chunk
    backends hand back non-contiguous, while the rule torch.compile traces elu's backward with predicts a
    contiguous result; a compiled backward that views it (backend "aot_eager") then fails at run time. With a
    contiguous incoming gradient both agree. Eager mode copies no more than before: the layer's reshape of the
    gradient made the same copy later."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def apply_feature_map(x: torch.Tensor, feature_map: str, W: torch.Tensor | None) -> torch.Tensor:
    """phi(x) for x [..., H, K] (already in the compute dtype) -> [..., H, M]."""
    if feature_map == "identity":
        return x
    if feature_map == "elu":
        return _ContiguousGrad.apply(F.elu(x)) + 1
    if feature_map == "relu":
        return F.relu(x)
    W = W.to(device=x.device, dtype=x.dtype)
    proj = torch.einsum("...hk,hmk->...hm", x, W.expand(x.shape[-2], *W.shape[-2:]))  # W x per head
    m = W.shape[-2]
    if feature_map == "performer":
        return torch.exp(proj - 0.5 * (x * x).sum(-1, keepdim=True)) / math.sqrt(m)
    return torch.cat([torch.cos(proj), torch.sin(proj)], dim=-1) / math.sqrt(m)
