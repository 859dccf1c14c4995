"""Argument checks shared by the layers (errors name the argument and list the valid choices)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from .cache import LayerCache
from .static_cache import StaticLayerCache

CONV_LETTERS = "qkv"


def check_positive_int(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def check_short_conv(short_conv: object, allowed: str = CONV_LETTERS) -> str:
    """``short_conv`` is a string of distinct letters from ``allowed`` ("" for none)."""
    valid = f"a subset of {allowed!r} such as {allowed[-1]!r} or {allowed!r}, or '' for none"
    if not isinstance(short_conv, str):
        raise ValueError(f"short_conv must be {valid}; got {short_conv!r}")
    bad = sorted(set(short_conv) - set(allowed))
    if bad or len(set(short_conv)) != len(short_conv):
        raise ValueError(f"short_conv must be {valid}; got {short_conv!r}")
    return "".join(c for c in allowed if c in short_conv)


def head_dims(d_model: int, n_heads: int, head_dim: int | None) -> int:
    """The per-head width: ``head_dim`` when given, else d_model / n_heads (which must divide)."""
    check_positive_int("d_model", d_model)
    check_positive_int("n_heads", n_heads)
    if head_dim is not None:
        return check_positive_int("head_dim", head_dim)
    if d_model % n_heads:
        divisors = [h for h in range(1, d_model + 1) if d_model % h == 0]
        raise ValueError(f"n_heads={n_heads} must divide d_model={d_model} (valid n_heads: {divisors}), "
                         "or pass head_dim")
    return d_model // n_heads


def check_layer_input(x: object, d_model: int, cache: object) -> torch.Tensor:
    """``x`` is a floating ``[B, T, d_model]`` tensor with T >= 1; ``cache`` is None or a LayerCache."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        what = f"dtype {x.dtype}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(f"x must be a floating torch.Tensor of shape [B, T, d_model], got {what}")
    if x.dim() != 3 or x.shape[-1] != d_model or x.shape[1] < 1:
        raise ValueError(f"x must have shape [B, T, d_model] with d_model = {d_model} and T >= 1, "
                         f"got {list(x.shape)}")
    if cache is not None and not isinstance(cache, LayerCache):
        raise TypeError(f"cache must be None or a LayerCache, got {type(cache).__name__}")
    return x


def check_static_step_input(x: object, d_model: int, cache: StaticLayerCache) -> torch.Tensor:
    """``x`` is a floating ``[B, 1, d_model]`` tensor with B the static cache's batch size."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        what = f"dtype {x.dtype}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(f"x must be a floating torch.Tensor of shape [B, 1, d_model], got {what}")
    B = cache.pos.shape[0]
    if tuple(x.shape) != (B, 1, d_model):
        raise ValueError(f"a static decoding step takes one token per row: x must have shape [B, 1, d_model] = "
                         f"[{B}, 1, {d_model}] (B from the static cache), got {list(x.shape)}")
    return x


def check_conv_cache(cache: LayerCache, conv_names: Iterable[str]) -> None:
    """A cache continuing a sequence (offset > 0) holds a ShortConv state for exactly the streams this layer
    convolves: a missing one would silently restart that conv from zeros, an extra one means the cache came from
    a layer with another ``short_conv`` (either way the outputs would not continue the prefill)."""
    if cache.offset == 0:  # nothing seen yet: no conv state to continue
        return
    names = list(conv_names)  # the layer's stream order (q, k, v, ...)
    missing = [name for name in names if name not in cache.conv]
    extra = [name for name in cache.conv if name not in names]
    if missing:
        raise ValueError(f"the cache has no ShortConv state for stream {missing[0]!r} (it was made by a layer without "
                         f"a short conv on it); this layer convolves {names}, the cache has {list(cache.conv)}")
    if extra:
        raise ValueError(f"the cache has ShortConv state for stream {extra[0]!r}, which this layer does not convolve "
                         f"(it was made by a layer with a short conv on it); this layer convolves {names}, "
                         f"the cache has {list(cache.conv)}")
