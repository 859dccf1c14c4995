"""The decoding cache of one mixer layer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class LayerCache:
    """What a layer needs to continue a sequence: the ShortConv caches by stream name ("q", "k",
    "v", ...; each ``[B, W-1, D]``), the mixer's state (a ``[B, H, K, V]`` matrix, a tuple of them,
    or a :class:`~linattn.ops.common.kv_cache.KVCache`) and ``offset``, the number of tokens seen."""

    conv: dict[str, torch.Tensor] = field(default_factory=dict)
    state: Any = None
    offset: int = 0
