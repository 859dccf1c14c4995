"""Input checks of the softmax-attention family (grouped heads, KV cache, mask options).

Generic for any op whose state is a :class:`~linattn.ops.common.kv_cache.KVCache` (softmax_attn,
forgetting_attn; deltaformer and path_attn may reuse them).
"""

from __future__ import annotations

import torch

from ..common.checks import Dims, _fmt, check_devices, check_float_tensor, check_shape
from ..common.kv_cache import KVCache


def check_grouped_qkv(q: object, k: object, v: object, *, step: bool = False) -> tuple[Dims, int]:
    """q [B, T, H, K], k [B, T, H_kv, K], v [B, T, H_kv, V] with H_kv dividing H (grouped-query
    attention); ``step=True`` checks one decoding step (no T dim). Returns (Dims with H, H_kv)."""
    lay = "[B, H, K]" if step else "[B, T, H, K]"
    kv_lay = ("[B, H_kv, K]", "[B, H_kv, V]") if step else ("[B, T, H_kv, K]", "[B, T, H_kv, V]")
    ndim = 3 if step else 4
    check_float_tensor("q", q, ndim, lay)
    check_float_tensor("k", k, ndim, kv_lay[0])
    check_float_tensor("v", v, ndim, kv_lay[1])
    lead = tuple(q.shape[: ndim - 2])  # (B,) or (B, T)
    H, K, H_kv = q.shape[-2], q.shape[-1], k.shape[-2]
    if tuple(k.shape[: ndim - 2]) != lead or k.shape[-1] != K:
        raise ValueError(f"k must have shape {kv_lay[0]} with {'B' if step else 'B, T'}, K from q "
                         f"{_fmt(q.shape)}, got {_fmt(k.shape)}")
    if tuple(v.shape[: ndim - 1]) != tuple(k.shape[: ndim - 1]):
        raise ValueError(f"v must have shape {kv_lay[1]} with the leading dims of k {_fmt(k.shape)}, "
                         f"got {_fmt(v.shape)}")
    if H_kv < 1 or H % H_kv:
        raise ValueError(f"k, v must have H_kv heads dividing the H = {H} query heads, got H_kv = {H_kv}")
    if K < 1 or v.shape[-1] < 1 or (not step and q.shape[1] < 1):
        raise ValueError(f"q, k, v must be non-empty, got q {_fmt(q.shape)} and v {_fmt(v.shape)}")
    check_devices("q", q, k=k, v=v)
    T = 1 if step else q.shape[1]
    return Dims(q.shape[0], T, H, K, v.shape[-1]), H_kv


def check_kv_cache(name: str, cache: object, d: Dims, H_kv: int, extras: dict[str, str],
                   device: torch.device) -> KVCache | None:
    """None or a :class:`KVCache` on ``device`` with k [B, T0, H_kv, K], v [B, T0, H_kv, V] and exactly the
    ``extras`` (name -> layout; each extra is [B, T0, H])."""
    if cache is None:
        return None
    if not isinstance(cache, KVCache):
        raise TypeError(f"{name} must be None or a KVCache (the softmax family's state), got {type(cache).__name__}")
    T0 = cache.k.shape[1] if isinstance(cache.k, torch.Tensor) and cache.k.dim() == 4 else -1
    check_shape(f"{name}.k", cache.k, (d.B, max(T0, 0), H_kv, d.K), "[B, T0, H_kv, K]")
    check_shape(f"{name}.v", cache.v, (d.B, T0, H_kv, d.V), "[B, T0, H_kv, V]")
    if set(cache.extras) != set(extras):
        raise ValueError(f"{name}.extras must have keys {sorted(extras)}, got {sorted(cache.extras)}")
    for key, layout in extras.items():
        check_shape(f"{name}.extras[{key!r}]", cache.extras[key], (d.B, T0, d.H), layout)
    tensors = [cache.k, cache.v, *cache.extras.values()]
    if any(x.device != device for x in tensors):
        raise ValueError(f"{name} must be on the device of q ({device}), got {[str(x.device) for x in tensors]}")
    return cache


def check_window_size(window_size: object) -> int | None:
    """None (no window) or an int >= 1: the number of most recent keys, itself included, a query sees."""
    if window_size is None:
        return None
    if not isinstance(window_size, int) or isinstance(window_size, bool) or window_size < 1:
        raise ValueError(f"window_size must be None or an int >= 1, got {window_size!r}")
    return window_size
