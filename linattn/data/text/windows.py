"""Next-token batches from a packed token stream: fixed-length windows that cross document boundaries.

Training: batch ``index`` of a stream seeded ``seed`` is ``batch_size`` windows at uniformly random starts
(a pure function of (seed, index), so resumed and data-parallel runs see the same batches). Evaluation:
non-overlapping windows spread evenly over the split, each target counted once, with the UTF-8 bytes its
targets stand for (for bits per byte).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from linattn.data.base import generator
from linattn.errors import DataError


def _window(tokens: np.ndarray, starts: np.ndarray, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    idx = starts[:, None] + np.arange(seq_len + 1)[None, :]
    rows = torch.from_numpy(np.asarray(tokens[idx], dtype=np.int64))
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


@dataclass
class TokenWindows:
    """Random windows of ``seq_len`` + 1 tokens of ``tokens`` (inputs, next-token targets)."""

    tokens: np.ndarray
    seq_len: int
    batch_size: int
    seed: int = 0

    def __post_init__(self) -> None:
        if len(self.tokens) < self.seq_len + 1:
            raise DataError(f"the training split has {len(self.tokens)} tokens, fewer than one window of "
                            f"seq_len + 1 = {self.seq_len + 1}")

    def batch(self, index: int, rank: int = 0, world: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        if self.batch_size % world:
            raise ValueError(f"batch_size {self.batch_size} must be divisible by the world size {world}")
        high = len(self.tokens) - self.seq_len
        starts = torch.randint(0, high, (self.batch_size,), generator=generator(self.seed, index)).numpy()
        x, y = _window(self.tokens, starts[rank::world], self.seq_len)
        return x, y


@dataclass
class EvalWindows:
    """A fixed evaluation set: ``inputs``, ``targets`` [n, seq_len] and the bytes the targets stand for."""

    inputs: torch.Tensor
    targets: torch.Tensor
    num_tokens: int
    num_bytes: int


def eval_windows(tokens: np.ndarray, token_bytes: np.ndarray, seq_len: int, max_windows: int) -> EvalWindows:
    """Up to ``max_windows`` non-overlapping windows spread evenly over ``tokens`` (all of them that fit
    when fewer); DataError when not even one fits."""
    fit = (len(tokens) - 1) // seq_len
    if fit < 1:
        raise DataError(f"an evaluation split has {len(tokens)} tokens, fewer than one window of seq_len + 1 = "
                        f"{seq_len + 1}")
    n = min(max_windows, fit)
    stride = (len(tokens) - 1) // n  # >= seq_len: windows never overlap
    starts = np.arange(n, dtype=np.int64) * stride
    x, y = _window(tokens, starts, seq_len)
    num_bytes = int(np.asarray(token_bytes)[y.numpy()].sum())
    return EvalWindows(x, y, int(y.numel()), num_bytes)
