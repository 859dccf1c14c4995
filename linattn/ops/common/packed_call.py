"""Packed sequences run natively by a backend: the offsets of the call in flight, and the chunk-aligned layout.

:func:`linattn.ops.common.varlen.packable` runs a packed call (``cu_seqlens``) by splitting it into one call per
sequence, unless the backend the call resolves to takes packed inputs itself (its implementation has the attribute
``native_cu_seqlens = True``). Then the op's own function runs once on the packed inputs inside
:func:`packed_call`: the checks accept one initial-state row per sequence (:func:`state_rows`) and the backend reads
the offsets from :func:`current_packing`.

The chunked Triton kernels take packed inputs in a chunk-aligned layout (:class:`ChunkLayout`): sequence n occupies
the chunks [c_n, c_{n+1}) of a padded batch row, its tail filled with neutral tokens (q = k = v = 0, beta = 0, no
decay), which leave the state as it is, so the state at the end of a sequence's last chunk is its final state. Each
chunk then belongs to one sequence: the in-chunk kernels run unchanged and the kernels that carry the state across
chunks start and end it at the sequence's own chunks (read from ``cu_chunks``).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import torch

T_ = TypeVar("T_")

# where ChunkLayout's copies run as the Triton kernels of triton_relayout.py: "cuda" (CUDA tensors, where Triton
# imports), "always" (also CPU tensors, through Triton's interpreter: for tests) or "never" (index_copy everywhere)
RELAYOUT_KERNELS = "cuda"
# the largest feature count (product of the trailing shape) the kernels take; wider rows take index_copy. The
# kernels split rows over a second grid axis, so this only keeps that axis far below CUDA's grid limit
RELAYOUT_MAX_FEATURES = 1 << 24
_RELAYOUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


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
    """Packed tokens [1, T] re-laid so that every sequence starts a chunk of ``chunk_size`` tokens.

    ``index`` [T] int64: the padded position of each packed token; ``cu_chunks`` [N + 1] int32: the first chunk of
    each sequence and the chunk count at the end; ``padded``: the padded length (chunks * chunk_size);
    ``chunk_rows`` [chunks, 2] int64: per padded chunk, its first packed token and how many of its rows are tokens
    (the rest are padding), what the copy kernels read."""

    index: torch.Tensor
    cu_chunks: torch.Tensor
    padded: int
    chunk_size: int
    chunk_rows: torch.Tensor

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """x [1, T, ...] as [1, padded, ...] (contiguous), zeros at the padded positions; differentiable (the
        gradients of the padded positions are dropped)."""
        return self.pack_many(x)[0]

    def pack_many(self, *xs: torch.Tensor | None) -> list[torch.Tensor | None]:
        """:meth:`pack` of each x (None stays None). On the copy kernels, tensors of one shape and dtype share
        launches (q, k and p; v where V = K; g and beta)."""
        out: list[torch.Tensor | None] = [None] * len(xs)
        groups: list[list[int]] = []
        for i, x in enumerate(xs):
            if x is None:
                continue
            if not self._kernels(x):
                out[i] = x.new_zeros(x.shape[0], self.padded, *x.shape[2:]).index_copy(1, self.index, x)
                continue
            for group in groups:
                y = xs[group[0]]
                if y.shape == x.shape and y.dtype == x.dtype:
                    group.append(i)
                    break
            else:
                groups.append([i])
        if groups:
            from . import triton_relayout

            for group in groups:
                packed = triton_relayout.pack([xs[i] for i in group], self.chunk_rows, self.padded,
                                              self.chunk_size)
                for i, y in zip(group, packed, strict=True):
                    out[i] = y
        return out

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        """x [1, padded, ...] back at the packed positions [1, T, ...] (padded positions dropped)."""
        if self._kernels(x):
            from . import triton_relayout

            return triton_relayout.unpack([x], self.chunk_rows, self.index.shape[0], self.chunk_size)[0]
        return _Unpack.apply(x, self.index)

    def _kernels(self, x: torch.Tensor) -> bool:
        """Whether the copies of x run as Triton kernels (see :data:`RELAYOUT_KERNELS`): a contiguous [1, rows,
        ...] tensor of a floating dtype the backends use, with at most RELAYOUT_MAX_FEATURES features a row."""
        if RELAYOUT_KERNELS == "never":
            return False
        if RELAYOUT_KERNELS != "always" and x.device.type != "cuda":
            return False
        if x.dim() < 2 or x.shape[0] != 1 or x.dtype not in _RELAYOUT_DTYPES or not x.is_contiguous():
            return False
        if math.prod(x.shape[2:]) > RELAYOUT_MAX_FEATURES:
            return False
        from .triton_compat import triton_importable

        return triton_importable()


class _Unpack(torch.autograd.Function):
    """x.index_select(1, index) whose backward copies instead of accumulating: the layout's index has no repeats, so
    the gradient is index_copy into zeros. Autograd's own backward of index_select is index_add, whose atomic adds
    in bf16 took 7.1 ms of a 123 ms packed training step on an H100 (12 layers): 0.15 ms a call against
    index_copy's 0.04 ms."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(index)
        ctx.padded = x.shape[1]
        return x.index_select(1, index)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (index,) = ctx.saved_tensors
        out = grad.new_zeros(grad.shape[0], ctx.padded, *grad.shape[2:])
        return out.index_copy(1, index, grad), None


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
    """The chunk-aligned layout of ``packing``. The index is built on ``device`` from the offsets; only the padded
    length comes from the offsets already read on the host. Kept on the offsets tensor per chunk size and device
    (:func:`kept`)."""
    def make() -> ChunkLayout:
        offsets, C = packing.offsets, chunk_size
        N, T = packing.N, offsets[-1]
        chunks = sum(-(-(e - s) // C) for s, e in zip(offsets[:-1], offsets[1:], strict=True))
        cu = device_offsets(packing.cu_seqlens, offsets, device)
        lengths = cu[1:] - cu[:-1]
        counts = (lengths + C - 1) // C
        cu_chunks = torch.nn.functional.pad(torch.cumsum(counts, 0), (1, 0))
        seq = torch.repeat_interleave(torch.arange(N, device=device), lengths, output_size=T)
        index = torch.arange(T, device=device) + (cu_chunks[:-1] * C - cu[:-1])[seq]
        # per padded chunk: its sequence, first packed token and token rows (what the copy kernels read)
        seq_of_chunk = torch.repeat_interleave(torch.arange(N, device=device), counts, output_size=chunks)
        start = cu[:-1][seq_of_chunk] + (torch.arange(chunks, device=device) - cu_chunks[:-1][seq_of_chunk]) * C
        valid = torch.clamp(cu[1:][seq_of_chunk] - start, max=C)
        return ChunkLayout(index=index, cu_chunks=cu_chunks.to(torch.int32), padded=chunks * C, chunk_size=C,
                           chunk_rows=torch.stack([start, valid], dim=1).contiguous())

    return kept(packing.cu_seqlens, ("chunk_layout", chunk_size, str(device)), make)
