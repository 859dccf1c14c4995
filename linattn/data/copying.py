"""Copy-style tasks: selective copy, induction heads, long-range copy.

Token 0 is the blank, token 1 the marker that asks for output; data tokens are ``[2, vocab)``
(induction heads: ``vocab - 1`` is the trigger, data tokens ``[0, vocab - 1)``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from linattn.data.base import IGNORE_INDEX, SyntheticTask, check_int, random_choice

BLANK, MARKER = 0, 1


@dataclass
class SelectiveCopy(SyntheticTask):
    """Selective copy (Mamba): ``num_tokens`` data tokens at random positions (in order) among blanks
    in the first ``seq_len - num_tokens`` positions, then ``num_tokens`` markers; the target at the
    i-th marker is the i-th data token."""

    vocab: int = 16
    seq_len: int = 64
    num_tokens: int = 8

    def __post_init__(self) -> None:
        check_int("vocab", self.vocab, 3)
        check_int("num_tokens", self.num_tokens, 1)
        check_int("seq_len", self.seq_len, 2 * self.num_tokens)

    @property
    def vocab_size(self) -> int:
        return self.vocab

    def _sample(self, n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        k, region = self.num_tokens, self.seq_len - self.num_tokens
        data = torch.randint(2, self.vocab, (n, k), generator=gen)
        pos = random_choice(n, region, k, gen).sort(dim=1).values
        x = torch.full((n, self.seq_len), BLANK, dtype=torch.long)
        x.scatter_(1, pos, data)
        x[:, region:] = MARKER
        y = torch.full((n, self.seq_len), IGNORE_INDEX, dtype=torch.long)
        y[:, region:] = data
        return x, y


@dataclass
class InductionHeads(SyntheticTask):
    """Induction heads: random tokens, the trigger ``vocab - 1`` once followed by an answer token, and
    the trigger again at the last position, whose target is the answer."""

    vocab: int = 16
    seq_len: int = 64

    def __post_init__(self) -> None:
        check_int("vocab", self.vocab, 3)
        check_int("seq_len", self.seq_len, 4)

    @property
    def vocab_size(self) -> int:
        return self.vocab

    def _sample(self, n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        trigger, t = self.vocab - 1, self.seq_len
        x = torch.randint(0, trigger, (n, t), generator=gen)
        pos = torch.randint(0, t - 2, (n, 1), generator=gen)
        x.scatter_(1, pos, trigger)
        x[:, -1] = trigger
        y = torch.full((n, t), IGNORE_INDEX, dtype=torch.long)
        y[:, -1] = x.gather(1, pos + 1).squeeze(1)
        return x, y


@dataclass
class LongRangeCopy(SyntheticTask):
    """Long-range copy: ``[x_1..x_k, 0 * gap, marker * k]``; the target at the i-th marker is
    ``x_i``; accuracy = (1/k) sum_i 1[y_hat_i = x_i]. ``seq_len = 2k + gap``."""

    vocab: int = 16
    num_tokens: int = 8
    gap: int = 32

    def __post_init__(self) -> None:
        check_int("vocab", self.vocab, 3)
        check_int("num_tokens", self.num_tokens, 1)
        check_int("gap", self.gap, 0)

    @property
    def seq_len(self) -> int:
        return 2 * self.num_tokens + self.gap

    @property
    def vocab_size(self) -> int:
        return self.vocab

    def _sample(self, n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        k = self.num_tokens
        data = torch.randint(2, self.vocab, (n, k), generator=gen)
        x = torch.full((n, self.seq_len), BLANK, dtype=torch.long)
        x[:, :k] = data
        x[:, -k:] = MARKER
        y = torch.full((n, self.seq_len), IGNORE_INDEX, dtype=torch.long)
        y[:, -k:] = data
        return x, y
