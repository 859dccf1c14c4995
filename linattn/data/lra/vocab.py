"""Token vocabularies of the LRA tasks and the padding ``collate`` shared by every LRA dataset.

Every vocabulary starts with the same three special tokens, so ids are stable across tasks:
``<pad>`` = 0 (padding), ``<mask>`` = 1 (masked self-pretraining), ``<unk>`` = 2; task symbols follow.
Byte- and pixel-level tasks map a value ``b`` in [0, 256) to id ``b + 3``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import repeat

import numpy as np
import torch

from linattn.data.base import IGNORE_INDEX

SPECIALS = ("<pad>", "<mask>", "<unk>")
PAD_ID, MASK_ID, UNK_ID = 0, 1, 2
LISTOPS_SYMBOLS = tuple(str(d) for d in range(10)) + ("[MIN", "[MAX", "[MED", "[SM", "]")


class Vocab:
    """A fixed list of tokens: the three specials, then ``symbols`` (ids 3, 4, ...)."""

    def __init__(self, symbols: Sequence[str], name: str) -> None:
        self.name = name
        self.tokens: tuple[str, ...] = SPECIALS + tuple(symbols)
        self.index = {t: i for i, t in enumerate(self.tokens)}
        if len(self.index) != len(self.tokens):
            raise ValueError(f"symbols of vocabulary {name!r} must be distinct and not special, got {symbols}")
        self.pad_id, self.mask_id, self.unk_id = PAD_ID, MASK_ID, UNK_ID
        self.offset = len(SPECIALS)

    def __len__(self) -> int:
        return len(self.tokens)

    def __repr__(self) -> str:
        return f"Vocab({self.name!r}, size={len(self)})"

    def encode(self, tokens: Iterable[str]) -> np.ndarray:
        """Token strings to ids (``<unk>`` for unknown strings), int16."""
        return np.fromiter(map(self.index.get, tokens, repeat(UNK_ID)), dtype=np.int16)

    def encode_values(self, values: np.ndarray) -> np.ndarray:
        """Integer symbols (bytes, pixel intensities) ``v`` in [0, len - 3) to ids ``v + 3``, int16."""
        values = np.asarray(values)
        n = len(self) - self.offset
        if values.size and (values.min() < 0 or values.max() >= n):
            raise ValueError(f"values for vocabulary {self.name!r} must lie in [0, {n}), got "
                             f"[{values.min()}, {values.max()}]")
        return values.astype(np.int16) + self.offset

    def decode(self, ids: Iterable[int]) -> list[str]:
        """Ids to token strings."""
        return [self.tokens[int(i)] for i in ids]


LISTOPS_VOCAB = Vocab(LISTOPS_SYMBOLS, "listops")
BYTE_VOCAB = Vocab([f"b{i}" for i in range(256)], "bytes")
PIXEL_VOCAB = Vocab([f"p{i}" for i in range(256)], "pixels")

_SEQ_KEYS = ("input_ids", "input_ids2", "labels")


def pad_sequences(seqs: Sequence[torch.Tensor], value: int, pad_to: int | None = None) -> torch.Tensor:
    """Right-pad 1-D int tensors to one length (the longest, or ``pad_to`` if given) as ``[B, T]`` int64."""
    longest = max(int(s.numel()) for s in seqs)
    T = longest if pad_to is None else pad_to
    if T < longest:
        raise ValueError(f"pad_to must be >= the longest sequence in the batch ({longest}), got {pad_to}")
    out = torch.full((len(seqs), T), value, dtype=torch.long)
    for i, s in enumerate(seqs):
        out[i, : s.numel()] = s
    return out


def collate(batch: Sequence[dict[str, torch.Tensor]], pad_id: int = PAD_ID,
            pad_to: int | None = None) -> dict[str, torch.Tensor]:
    """Stack LRA items into a batch.

    ``input_ids`` (and the second document ``input_ids2`` of a pair) are right-padded with ``pad_id``
    to ``[B, T]`` and get ``lengths`` (``lengths2``) ``[B]``; per-token ``labels`` (self-pretraining)
    are padded with ``IGNORE_INDEX``; a scalar ``label`` becomes ``label`` ``[B]``.
    """
    if not batch:
        raise ValueError("collate needs a non-empty batch, got 0 items")
    out: dict[str, torch.Tensor] = {}
    for key in batch[0]:
        values = [item[key] for item in batch]
        if key in _SEQ_KEYS:
            out[key] = pad_sequences(values, IGNORE_INDEX if key == "labels" else pad_id, pad_to)
            if key != "labels":
                out["lengths" + key[len("input_ids"):]] = torch.tensor([v.numel() for v in values])
        else:
            out[key] = torch.stack([torch.as_tensor(v) for v in values])
    return out
