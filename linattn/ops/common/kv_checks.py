"""Validation of a :class:`KVCache` passed as ``initial_state`` / ``state`` to a softmax-family op."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .checks import Dims, check_float_tensor
from .kv_cache import KVCache


def _fmt(shape: Sequence[int]) -> str:
    return "[" + ", ".join(str(s) for s in shape) + "]"


def check_kv_cache(name: str, cache: object, d: Dims, extras: Sequence[str] = (),
                   device: torch.device | None = None) -> KVCache | None:
    """``None`` or a KVCache with k [B, T0, H, K], v [B, T0, H, V] and exactly the ``extras`` [B, T0, H],
    all on ``device`` (the inputs' device) when given."""
    if cache is None:
        return None
    if not isinstance(cache, KVCache):
        raise TypeError(f"{name} must be a linattn KVCache or None, got {type(cache).__name__}")
    check_float_tensor(f"{name}.k", cache.k, 4, "[B, T0, H, K]")
    check_float_tensor(f"{name}.v", cache.v, 4, "[B, T0, H, V]")
    T0 = cache.k.shape[1]
    if tuple(cache.k.shape) != (d.B, T0, d.H, d.K):
        raise ValueError(f"{name}.k must have shape [B, T0, H, K] = {_fmt((d.B, 'T0', d.H, d.K))}, "
                         f"got {_fmt(cache.k.shape)}")
    if tuple(cache.v.shape) != (d.B, T0, d.H, d.V):
        raise ValueError(f"{name}.v must have shape [B, T0, H, V] = {_fmt((d.B, T0, d.H, d.V))}, "
                         f"got {_fmt(cache.v.shape)}")
    if set(cache.extras) != set(extras):
        raise ValueError(f"{name} must carry extras {sorted(extras)}, got {sorted(cache.extras)}")
    for key in extras:
        x = check_float_tensor(f"{name}.extras[{key!r}]", cache.extras[key], 3, "[B, T0, H]")
        if tuple(x.shape) != (d.B, T0, d.H):
            raise ValueError(f"{name}.extras[{key!r}] must have shape [B, T0, H] = {_fmt((d.B, T0, d.H))}, "
                             f"got {_fmt(x.shape)}")
    devices = {t.device for t in (cache.k, cache.v, *cache.extras.values())}
    if len(devices) != 1 or (device is not None and devices != {device}):
        raise ValueError(f"{name} tensors must be on the inputs' device {device}, got {sorted(map(str, devices))}")
    return cache
