"""LinAttnCache: transformers' Cache interface around linattn's per-layer decoding caches.

transformers' ``generate`` keeps whatever cache the model returns and hands it back at the next step. Our
cache is one :class:`~linattn.layers.cache.LayerCache` per block (ShortConv inputs and the mixer's state: a
fixed-size matrix for the recurrent mixers, keys and values for the softmax family), so this class only
carries that list and answers the questions ``generate`` asks (how many tokens it has seen, reordering rows
for beam search). Its layers are not transformers' key/value layers, so ``Cache.__init__`` is not used.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from linattn.layers.cache import LayerCache

from .deps import require

Cache = require("transformers.cache_utils").Cache


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``obj`` with ``fn`` applied to every tensor in it (tensors, tuples, lists, dicts, dataclasses)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, (tuple, list)):
        return type(obj)(map_tensors(x, fn) for x in obj)
    if isinstance(obj, dict):
        return {k: map_tensors(v, fn) for k, v in obj.items()}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: map_tensors(getattr(obj, f.name), fn)
                                           for f in dataclasses.fields(obj) if f.init})
    return obj


class LinAttnCache(Cache):
    """The decoding state of a linattn CausalLM for transformers: ``layer_caches``, one LayerCache per block
    (empty before the first forward). O(1) memory per token for the recurrent mixers."""

    def __init__(self, layer_caches: list[LayerCache] | None = None) -> None:
        self.layer_caches = list(layer_caches or [])
        self.layers: list = []  # transformers' per-layer key/value objects: none here

    def __len__(self) -> int:
        return len(self.layer_caches)

    def __repr__(self) -> str:
        return f"LinAttnCache(layers={len(self.layer_caches)}, seen_tokens={self.get_seq_length()})"

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def is_croppable(self) -> bool:
        return False  # a recurrent state cannot be rolled back to an earlier length

    @property
    def is_initialized(self) -> bool:
        return bool(self.layer_caches)

    @property
    def batch_size(self) -> int:
        for cache in self.layer_caches:
            for t in _tensors(cache):
                return int(t.shape[0])
        return -1

    def get_seq_length(self, layer_idx: int | None = 0, *args: Any, **kwargs: Any) -> int:
        """Tokens seen so far (0 before the first forward)."""
        return int(self.layer_caches[0].offset) if self.layer_caches else 0

    def get_max_cache_shape(self, *args: Any, **kwargs: Any) -> int:
        return -1  # no maximum length: the state does not grow

    def get_max_length(self, *args: Any, **kwargs: Any) -> None:
        return None

    def get_mask_sizes(self, query_length: int, *args: Any, **kwargs: Any) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def _apply_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.layer_caches = [LayerCache(map_tensors(c.conv, fn), map_tensors(c.state, fn), c.offset)
                             for c in self.layer_caches]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Rows in the order of ``beam_idx`` (beam search)."""
        self._apply_rows(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._apply_rows(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._apply_rows(lambda t: t[indices.to(t.device)])

    def reset(self) -> None:
        self.layer_caches = []

    def crop(self, max_length: int) -> None:
        if max_length < 0 or max_length != self.get_seq_length():
            raise ValueError("a linattn cache cannot be cropped: recurrent states cannot return to an earlier length")


def _tensors(cache: LayerCache) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    map_tensors((cache.conv, cache.state), lambda t: found.append(t) or t)
    return found
