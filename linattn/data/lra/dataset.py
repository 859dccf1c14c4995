"""The dataset class every LRA loader returns: token-id sequences (one, or two for a pair) and labels."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

from .vocab import Vocab


class LRADataset(Dataset):
    """An LRA split. Item ``i`` is ``{"input_ids": int64 [T_i], "label": int64 []}``, plus
    ``"input_ids2"`` for a pair task (retrieval's dual encoder).

    Sequences are held as int16 numpy arrays (``seqs``, ``seqs2``) or produced on demand by ``load(i)``
    (images read from disk); ``labels`` is int64 ``[N]``.
    """

    def __init__(self, name: str, split: str, vocab: Vocab, num_classes: int, labels: Sequence[int],
                 seqs: Sequence[np.ndarray] | None = None, seqs2: Sequence[np.ndarray] | None = None,
                 load: Callable[[int], np.ndarray] | None = None) -> None:
        if (seqs is None) == (load is None):
            raise ValueError("LRADataset needs exactly one of seqs or load")
        self.name, self.split, self.vocab, self.num_classes = name, split, vocab, num_classes
        self.labels = torch.as_tensor(np.asarray(labels, dtype=np.int64))
        self.seqs, self.seqs2, self._load = seqs, seqs2, load
        for what, s in (("seqs", seqs), ("seqs2", seqs2)):
            if s is not None and len(s) != len(self.labels):
                raise ValueError(f"{what} has {len(s)} sequences but there are {len(self.labels)} labels")

    @property
    def is_pair(self) -> bool:
        """Two documents per example (a dual-encoder task)."""
        return self.seqs2 is not None

    def __len__(self) -> int:
        return len(self.labels)

    def sequence(self, i: int, second: bool = False) -> torch.Tensor:
        """Token ids of example ``i`` (its second document if ``second``), int64 ``[T_i]``."""
        if second:
            if self.seqs2 is None:
                raise ValueError(f"{self.name} has one document per example; second=True is for pair tasks")
            arr = self.seqs2[i]
        else:
            arr = self.seqs[i] if self.seqs is not None else self._load(i)
        return torch.from_numpy(np.asarray(arr, dtype=np.int64))

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not -len(self) <= i < len(self):
            raise IndexError(f"index {i} out of range for {self.name}/{self.split} of {len(self)} examples")
        item = {"input_ids": self.sequence(i), "label": self.labels[i]}
        if self.is_pair:
            item["input_ids2"] = self.sequence(i, second=True)
        return item

    def __repr__(self) -> str:
        pair = ", pair" if self.is_pair else ""
        return f"LRADataset({self.name}/{self.split}, n={len(self)}, vocab={len(self.vocab)}{pair})"
