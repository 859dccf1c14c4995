"""In-context n-gram language: every sequence has its own random n-gram table."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from linattn.data.base import IGNORE_INDEX, SyntheticTask, check_int


@dataclass
class InContextNGram(SyntheticTask):
    """Per sequence, each of the ``vocab ** (n-1)`` contexts gets ``branching`` random successors; the
    sequence starts with ``n-1`` uniform tokens and then x_t = table[x_{t-n+1..t-1}][u_t], u_t uniform.
    Targets: the next token at every position from ``n-2`` on (the last position has none). With
    ``branching=1`` the chain is deterministic once a context has been seen in the sequence."""

    vocab: int = 16
    seq_len: int = 64
    n: int = 2
    branching: int = 1

    def __post_init__(self) -> None:
        check_int("vocab", self.vocab, 2)
        check_int("n", self.n, 2)
        check_int("seq_len", self.seq_len, self.n + 1)
        check_int("branching", self.branching, 1, self.vocab)
        if self.vocab ** (self.n - 1) > 65536:
            raise ValueError(f"vocab ** (n - 1) = {self.vocab ** (self.n - 1)} contexts; expected <= 65536")

    @property
    def vocab_size(self) -> int:
        return self.vocab

    def _sample(self, n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        contexts = self.vocab ** (self.n - 1)
        table = torch.randint(0, self.vocab, (n, contexts, self.branching), generator=gen)
        choice = torch.randint(0, self.branching, (n, self.seq_len), generator=gen)
        x = torch.empty(n, self.seq_len, dtype=torch.long)
        x[:, :self.n - 1] = torch.randint(0, self.vocab, (n, self.n - 1), generator=gen)
        rows = torch.arange(n)
        for t in range(self.n - 1, self.seq_len):
            ctx = torch.zeros(n, dtype=torch.long)
            for j in range(t - self.n + 1, t):
                ctx = ctx * self.vocab + x[:, j]
            x[:, t] = table[rows, ctx, choice[:, t]]
        y = torch.full((n, self.seq_len), IGNORE_INDEX, dtype=torch.long)
        y[:, self.n - 2:-1] = x[:, self.n - 1:]
        return x, y
