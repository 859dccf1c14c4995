"""State tracking: running parity and S5 permutation composition (targets at every position)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from functools import lru_cache

import torch

from linattn.data.base import SyntheticTask, check_int


@dataclass
class Parity(SyntheticTask):
    """Bits x_t in {0, 1}; target y_t = (x_1 + ... + x_t) mod 2."""

    seq_len: int = 64

    def __post_init__(self) -> None:
        check_int("seq_len", self.seq_len, 1)

    @property
    def vocab_size(self) -> int:
        return 2

    def _sample(self, n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randint(0, 2, (n, self.seq_len), generator=gen)
        return x, x.cumsum(dim=1) % 2


@lru_cache(maxsize=1)
def s5_tables() -> tuple[torch.Tensor, torch.Tensor]:
    """(perms [120, 5] in lexicographic order, compose [120, 120]) with
    perms[compose[a, b]] = perms[a] o perms[b], i.e. (a o b)(i) = a(b(i))."""
    perms = torch.tensor(list(itertools.permutations(range(5))), dtype=torch.long)
    index = {tuple(p.tolist()): i for i, p in enumerate(perms)}
    compose = torch.empty(120, 120, dtype=torch.long)
    for a in range(120):
        for b in range(120):
            compose[a, b] = index[tuple(perms[a][perms[b]].tolist())]
    return perms, compose


@dataclass
class S5Composition(SyntheticTask):
    """Tokens are the 120 permutations of 5 elements; target y_t = x_t o x_{t-1} o ... o x_1 (the
    word problem of S5, which no constant-depth diagonal recurrence solves)."""

    seq_len: int = 32

    def __post_init__(self) -> None:
        check_int("seq_len", self.seq_len, 1)

    @property
    def vocab_size(self) -> int:
        return 120

    def _sample(self, n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        _, compose = s5_tables()
        x = torch.randint(0, 120, (n, self.seq_len), generator=gen)
        y = torch.empty_like(x)
        y[:, 0] = x[:, 0]
        for t in range(1, self.seq_len):
            y[:, t] = compose[x[:, t], y[:, t - 1]]
        return x, y
