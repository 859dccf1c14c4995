"""Self-pretraining (SPT, Amos et al. 2023, "Never Train from Scratch") views of an LRA split.

``CausalLMView``: item ``{"input_ids": x, "labels": y}`` with ``y[t] = x[t+1]`` (next token) and
``y[-1] = IGNORE_INDEX``. ``MaskedLMView``: ``round(r * T)`` positions (at least one) chosen uniformly
per sequence are replaced by ``<mask>``; ``labels`` holds the original token there and
``IGNORE_INDEX`` elsewhere, so the loss is taken on masked positions only. The mask ratio ``r``
defaults to the paper's per task: 10% ListOps, 15% text and retrieval, 50% images (image,
Pathfinder, Path-X). A pair task (retrieval) gives each document as its own sequence: view item
``2 i + j`` is document ``j`` of example ``i``. Masks are a pure function of (seed, epoch, index).
"""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

from linattn.data.base import IGNORE_INDEX, check_float, check_int, generator

from .dataset import LRADataset

MASK_RATIOS = {"listops": 0.10, "text": 0.15, "retrieval": 0.15, "image": 0.50, "pathfinder32": 0.50, "pathx": 0.50}


class _SequenceView(Dataset):
    """Every document of ``base`` as one sequence."""

    def __init__(self, base: LRADataset) -> None:
        if not isinstance(base, LRADataset):
            raise TypeError(f"base must be an LRADataset, got {type(base).__name__}")
        self.base = base
        self.per_item = 2 if base.is_pair else 1

    def __len__(self) -> int:
        return len(self.base) * self.per_item

    def sequence(self, i: int) -> torch.Tensor:
        if not 0 <= i < len(self):
            raise IndexError(f"index {i} out of range for a view of {len(self)} sequences")
        return self.base.sequence(i // self.per_item, second=bool(i % self.per_item))


class CausalLMView(_SequenceView):
    """Next-token prediction on every document of ``base`` (its training split, typically)."""

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        x = self.sequence(i)
        y = torch.full_like(x, IGNORE_INDEX)
        y[:-1] = x[1:]
        return {"input_ids": x, "labels": y}


class MaskedLMView(_SequenceView):
    """Masked denoising on every document of ``base``; ``mask_ratio`` defaults to ``MASK_RATIOS[base.name]``."""

    def __init__(self, base: LRADataset, mask_ratio: float | None = None, seed: int = 0) -> None:
        super().__init__(base)
        if mask_ratio is None:
            if base.name not in MASK_RATIOS:
                raise ValueError(f"no default mask ratio for task {base.name!r}; pass mask_ratio in (0, 1]")
            mask_ratio = MASK_RATIOS[base.name]
        self.mask_ratio = check_float("mask_ratio", mask_ratio, 1e-9, 1.0)
        self.seed = check_int("seed", seed, 0)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Draw fresh masks for ``epoch`` (call once per epoch)."""
        self.epoch = check_int("epoch", epoch, 0)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        x = self.sequence(i)
        n = max(1, int(round(self.mask_ratio * x.numel())))
        pos = torch.randperm(x.numel(), generator=generator(self.seed, i, salt=1 + self.epoch))[:n]
        y = torch.full_like(x, IGNORE_INDEX)
        y[pos] = x[pos]
        x = x.clone()
        x[pos] = self.base.vocab.mask_id
        return {"input_ids": x, "labels": y}
