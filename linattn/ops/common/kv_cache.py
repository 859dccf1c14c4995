"""The state of the softmax family: a cache of past keys and values.

For softmax_attn, forgetting_attn, deltaformer and path_attn, ``initial_state`` and the returned
final state are a :class:`KVCache` rather than a [B, H, K, V] matrix: running [0:t] then [t:T] with
the cache carried equals running [0:T], and decoding appends one token at a time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class KVCache:
    """Past keys ``k`` [B, T0, H_kv, K] and values ``v`` [B, T0, H_kv, V] (float32 or float64), plus
    op-specific ``extras``: tensors with time at dim 1 (e.g. FoX's log forget gates [B, T0, H]),
    concatenated along time by :meth:`append`."""

    k: torch.Tensor
    v: torch.Tensor
    extras: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def length(self) -> int:
        """Number of cached positions T0."""
        return int(self.k.shape[1])

    def append(self, k: torch.Tensor, v: torch.Tensor, **extras: torch.Tensor) -> KVCache:
        """A new cache with ``k``, ``v`` [B, t, H_kv, *] (and the same extras keys) added at the end."""
        if set(extras) != set(self.extras):
            raise ValueError(f"KVCache.append needs extras {sorted(self.extras)}, got {sorted(extras)}")
        dt = self.k.dtype
        return KVCache(
            torch.cat([self.k, k.to(dt)], dim=1),
            torch.cat([self.v, v.to(dt)], dim=1),
            {name: torch.cat([x, extras[name].to(x.dtype)], dim=1) for name, x in self.extras.items()},
        )
