"""Multi-query associative recall (MQAR, Zoology) and its "stacked" control.

Vocabulary of ``vocab`` tokens: 0 is the filler, keys are ``[1, vocab//2)``, values ``[vocab//2, vocab)``.
Each sequence draws ``num_kv_pairs`` distinct keys and distinct values.

* :class:`MultiQueryAR`: the context is ``k_1 v_1 k_2 v_2 ...`` (key and value in adjacent tokens); the
  rest of the sequence has ``(seq_len - 2N) // 2`` two-token slots; each key is queried once, in a slot
  ``s`` drawn without replacement with P(s) proportional to ``(s + 1) ** (power_a - 1)`` (a power law:
  short gaps are likely); a query is the key followed by its value, and the only targets of the
  sequence are the values at the query-key positions. Other positions are random tokens
  (``random_non_queries``) or 0.
* :class:`StackedAR`: the same, except that each context pair is ONE token ``pair(k, v)`` (ids from
  ``vocab`` on), so no token mixing is needed to bind a key to its value: the control for the
  short-convolution study (a conv on k should matter for MQAR, not here).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from linattn.data.base import IGNORE_INDEX, SyntheticTask, check_float, check_int, random_choice
from linattn.validation import check_bool


def _check_recall(task: MultiQueryAR, context_len: int) -> None:
    check_int("vocab", task.vocab, 6)
    check_int("seq_len", task.seq_len, 4)
    num_keys = task.vocab // 2 - 1
    check_int("num_kv_pairs", task.num_kv_pairs, 1, num_keys)
    check_float("power_a", task.power_a, 1e-6, 1.0)
    check_bool("random_non_queries", task.random_non_queries)
    slots = (task.seq_len - context_len) // 2
    if slots < task.num_kv_pairs:
        raise ValueError(f"seq_len {task.seq_len} leaves {max(slots, 0)} query slots after a context of "
                         f"{context_len} tokens; need >= num_kv_pairs={task.num_kv_pairs}")


@dataclass
class MultiQueryAR(SyntheticTask):
    """MQAR with key-value pairs in adjacent tokens; loss only at the query positions."""

    vocab: int = 64
    seq_len: int = 64
    num_kv_pairs: int = 8
    power_a: float = 0.01
    random_non_queries: bool = True

    def __post_init__(self) -> None:
        _check_recall(self, self.context_len)

    @property
    def context_len(self) -> int:
        return 2 * self.num_kv_pairs

    @property
    def vocab_size(self) -> int:
        return self.vocab

    def _draw_pairs(self, n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        half = self.vocab // 2
        keys = 1 + random_choice(n, half - 1, self.num_kv_pairs, gen)
        values = half + random_choice(n, self.vocab - half, self.num_kv_pairs, gen)
        return keys, values

    def _write_context(self, x: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        x[:, 0:self.context_len:2] = keys
        x[:, 1:self.context_len:2] = values

    def _sample(self, n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self._draw_pairs(n, gen)
        c, t = self.context_len, self.seq_len
        if self.random_non_queries:
            x = torch.randint(0, self.vocab, (n, t), generator=gen)
        else:
            x = torch.zeros(n, t, dtype=torch.long)
        y = torch.full((n, t), IGNORE_INDEX, dtype=torch.long)
        self._write_context(x, keys, values)
        slots = (t - c) // 2
        weights = torch.arange(1, slots + 1, dtype=torch.float64) ** (self.power_a - 1.0)
        pos = c + 2 * random_choice(n, slots, self.num_kv_pairs, gen, weights)
        x.scatter_(1, pos, keys)
        x.scatter_(1, pos + 1, values)
        y.scatter_(1, pos, values)
        return x, y


@dataclass
class StackedAR(MultiQueryAR):
    """MQAR whose context pairs are single tokens ``pair(k, v) = vocab + (k-1)*n_values + (v-vocab//2)``;
    the queries are as in :class:`MultiQueryAR` (key token, then its value token)."""

    def __post_init__(self) -> None:
        _check_recall(self, self.context_len)

    @property
    def context_len(self) -> int:
        return self.num_kv_pairs

    @property
    def num_values(self) -> int:
        return self.vocab - self.vocab // 2

    @property
    def vocab_size(self) -> int:
        return self.vocab + (self.vocab // 2 - 1) * self.num_values

    def pair_token(self, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """The token id that stacks key ``keys`` with value ``values``."""
        return self.vocab + (keys - 1) * self.num_values + (values - self.vocab // 2)

    def _write_context(self, x: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        x[:, :self.context_len] = self.pair_token(keys, values)
