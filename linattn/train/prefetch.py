"""Prefetching: the next training batch is built on a background thread while the current step runs.

On a GPU the host mostly waits for the step to finish; a data source that builds each batch on the host
(synthetic tasks sample the whole global batch on every process, then slice their rows) would otherwise
add its time to every step, and that time does not shrink as processes are added. Batch ``index`` is a
pure function of the index, so prefetching changes no number; only one batch is built at a time, so the
source is never called from two threads at once. A source must draw its randomness from its own generators
(as every source in linattn.data does), not torch's global one, which the model's dropout shares.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

import torch


class BatchSource(Protocol):
    def batch(self, index: int, rank: int = 0, world: int = 1) -> tuple[torch.Tensor, torch.Tensor]: ...


class Prefetcher:
    """``get(index)`` returns ``source.batch(index, rank, world)`` and starts building ``index + 1``.
    ``pin``: the batch is put in pinned memory on the thread too (a non-blocking copy to the GPU needs it).
    An error of the source is raised by the ``get`` of the batch that failed."""

    def __init__(self, source: BatchSource, rank: int, world: int, pin: bool = False) -> None:
        self.source, self.rank, self.world, self.pin = source, rank, world, pin
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="linattn-prefetch")
        self._next: tuple[int, Future] | None = None

    def _build(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.source.batch(index, self.rank, self.world)
        if self.pin:
            x, y = x.pin_memory(), y.pin_memory()
        return x, y

    def get(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._next is not None and self._next[0] == index:
            future = self._next[1]
        else:  # first call, or a jump (a resume): whatever was prefetched is not wanted
            if self._next is not None:
                self._next[1].cancel()
            future = self._pool.submit(self._build, index)
        batch = future.result()  # waits before the next submit: one batch in flight at a time
        self._next = (index + 1, self._pool.submit(self._build, index + 1))
        return batch

    def close(self) -> None:
        """Drop the batch in flight and stop the thread."""
        if self._next is not None:
            self._next[1].cancel()
            self._next = None
        self._pool.shutdown(wait=True)
