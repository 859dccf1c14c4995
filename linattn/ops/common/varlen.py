"""Packed variable-length sequences (``cu_seqlens``, FLA's convention) for every op.

N sequences of lengths L_1..L_N are packed along time into one batch row: q [1, T, H, K] with
T = L_1 + ... + L_N, and ``cu_seqlens`` = [0, L_1, L_1 + L_2, ..., T] (1-D, int32 or int64, N + 1
entries, strictly increasing: an empty sequence is refused, since it has neither an output nor a
meaningful final state). Each sequence runs as if alone: its state starts from its own initial state
(zeros when ``initial_state`` is None) and nothing crosses a boundary.

States with cu_seqlens hold one row per sequence: a tensor state ([N, H, K, V]) or a pair of them
(MesaNet's (G, H), Titans' (M, S)) has N along dim 0; a KVCache (the softmax family: each sequence's
cache has its own length) is a list of N caches with batch 1.

:func:`packable` adds ``cu_seqlens`` to an op. Its path here splits the packed inputs at the offsets,
runs the op on each sequence (any backend, the same code as an unpacked call) and concatenates the
outputs along time and the final states along dim 0; autograd flows through the slices and the
concatenation. Where the backend a call resolves to takes packed inputs itself (its implementation has
``native_cu_seqlens = True``: the chunked Triton kernels of the delta and GLA families), the op instead runs once
on the packed inputs (linattn/ops/common/packed_call.py). The offsets are read on the host (one synchronisation on
CUDA per offsets tensor), so a packed call does not trace under ``torch.compile(fullgraph=True)``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch

from .batch_slices import cat_states, rows_per_call, run_in_row_slices, state_rows, state_tensors
from .checks import check_float_tensor
from .kv_cache import KVCache
from .packed_call import Packing, device_offsets, kept, packed_call

INDEX_DTYPES = (torch.int32, torch.int64)


def check_cu_seqlens(cu_seqlens: object, T: int, device: torch.device) -> list[int]:
    """Validate ``cu_seqlens`` (1-D int32/int64, [0, ..., T] strictly increasing, on ``device`` or the CPU)
    for a packed length ``T``; return the offsets as Python ints (reads the tensor: a host sync on CUDA)."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"cu_seqlens must be a 1-D int32 or int64 tensor of offsets [N+1], "
                        f"got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype not in INDEX_DTYPES:
        raise TypeError(f"cu_seqlens must have dtype int32 or int64, got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be 1-D with N+1 >= 2 offsets, got shape {list(cu_seqlens.shape)}")
    if cu_seqlens.device.type not in ("cpu", device.type) or (
            cu_seqlens.device.type == device.type and cu_seqlens.device != device):
        raise ValueError(f"cu_seqlens must be on the CPU or on q's device {device}, got {cu_seqlens.device}")
    # the offsets are read once per offsets tensor (kept on it until it is modified in place): the embedding, every
    # ShortConv and every op of a packed model call check the same tensor, and each read is a host sync on CUDA
    seen = cu_seqlens.__dict__.get("_linattn_offsets")
    if seen is not None and seen[0] == cu_seqlens._version:
        offsets = list(seen[1])
    else:
        offsets = [int(x) for x in cu_seqlens.tolist()]
        cu_seqlens.__dict__["_linattn_offsets"] = (cu_seqlens._version, tuple(offsets))
    if offsets[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {offsets[0]} (offsets {_short(offsets)})")
    if offsets[-1] != T:
        raise ValueError(f"cu_seqlens must end at the packed length T = {T}, got {offsets[-1]} "
                         f"(offsets {_short(offsets)})")
    for i in range(1, len(offsets)):
        if offsets[i] <= offsets[i - 1]:
            raise ValueError(f"cu_seqlens must be strictly increasing (empty sequences are refused), got "
                             f"cu_seqlens[{i - 1}] = {offsets[i - 1]} and cu_seqlens[{i}] = {offsets[i]}")
    return offsets


def sequence_positions(offsets: list[int], device: torch.device, cu_seqlens: torch.Tensor | None = None
                       ) -> torch.Tensor:
    """Each token's position inside its own sequence, [1, T] int64 (0 at every offset): positions restart per
    packed sequence (RoPE, position-dependent gates). Given the offsets tensor ``cu_seqlens`` they are built once
    per tensor and device (the layers of a model share them) with no host synchronisation."""
    def make() -> torch.Tensor:
        cu = torch.tensor(offsets, device=device) if cu_seqlens is None else device_offsets(cu_seqlens, offsets,
                                                                                                 device)
        lengths = cu[1:] - cu[:-1]
        starts = torch.repeat_interleave(cu[:-1], lengths, output_size=offsets[-1])
        return (torch.arange(offsets[-1], device=device) - starts)[None]

    return make() if cu_seqlens is None else kept(cu_seqlens, ("positions", str(device)), make)


def mask_to_cu_seqlens(attention_mask: object, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """An attention mask [B, T] (bool, or integers 0/1; 1 marks a token, 0 padding, on either side) as packed
    sequences, one per row: (the indices of the tokens in the flattened [B * T], cu_seqlens [B + 1] int32).
    ``shape`` is the inputs' [B, T]; every row needs at least one token. Reads the mask (a host sync on CUDA)."""
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(f"attention_mask must be a [B, T] tensor of 0/1 or bool, got {type(attention_mask).__name__}")
    if attention_mask.is_floating_point() or attention_mask.is_complex():
        raise TypeError(f"attention_mask must be bool or integer (1: token, 0: padding), got {attention_mask.dtype}")
    if tuple(attention_mask.shape) != tuple(shape):
        raise ValueError(f"attention_mask must have the inputs' shape [B, T] = {list(shape)}, "
                         f"got {list(attention_mask.shape)}")
    mask = attention_mask.to(torch.int64)
    if bool(((mask != 0) & (mask != 1)).any()):
        raise ValueError("attention_mask values must be 0 (padding) or 1 (token)")
    lengths = mask.sum(dim=1)
    if bool((lengths == 0).any()):
        rows = torch.nonzero(lengths == 0).flatten().tolist()
        raise ValueError(f"attention_mask must mark at least one token in every row; rows {rows} have none")
    cu_seqlens = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
    return torch.nonzero(mask.flatten()).flatten(), cu_seqlens


def _short(offsets: list[int]) -> str:
    return str(offsets) if len(offsets) <= 8 else f"[{offsets[0]}, {offsets[1]}, ..., {offsets[-1]}]"


def check_packed_batch(name: str, x: torch.Tensor) -> None:
    """A packed input has batch size 1 (the sequences lie along time)."""
    if x.shape[0] != 1:
        raise ValueError(f"{name} must have batch size B = 1 with cu_seqlens (the sequences are packed along T), "
                         f"got shape {list(x.shape)}")


def per_sequence_state(initial_state: object, N: int) -> list[object]:
    """Split a packed ``initial_state`` into N per-sequence states with batch 1 (None: N Nones)."""
    if initial_state is None:
        return [None] * N
    if isinstance(initial_state, KVCache):
        raise TypeError(f"initial_state with cu_seqlens must be a list of N = {N} KVCaches (one per sequence, "
                        "batch 1), got one KVCache")
    if isinstance(initial_state, list):  # one cache per sequence (the softmax family)
        if len(initial_state) != N:
            raise ValueError(f"initial_state with cu_seqlens must hold N = {N} states (one per sequence), "
                             f"got {len(initial_state)}")
        return list(initial_state)
    # a tensor, a pair of them, or a dataclass (e.g. a mini-batch learner's step state): its tensors split by row
    _check_rows(state_tensors(initial_state), N)
    return [state_rows(initial_state, slice(i, i + 1)) for i in range(N)]


def _check_rows(tensors: list[torch.Tensor], N: int) -> None:
    for t in tensors:
        if t.dim() == 0 or t.shape[0] != N:
            raise ValueError(f"initial_state with cu_seqlens must have N = {N} sequences along dim 0 "
                             f"([N, H, K, V]), got shape {list(t.shape)}")


def concat_states(states: list[Any]) -> Any:
    """Per-sequence final states (batch 1) as one packed state: tensors and pairs concatenated along dim 0,
    dataclass states (KVCache) kept as a list."""
    first = states[0]
    if first is None:
        return None
    if dataclasses.is_dataclass(first):  # a cache per sequence: their lengths differ
        return list(states)
    if not isinstance(first, (torch.Tensor, tuple)):
        raise TypeError(f"cannot pack final states of type {type(first).__name__}")
    return cat_states(states)


def packable(*token_args: str, native: Callable[[dict[str, Any]], bool] | None = None
             ) -> Callable[[Callable], Callable]:
    """Give an op a ``cu_seqlens=None`` keyword. ``token_args`` name the op's arguments with time at dim 1
    (q first; an argument of length m T, e.g. gated_delta_product's interleaved keys, is cut at m times the
    offsets); every other argument is passed to each sequence's call unchanged. ``native(arguments)`` (the call's
    arguments by name) says whether the call's backend runs packed inputs itself: the op then runs once, inside
    :func:`packed_call`, instead of once per sequence. An unpacked call whose batch rows times heads exceed a launch
    grid's axis runs in slices of rows (common/batch_slices.py)."""

    def wrap(fn: Callable) -> Callable:
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def op(*args: Any, cu_seqlens: torch.Tensor | None = None, **kwargs: Any) -> tuple:
            if cu_seqlens is None:
                rows = rows_per_call(args[0] if args else kwargs.get(token_args[0]))
                if rows is None:
                    return fn(*args, **kwargs)
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            arguments = dict(bound.arguments)
            if cu_seqlens is None:
                return run_in_row_slices(fn, arguments, token_args, rows)
            if native is not None and native(arguments):
                return run_native(fn, arguments, cu_seqlens, token_args)
            return run_packed(fn, arguments, cu_seqlens, token_args)

        params = [*signature.parameters.values(),
                  inspect.Parameter("cu_seqlens", inspect.Parameter.KEYWORD_ONLY, default=None,
                                    annotation="torch.Tensor | None")]
        op.__signature__ = signature.replace(parameters=params)
        return op

    return wrap


def check_packed_arguments(arguments: dict[str, Any], cu_seqlens: object, token_args: tuple[str, ...]) -> list[int]:
    """Check a packed call's offsets and token arguments (batch 1, a multiple of T positions); return the offsets."""
    q = check_float_tensor(token_args[0], arguments[token_args[0]], 4, "[B, T, H, K]")
    check_packed_batch(token_args[0], q)
    T = int(q.shape[1])
    offsets = check_cu_seqlens(cu_seqlens, T, q.device)
    for name in token_args[1:]:
        x = arguments[name]
        if not isinstance(x, torch.Tensor) or x.dim() < 2:
            continue  # None (an optional argument such as path_attn's g), or wrong: the op's own check names it
        check_packed_batch(name, x)
        if x.shape[1] % T:
            raise ValueError(f"{name} must have a multiple of T = {T} positions along dim 1 with cu_seqlens, "
                             f"got shape {list(x.shape)}")
    return offsets


def run_native(fn: Callable, arguments: dict[str, Any], cu_seqlens: torch.Tensor, token_args: tuple[str, ...]
               ) -> tuple:
    """Run ``fn`` once on the packed inputs, its backend reading the offsets (:func:`packed_call`)."""
    offsets = check_packed_arguments(arguments, cu_seqlens, token_args)
    per_sequence_state(arguments.get("initial_state"), len(offsets) - 1)  # one row per sequence, named if not
    with packed_call(Packing(cu_seqlens=cu_seqlens, offsets=tuple(offsets))):
        return fn(**arguments)


def run_packed(fn: Callable, arguments: dict[str, Any], cu_seqlens: object, token_args: tuple[str, ...]) -> tuple:
    """Run ``fn`` on each sequence of a packed call and assemble (o [1, T, H, V], packed final state or None)."""
    offsets = check_packed_arguments(arguments, cu_seqlens, token_args)
    T = offsets[-1]
    N = len(offsets) - 1
    states = per_sequence_state(arguments.get("initial_state"), N)
    outputs, finals = [], []
    with sdpa_for_new_lengths(arguments[token_args[0]]):
        for i in range(N):
            s, e = offsets[i], offsets[i + 1]
            call = dict(arguments)
            for name in token_args:
                x = arguments[name]
                if isinstance(x, torch.Tensor) and x.dim() >= 2:
                    m = x.shape[1] // T
                    call[name] = x[:, s * m:e * m]
            call["initial_state"] = states[i]
            o, final = fn(**call)
            outputs.append(o)
            finals.append(final)
    return torch.cat(outputs, dim=1), concat_states(finals)


def sdpa_for_new_lengths(x: torch.Tensor) -> contextlib.AbstractContextManager:
    """On CUDA, SDPA without its cuDNN backend, which builds a plan for every new sequence length: 186 ms for a
    length's first forward and backward on an H100 (0.4-0.6 ms once built), against 0.4 ms for the flash kernel.
    A packed call's sequences bring new lengths at every step: with cuDNN a packed Transformer step took 1.5 s."""
    if not x.is_cuda:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])
