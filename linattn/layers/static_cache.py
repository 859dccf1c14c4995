"""Static decoding buffers of one layer, updated in place by single-token steps.

A :class:`StaticLayerCache` holds what a :class:`~linattn.layers.cache.LayerCache` holds (the ShortConv
caches and the mixer's state), but in buffers allocated once, of fixed shape and address, plus the
position of every row as a device tensor ``pos`` [B] (shared by the layers of a model). A static step
reads and overwrites these buffers; it allocates nothing that outlives it, reads no tensor value on the
host and takes no branch on one, so a CUDA graph captured around one step replays every later step.

State layouts (float32; float64 for a float64 model): a matrix-state mixer keeps its op's state shape
([B, H, K, V], MesaNet's pair (G, H)); TTT-Linear and Titans a :class:`StaticMiniBatch` (the mini-batch
phase is pos % mini_batch_size, per row); the softmax family a :class:`StaticKV` sized ``max_length``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class StaticKV:
    """Keys ``k`` [B, H_kv, L, K] and values ``v`` [B, H_kv, L, V] for L = max_length positions, plus
    per-position extras [B, H, L] (FoX's log forget gates, PaTH's log decays). Heads come before time so
    that one head's [L, K] keys are a contiguous matrix (no copy of the buffer at a read)."""

    k: torch.Tensor
    v: torch.Tensor
    extras: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def max_length(self) -> int:
        return int(self.k.shape[2])


@dataclass
class StaticMiniBatch:
    """TTT-Linear / Titans: ``current`` (ttt_linear: (W,), titans: (M, S)) and ``start``, the weights the
    current mini-batch of each row started with, all [B, H, K, V]."""

    current: tuple[torch.Tensor, ...]
    start: torch.Tensor


@dataclass
class StaticLayerCache:
    """ShortConv caches by stream name ([B, W-1, D] each), the mixer's state buffers (see the module
    docstring) and ``pos`` [B] int64: the number of tokens each row has seen (the next token's position)."""

    conv: dict[str, torch.Tensor]
    state: Any
    pos: torch.Tensor

    def buffers(self) -> Iterator[torch.Tensor]:
        """Every conv and state buffer (not ``pos``, which the model owns)."""
        yield from self.conv.values()
        yield from state_tensors(self.state)

    def zero_(self) -> None:
        """Zero every conv and state buffer in place (their addresses, which a captured graph reads, stay)."""
        for x in self.buffers():
            x.zero_()


def state_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of recurrent states and KV buffers for activations of ``dtype`` (the ops' compute dtype)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def state_tensors(state: Any) -> Iterator[torch.Tensor]:
    """The tensors of a state buffer structure (a tensor, a tuple of them, StaticKV, StaticMiniBatch)."""
    if isinstance(state, torch.Tensor):
        yield state
    elif isinstance(state, (tuple, list)):
        for x in state:
            yield from state_tensors(x)
    elif isinstance(state, StaticKV):
        yield state.k
        yield state.v
        yield from state.extras.values()
    elif isinstance(state, StaticMiniBatch):
        yield from state.current
        yield state.start
    elif state is not None:
        raise TypeError(f"unknown static state type {type(state).__name__}")


def copy_state_(dst: Any, src: Any) -> None:
    """Copy the state ``src`` into the buffers ``dst`` of the same structure (tensor or tuple of tensors)."""
    if isinstance(dst, torch.Tensor):
        if dst is not src:
            dst.copy_(src)
        return
    if not isinstance(dst, (tuple, list)) or not isinstance(src, (tuple, list)) or len(dst) != len(src):
        raise TypeError(f"cannot copy a state of type {type(src).__name__} into buffers {type(dst).__name__}")
    for d, s in zip(dst, src):
        copy_state_(d, s)


def copy_rows_(dst: Any, src: Any, rows: torch.Tensor) -> None:
    """dst[rows] = src for a state structure (tensor or tuple of tensors) whose leading dim is the batch."""
    if isinstance(dst, torch.Tensor):
        dst.index_copy_(0, rows, src.to(dst.dtype))
        return
    if not isinstance(dst, (tuple, list)) or not isinstance(src, (tuple, list)) or len(dst) != len(src):
        raise TypeError(f"cannot copy a state of type {type(src).__name__} into buffers {type(dst).__name__}")
    for d, s in zip(dst, src):
        copy_rows_(d, s, rows)
