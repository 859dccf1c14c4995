"""Packed sequences run natively by a backend: the offsets of the call in flight, and their chunks.

:func:`linattn.ops.common.varlen.packable` runs a packed call (``cu_seqlens``) by splitting it into one call per
sequence, unless the backend the call resolves to takes packed inputs itself (its implementation has the attribute
``native_cu_seqlens = True``). Then the op's own function runs once on the packed inputs inside
:func:`packed_call`: the checks accept one initial-state row per sequence (:func:`state_rows`) and the backend reads
the offsets from :func:`current_packing`.

The chunked Triton kernels read packed inputs where they lie, by the chunks of :class:`ChunkLayout`: sequence n is
cut into chunks of C tokens from its own start, chunks [c_n, c_{n+1}) of all, the last one holding what remains.
Each chunk belongs to one sequence: the in-chunk kernels take a chunk's first token and token count (masking the
rows past it, another sequence's) and the kernels that carry the state across chunks start and end it at the
sequence's own chunks (read from ``cu_chunks``).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import torch

T_ = TypeVar("T_")

@dataclass(frozen=True)
class Packing:
    """The offsets of a packed call: ``cu_seqlens`` as given (validated) and as Python ints."""

    cu_seqlens: torch.Tensor
    offsets: tuple[int, ...]

    @property
    def N(self) -> int:
        return len(self.offsets) - 1


_CURRENT: contextvars.ContextVar[Packing | None] = contextvars.ContextVar("linattn_packing", default=None)
# the same, as a plain list that Dynamo can read while it traces (it cannot trace ContextVar.get, and an unpacked
# op must trace without a graph break); a context variable otherwise, so that threads do not see each other's calls
_TRACED: list[Packing] = []


@contextlib.contextmanager
def packed_call(packing: Packing) -> Iterator[None]:
    """Run an op's function on packed inputs, the backend reading ``packing`` through :func:`current_packing`."""
    token = _CURRENT.set(packing)
    _TRACED.append(packing)
    try:
        yield
    finally:
        _TRACED.pop()
        _CURRENT.reset(token)


def current_packing() -> Packing | None:
    """The offsets of the packed call in flight (None outside one, and in the op's unpacked calls)."""
    if torch.compiler.is_compiling():
        return _TRACED[-1] if _TRACED else None
    return _CURRENT.get()


def state_rows(B: int) -> int:
    """The rows a state has in the current call: one per sequence in a packed call, else the batch size ``B``."""
    packing = current_packing()
    return B if packing is None else packing.N


@dataclass(frozen=True)
class ChunkLayout:
    """The chunks of packed tokens [1, T]: every sequence cut into chunks of C tokens (the chunk size it was made
    for, :func:`chunk_layout`) from its start.

    ``cu_chunks`` [N + 1] int32: the first chunk of each sequence and the chunk count at the end; ``chunk_rows``
    [chunks, 2] int64: per chunk, its first packed token and how many tokens it holds (C, or fewer in a
    sequence's last chunk), what the kernels read."""

    cu_chunks: torch.Tensor
    chunk_rows: torch.Tensor


def kept(cu_seqlens: torch.Tensor, key: tuple, make: Callable[[], T_]) -> T_:
    """``make()``, kept on the offsets tensor under ``key`` until the tensor is modified in place: what a packed call
    derives from its offsets (indices on the device) is built once for all the layers of a model that share one
    ``cu_seqlens``."""
    store = cu_seqlens.__dict__.setdefault("_linattn_kept", {})
    if store.get("version") != cu_seqlens._version:
        store.clear()
        store["version"] = cu_seqlens._version
    if key not in store:
        store[key] = make()
    return store[key]


def device_offsets(cu_seqlens: torch.Tensor, offsets: tuple[int, ...] | list[int], device: torch.device
                   ) -> torch.Tensor:
    """The offsets as an int64 tensor on ``device``: ``cu_seqlens`` itself where it is there, else a copy of the
    offsets read on the host, through pinned memory without blocking (a plain host-to-device copy waits for the
    GPU's queued work: a synchronisation per layer)."""
    def make() -> torch.Tensor:
        if cu_seqlens.device == device:
            return cu_seqlens.to(torch.int64)
        host = torch.tensor(list(offsets), dtype=torch.int64)
        if device.type == "cuda":
            return host.pin_memory().to(device, non_blocking=True)
        return host.to(device)

    return kept(cu_seqlens, ("offsets", str(device)), make)


def chunk_layout(packing: Packing, chunk_size: int, device: torch.device) -> ChunkLayout:
    """The chunks of ``packing``, built on ``device`` from the offsets (only the chunk count comes from the offsets
    already read on the host: no synchronisation). Kept on the offsets tensor per chunk size and device
    (:func:`kept`)."""
    def make() -> ChunkLayout:
        offsets, C, N = packing.offsets, chunk_size, packing.N
        chunks = sum(-(-(e - s) // C) for s, e in zip(offsets[:-1], offsets[1:], strict=True))
        cu = device_offsets(packing.cu_seqlens, offsets, device)
        counts = (cu[1:] - cu[:-1] + C - 1) // C
        cu_chunks = torch.nn.functional.pad(torch.cumsum(counts, 0), (1, 0))
        # per chunk: its sequence, first packed token and token count
        seq_of_chunk = torch.repeat_interleave(torch.arange(N, device=device), counts, output_size=chunks)
        start = cu[:-1][seq_of_chunk] + (torch.arange(chunks, device=device) - cu_chunks[:-1][seq_of_chunk]) * C
        valid = torch.clamp(cu[1:][seq_of_chunk] - start, max=C)
        return ChunkLayout(cu_chunks=cu_chunks.to(torch.int32),
                           chunk_rows=torch.stack([start, valid], dim=1).contiguous())

    return kept(packing.cu_seqlens, ("chunk_layout", chunk_size, str(device)), make)
