"""LinAttnCache: transformers' Cache interface around linattn's per-layer decoding caches.

transformers' ``generate`` keeps whatever cache the model returns and hands it back at the next step. Our
cache is one :class:`~linattn.layers.cache.LayerCache` per block (ShortConv inputs and the mixer's state: a
fixed-size matrix for the recurrent mixers, keys and values for the softmax family), so this class only
carries those lists (one per group of rows at one position, for padded batches) and answers the questions
``generate`` asks (how many tokens it has seen, reordering rows for beam search). Its layers are not
transformers' key/value layers, so ``Cache.__init__`` is not used.
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
    """The decoding state of a linattn CausalLM for transformers. O(1) memory per token for the recurrent mixers.

    ``groups``: the rows by position, each a pair (row indices [n] or None for all rows in order, one LayerCache
    per block for those rows). A LayerCache holds one position for all its rows, so rows of a padded batch, which
    have seen different numbers of real tokens, sit in separate groups (one per real length), and each later
    forward runs once per group; without padding there is one group of every row. ``layer_caches`` is that
    group's list. ``mask``: [B, columns seen] bool, which columns were real tokens of each row (None: all of them);
    a later forward's ``attention_mask`` must repeat it."""

    def __init__(self, layer_caches: list[LayerCache] | None = None, *,
                 groups: list[tuple[torch.Tensor | None, list[LayerCache]]] | None = None,
                 mask: torch.Tensor | None = None) -> None:
        if layer_caches and groups:
            raise ValueError("pass layer_caches (every row at one position) or groups, not both")
        self.groups = list(groups) if groups else ([(None, list(layer_caches))] if layer_caches else [])
        self.mask = mask
        self.layers: list = []  # transformers' per-layer key/value objects: none here

    @property
    def layer_caches(self) -> list[LayerCache]:
        """One LayerCache per block, for the cache whose rows all sit at one position (empty before the first
        forward)."""
        if not self.groups:
            return []
        if len(self.groups) > 1 or self.groups[0][0] is not None:
            raise ValueError("the rows of this cache sit at different positions (a padded batch): read .groups, "
                             "one list of LayerCache per group of rows")
        return self.groups[0][1]

    @layer_caches.setter
    def layer_caches(self, value: list[LayerCache]) -> None:
        self.groups = [(None, list(value))] if value else []
        self.mask = None

    def __len__(self) -> int:
        return len(self.groups[0][1]) if self.groups else 0

    def __repr__(self) -> str:
        return (f"LinAttnCache(layers={len(self)}, seen_tokens={self.get_seq_length()}, "
                f"groups={len(self.groups)})")

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def is_croppable(self) -> bool:
        return False  # a recurrent state cannot be rolled back to an earlier length

    @property
    def is_initialized(self) -> bool:
        return bool(self.groups)

    @property
    def batch_size(self) -> int:
        if self.mask is not None:
            return int(self.mask.shape[0])
        for _, caches in self.groups:
            for cache in caches:
                for t in _tensors(cache):
                    return int(t.shape[0])
        return -1

    def get_seq_length(self, layer_idx: int | None = 0, *args: Any, **kwargs: Any) -> int:
        """Columns of input seen so far, padding included (0 before the first forward): what transformers slices
        its input_ids and attention_mask by."""
        if self.mask is not None:
            return int(self.mask.shape[1])
        return int(self.groups[0][1][0].offset) if self.groups and self.groups[0][1] else 0

    def get_max_cache_shape(self, *args: Any, **kwargs: Any) -> int:
        return -1  # no maximum length: the state does not grow

    def get_max_length(self, *args: Any, **kwargs: Any) -> None:
        return None

    def get_mask_sizes(self, query_length: int, *args: Any, **kwargs: Any) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def _select_rows(self, source: torch.Tensor) -> None:
        """Row i of the new cache is row ``source[i]`` of this one."""
        if self.mask is not None:
            self.mask = self.mask.index_select(0, source.to(self.mask.device))
        if len(self.groups) == 1 and self.groups[0][0] is None:
            rows = self.groups[0][1]
            self.groups = [(None, [_rows_of(c, source) for c in rows])]
            return
        # several groups: each new row joins the group of its source row, at that row's place within it
        where = {int(r): (g, j) for g, (rows, _) in enumerate(self.groups) for j, r in enumerate(rows.tolist())}
        members: dict[int, tuple[list[int], list[int]]] = {}
        for i, r in enumerate(source.tolist()):
            g, j = where[r]
            members.setdefault(g, ([], []))[0].append(i)
            members[g][1].append(j)
        groups = []
        for g, (new_rows, within) in sorted(members.items()):
            rows, caches = self.groups[g]
            picked = torch.tensor(within, device=rows.device)
            groups.append((torch.tensor(new_rows, device=rows.device), [_rows_of(c, picked) for c in caches]))
        if len(groups) == 1:
            groups = [(None, groups[0][1])]  # one group holds every row, in order
        self.groups = groups

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Rows in the order of ``beam_idx`` (beam search)."""
        self._select_rows(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._select_rows(torch.arange(self.batch_size).repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if indices.dtype == torch.bool:
            indices = indices.nonzero().flatten()
        self._select_rows(indices)

    def reset(self) -> None:
        self.groups = []
        self.mask = None

    def crop(self, max_length: int) -> None:
        if max_length < 0 or max_length != self.get_seq_length():
            raise ValueError("a linattn cache cannot be cropped: recurrent states cannot return to an earlier length")


def _rows_of(cache: LayerCache, index: torch.Tensor) -> LayerCache:
    """``cache`` restricted to the rows ``index``, in that order."""
    def pick(t: torch.Tensor) -> torch.Tensor:
        return t.index_select(0, index.to(t.device))

    return LayerCache(map_tensors(cache.conv, pick), map_tensors(cache.state, pick), cache.offset)


def _tensors(cache: LayerCache) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    map_tensors((cache.conv, cache.state), lambda t: found.append(t) or t)
    return found
