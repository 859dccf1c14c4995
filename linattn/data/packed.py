"""Training batches of whole documents packed along one row with ``cu_seqlens``, a fixed number of tokens each.

:class:`PackedDocuments` reads a token stream whose documents lie back to back (``tokens``, and ``offsets``
[D + 1]: document d is ``tokens[offsets[d]:offsets[d + 1]]``, as the text shards keep them). Each epoch visits the
documents in a new order (a permutation seeded by (seed, epoch)); the epochs' documents laid end to end form one
stream, and global batch ``index`` is its tokens [index * n, (index + 1) * n) with n = ``batch_size * seq_len``:
every token is an input once per epoch. The batch's inputs are one row [1, n] (this rank's share: n / world
contiguous tokens), packed as sequences at the document boundaries (``cu_seqlens``), so the model's state restarts
at every document; a document that does not fit is cut there and continues as the first sequence of the next
batch. Each token's target is the next token of its own document (the next batch's first token where the document
is cut), and the last token of a document has none (IGNORE_INDEX). A batch is a pure function of (seed, index), so
resumed and data-parallel runs see the same batches.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from linattn.data.base import generator
from linattn.errors import DataError

IGNORE_INDEX = -100


@dataclass(frozen=True)
class PackedInputs:
    """Model inputs of packed documents: ``input_ids`` [1, n] and their offsets ``cu_seqlens`` [N + 1] int32, which
    stay on the CPU (the model reads them there, with no device synchronisation)."""

    input_ids: torch.Tensor
    cu_seqlens: torch.Tensor

    def numel(self) -> int:
        return self.input_ids.numel()

    def pin_memory(self) -> PackedInputs:
        return PackedInputs(self.input_ids.pin_memory(), self.cu_seqlens)

    def to(self, device: torch.device, non_blocking: bool = False) -> PackedInputs:
        return PackedInputs(self.input_ids.to(device, non_blocking=non_blocking), self.cu_seqlens)


@dataclass
class PackedDocuments:
    """Batches of ``batch_size * seq_len`` tokens of whole documents (module docstring): ``batch(index, rank,
    world)`` -> (PackedInputs, targets [1, n / world])."""

    tokens: np.ndarray
    offsets: np.ndarray
    seq_len: int
    batch_size: int
    seed: int = 0
    _epoch: tuple[int, np.ndarray, np.ndarray] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.offsets = np.asarray(self.offsets, dtype=np.int64)
        lengths = np.diff(self.offsets)
        if len(self.offsets) < 2 or self.offsets[0] != 0 or self.offsets[-1] != len(self.tokens) or (lengths < 0).any():
            raise DataError(f"document offsets must run from 0 to the {len(self.tokens)} tokens, non-decreasing; "
                            f"got {len(self.offsets)} offsets from {self.offsets[:1]} to {self.offsets[-1:]}")
        if len(self.tokens) == 0:
            raise DataError("the training split has no tokens")

    def _order(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(documents of ``epoch`` in visiting order, their ends in the epoch's stream)."""
        if self._epoch is None or self._epoch[0] != epoch:
            lengths = np.diff(self.offsets)
            docs = torch.randperm(len(lengths), generator=generator(self.seed, epoch, salt=1)).numpy()
            docs = docs[lengths[docs] > 0]  # empty documents hold no token
            self._epoch = (epoch, docs, np.cumsum(lengths[docs]))
        return self._epoch[1], self._epoch[2]

    def _pieces(self, start: int, stop: int) -> list[tuple[int, int, bool]]:
        """The stream's tokens [start, stop) as (first token, end) ranges of ``tokens`` within one document each, and
        whether the range ends its document."""
        total = len(self.tokens)
        pieces = []
        while start < stop:
            epoch, at = divmod(start, total)
            docs, ends = self._order(epoch)
            i = int(np.searchsorted(ends, at, side="right"))
            doc_start = ends[i] - (self.offsets[docs[i] + 1] - self.offsets[docs[i]])
            first = int(self.offsets[docs[i]] + at - doc_start)
            take = min(stop - start, int(ends[i] - at))
            pieces.append((first, first + take, at + take == ends[i]))
            start += take
        return pieces

    def batch(self, index: int, rank: int = 0, world: int = 1) -> tuple[PackedInputs, torch.Tensor]:
        n = self.batch_size * self.seq_len
        if n % world:
            raise ValueError(f"batch_size * seq_len = {n} tokens must be divisible by the world size {world}")
        share = n // world
        start = index * n + rank * share
        ids, targets, cu = [], [], [0]
        for first, end, closes in self._pieces(start, start + share):
            ids.append(self.tokens[first:end])
            nxt = self.tokens[first + 1:end + (0 if closes else 1)]  # the document's next tokens
            targets.append(np.concatenate([nxt, [IGNORE_INDEX]]) if closes else nxt)
            cu.append(cu[-1] + end - first)
        x = torch.from_numpy(np.concatenate(ids).astype(np.int64))[None]
        y = torch.from_numpy(np.concatenate(targets).astype(np.int64))[None]
        return PackedInputs(x, torch.tensor(cu, dtype=torch.int32)), y
