"""The static decoding cache of a whole model: one StaticLayerCache per block and the shared positions."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from linattn.layers.cache import LayerCache
from linattn.layers.static_cache import StaticLayerCache


@dataclass
class StaticCache:
    """``layers``: one :class:`~linattn.layers.static_cache.StaticLayerCache` per block, all holding the same
    ``pos`` [B] int64 tensor (each row's next position, advanced once per model step); ``max_length``: the
    positions the softmax family's KV buffers hold (a row may not step past it).

    Buffers are only ever written in place (steps, :meth:`reset`, :meth:`load`), never replaced: a CUDA
    graph captured around a step reads them by address.
    """

    layers: list[StaticLayerCache]
    pos: torch.Tensor
    max_length: int

    @property
    def batch_size(self) -> int:
        return int(self.pos.shape[0])

    def reset(self) -> None:
        """Zero every buffer and position in place."""
        for layer in self.layers:
            layer.zero_()
        self.pos.zero_()

    def load(self, model: torch.nn.Module, caches: list[LayerCache], rows: torch.Tensor, length: int) -> None:
        """Copy a cached forward's per-block caches of len(rows) sequences of ``length`` tokens (a prefill) into
        rows ``rows``, and set their positions to ``length``."""
        if not 1 <= length <= self.max_length:
            raise ValueError(f"a prompt of {length} tokens does not fit a static cache of max_length {self.max_length}")
        for block, static, cache in zip(model.blocks, self.layers, caches):
            block.mixer.load_static_cache(static, cache, rows)
        self.pos.index_fill_(0, rows, length)
