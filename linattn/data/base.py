"""Shared pieces of the synthetic tasks: the task interface, seeding, argument checks, batch streams.

Every task is a small dataclass of parameters with ``vocab_size``, ``seq_len`` and
``sample(n, generator) -> (inputs, targets)``: ``inputs`` and ``targets`` are int64 ``[n, seq_len]``,
``targets[i, t]`` is the token the model must predict at position ``t`` (causal LM convention: it may
only read ``inputs[i, :t+1]``) or ``IGNORE_INDEX`` where no loss is taken. All randomness comes from
the ``torch.Generator`` passed in, so a task is deterministic by seed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

IGNORE_INDEX = -100
_MASK64 = (1 << 64) - 1


def mix_seed(seed: int, index: int, salt: int = 0) -> int:
    """A well-spread 63-bit seed for (seed, index, salt) (splitmix64 finaliser): batch ``index`` of a
    stream seeded ``seed`` gets its own independent generator, so any batch can be rebuilt alone."""
    z = (seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9 + salt * 0x94D049BB133111EB) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


def generator(seed: int, index: int = 0, salt: int = 0) -> torch.Generator:
    """A CPU generator seeded with ``mix_seed(seed, index, salt)``."""
    return torch.Generator().manual_seed(mix_seed(seed, index, salt))


def check_int(name: str, value: object, low: int, high: int | None = None) -> int:
    """``value`` as an int in [low, high]; TypeError/ValueError naming ``name`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be {bound}, got {value}")
    return value


def check_float(name: str, value: object, low: float, high: float) -> float:
    """``value`` as a float in [low, high]; TypeError/ValueError naming ``name`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float, got {type(value).__name__} {value!r}")
    if not low <= float(value) <= high:
        raise ValueError(f"{name} must be in [{low}, {high}], got {value}")
    return float(value)


def random_choice(n: int, population: int, k: int, gen: torch.Generator,
                  weights: torch.Tensor | None = None) -> torch.Tensor:
    """``[n, k]`` distinct indices in [0, population) per row (uniform, or drawn without replacement
    with probabilities proportional to ``weights``)."""
    if weights is None:
        return torch.rand(n, population, generator=gen).argsort(dim=1)[:, :k]
    return torch.multinomial(weights.double().expand(n, population), k, replacement=False, generator=gen)


class SyntheticTask:
    """Base class: subclasses are dataclasses with ``seq_len``, ``vocab_size`` and ``_sample``."""

    seq_len: int

    @property
    def vocab_size(self) -> int:  # pragma: no cover - every task overrides it
        raise NotImplementedError

    def _sample(self, n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError  # pragma: no cover

    def sample(self, n: int, generator: torch.Generator | None = None, seed: int | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """``n`` examples as ``(inputs, targets)``, int64 ``[n, seq_len]``; from ``generator`` or ``seed``."""
        check_int("n", n, 1)
        if generator is None:
            if seed is None:
                raise ValueError("sample() needs a generator or a seed, got neither")
            generator = torch.Generator().manual_seed(check_int("seed", seed, 0))
        x, y = self._sample(n, generator)
        return x.long().contiguous(), y.long().contiguous()


@dataclass
class TaskStream:
    """An endless, random-access stream of batches of ``task``: batch ``index`` is a pure function of
    (seed, index), so a resumed or data-parallel run sees exactly the batches of an uninterrupted
    single-process run. With ``world`` ranks, rank ``r`` gets rows ``r::world`` of the global batch."""

    task: SyntheticTask
    batch_size: int
    seed: int = 0

    def __post_init__(self) -> None:
        check_int("batch_size", self.batch_size, 1)
        check_int("seed", self.seed, 0)

    def batch(self, index: int, rank: int = 0, world: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        if self.batch_size % world:
            raise ValueError(f"batch_size {self.batch_size} must be divisible by the world size {world}")
        x, y = self.task.sample(self.batch_size, generator(self.seed, index))
        return x[rank::world], y[rank::world]


def eval_set(task: SyntheticTask, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed held-out set: drawn from a generator salted apart from every training stream."""
    return task.sample(n, generator(seed, 0, salt=1))
