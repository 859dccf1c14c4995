"""The decoding state of the mini-batch online learners (ttt_linear, titans).

Inside a mini-batch every gradient is taken at the weights the mini-batch started with, so token-by-
token decoding must carry those weights next to the current ones, and how many tokens of the
mini-batch have been seen. The full-sequence ops return only ``current`` (their final state), which
is a mini-batch boundary: a new mini-batch starts with the next token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MiniBatchState:
    """``current``: the learner's state after the last token (ttt_linear: (W,), titans: (M, S)), each
    [B, H, K, V] float32 (float64 for float64 inputs); ``start``: the weights the current mini-batch
    started with (W or M), [B, H, K, V]; ``count``: tokens of the current mini-batch seen so far
    (0 <= count < mini_batch_size; 0 means the next token starts a new mini-batch)."""

    current: tuple[torch.Tensor, ...]
    start: torch.Tensor
    count: int

    @classmethod
    def at_boundary(cls, current: tuple[torch.Tensor, ...]) -> MiniBatchState:
        """A state at a mini-batch boundary (e.g. an op's final state): start = the current weights."""
        return cls(tuple(current), current[0], 0)

    def advance(self, current: tuple[torch.Tensor, ...], mini_batch_size: int) -> MiniBatchState:
        """The state after one more token whose update gave ``current``."""
        count = self.count + 1
        if count == mini_batch_size:
            return MiniBatchState.at_boundary(current)
        return MiniBatchState(tuple(current), self.start, count)
