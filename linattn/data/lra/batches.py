"""LRA splits and SPT views as the Trainer's batch source: ``batch(index, rank, world)`` and a whole split
as one evaluation set."""

from __future__ import annotations

import torch
from torch.nn import functional as F

from linattn.errors import ConfigError

from .dataset import LRADataset
from .spt import CausalLMView, MaskedLMView
from .vocab import PAD_ID, collate


class LRABatches:
    """``batch(index, rank, world)`` for the Trainer from a map-style LRA dataset or SPT view: batch
    ``index`` is a slice of a per-epoch permutation seeded by (seed, epoch) (the last partial batch of an
    epoch is dropped), padded by ``collate``. Targets: ``label[:, None]`` for a classification split,
    the per-token ``labels`` of an SPT view."""

    def __init__(self, data: LRADataset | CausalLMView | MaskedLMView, batch_size: int, seed: int) -> None:
        if not 1 <= batch_size <= len(data):
            raise ConfigError(f"batch_size must be in [1, {len(data)}] (the split's size), got {batch_size}",
                              field="train.batch_size")
        self.data, self.batch_size, self.seed = data, batch_size, seed
        self.per_epoch = len(data) // batch_size
        self._perm: tuple[int, torch.Tensor] | None = None

    def _permutation(self, epoch: int) -> torch.Tensor:
        if self._perm is None or self._perm[0] != epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm = (epoch, torch.randperm(len(self.data), generator=g))
        return self._perm[1]

    def batch(self, index: int, rank: int = 0, world: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        epoch, j = divmod(index, self.per_epoch)
        ids = self._permutation(epoch)[j * self.batch_size:(j + 1) * self.batch_size][rank::world]
        if isinstance(self.data, MaskedLMView):
            self.data.set_epoch(epoch)
        return inputs_targets(collate([self.data[int(i)] for i in ids]))


def inputs_targets(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets): inputs are ``input_ids`` [B, T], or for a document pair both documents stacked
    as [B, 2, T] (each right-padded with ``PAD_ID`` to the longer one); targets are the per-token
    ``labels`` [B, T] of an SPT batch or ``label[:, None]`` [B, 1]."""
    x = batch["input_ids"]
    if "input_ids2" in batch:
        x2 = batch["input_ids2"]
        T = max(x.shape[1], x2.shape[1])
        x = torch.stack([F.pad(x, (0, T - x.shape[1]), value=PAD_ID), F.pad(x2, (0, T - x2.shape[1]), value=PAD_ID)],
                        dim=1)
    return x, batch["labels"] if "labels" in batch else batch["label"][:, None]


def whole_split(data: LRADataset, limit: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Every example of ``data`` (the first ``limit`` when given) as one padded (inputs, targets) pair (the
    Trainer's eval set)."""
    n = len(data) if limit is None else min(limit, len(data))
    return inputs_targets(collate([data[i] for i in range(n)]))
