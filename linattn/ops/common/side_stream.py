"""Two independent kernel sequences of one pass at once: the second on a side CUDA stream.

The delta family's backward pass recomputes the forward's chunk states (a scan over the chunks) and runs the reverse
scan of the state gradients; neither reads the other's output. Each scan is a sequential loop over chunks with one
program per (value block, batch-head): a few hundred programs that leave most of a GPU's warp slots empty, for as
long as the longest sequence's chunks take. On two streams the two scans share the SMs instead of running one after
the other.

:func:`beside` launches ``work`` on a side stream that first waits for the current stream's queued work, and returns
a handle whose ``join()`` makes the current stream wait for it. Nothing is allocated on the side stream: ``work``
writes into tensors allocated beforehand on the current stream, which stay referenced until after the join, so the
caching allocator never hands their memory to other work while the side stream uses it, and a CUDA graph capture
sees one fork and one join (allocations during capture come from the capturing stream's pool only). On the CPU,
under Triton's interpreter, and with the setting off, ``work`` runs in place.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

_STREAMS: dict[int, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _STREAMS:
        _STREAMS[index] = torch.cuda.Stream(device=index)
    return _STREAMS[index]


class Beside:
    """The handle of :func:`beside`: ``join()`` orders the current stream after the side stream's work and lets go
    of the tensors that work reads and writes."""

    def __init__(self, main: torch.cuda.Stream | None, side: torch.cuda.Stream | None,
                 keep: tuple[torch.Tensor | None, ...] = ()) -> None:
        self.main, self.side, self.keep = main, side, keep

    def join(self) -> None:
        if self.side is not None:
            self.main.wait_stream(self.side)
        self.keep = ()


def beside(work: Callable[[], None], device: torch.device, keep: tuple[torch.Tensor | None, ...],
           enabled: bool = True) -> Beside:
    """Run ``work`` (kernel launches writing into tensors allocated before this call) on a side stream of
    ``device``, after the current stream's queued work; ``join()`` the handle before reading what it wrote.
    ``keep``: every tensor ``work`` reads or writes, held by the handle until the join (a tensor the caller drops
    earlier would otherwise go back to the allocator while the side stream still uses it)."""
    if not enabled or device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        work()
        return Beside(None, None)
    main = torch.cuda.current_stream(device)
    side = _side_stream(device)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        work()
    return Beside(main, side, keep)
