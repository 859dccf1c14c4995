"""Batches too large for one kernel launch, run as slices of rows.

The Triton kernels put batch rows times heads (B H, or B H_kv) on a launch grid's second or third axis, which CUDA
caps at 65,535 programs (the first axis holds 2^31 - 1: the chunks and blocks go there). A call with B H over that
limit (4,096 rows of 16 heads) runs as calls on slices of at most GRID_LIMIT // H rows, their outputs and final states
concatenated along the batch: the rows of a batch are independent, so this is exact on every backend (the ops
apply it on all of them, which keeps one code path). Packed calls (``cu_seqlens``) have one row.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

# CUDA's cap on a launch grid's second and third axes (the first holds 2^31 - 1); tests lower it
GRID_LIMIT = 65535


def rows_per_call(q: object) -> int | None:
    """The most rows of ``q`` [B, T, H, K] one call takes, when its B H exceeds GRID_LIMIT; else None (one call)."""
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        return None  # the op's own checks name a wrong q
    # no int(): under torch.compile with dynamic shapes the comparison guards on B H without specialising B
    if q.shape[0] * q.shape[2] <= GRID_LIMIT or q.shape[2] > GRID_LIMIT:
        return None
    return GRID_LIMIT // int(q.shape[2])


def state_rows(state: Any, rows: slice) -> Any:
    """The rows ``rows`` of a state: a tensor (batch at dim 0), a tuple or list of states, a dict of them, or a
    dataclass whose state fields are sliced (KVCache: keys, values, extras); anything else unchanged."""
    if isinstance(state, torch.Tensor):
        return state[rows]
    if isinstance(state, dict):
        return {name: state_rows(x, rows) for name, x in state.items()}
    if isinstance(state, (tuple, list)):
        return type(state)(state_rows(x, rows) for x in state)
    if dataclasses.is_dataclass(state) and not isinstance(state, type):
        return dataclasses.replace(state, **{f.name: state_rows(getattr(state, f.name), rows)
                                             for f in dataclasses.fields(state) if f.init})
    return state


def state_tensors(state: Any) -> list[torch.Tensor]:
    """Every tensor of a state (as :func:`state_rows` walks it)."""
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        state = list(state.values())
    elif dataclasses.is_dataclass(state) and not isinstance(state, type):
        state = [getattr(state, f.name) for f in dataclasses.fields(state) if f.init]
    if isinstance(state, (tuple, list)):
        return [t for item in state for t in state_tensors(item)]
    return []


def cat_states(states: list[Any]) -> Any:
    """The states of consecutive row slices joined along the batch (the inverse of :func:`state_rows`)."""
    first = states[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(states, dim=0)
    if isinstance(first, dict):
        return {name: cat_states([s[name] for s in states]) for name in first}
    if isinstance(first, (tuple, list)):
        return type(first)(cat_states([s[j] for s in states]) for j in range(len(first)))
    if dataclasses.is_dataclass(first) and not isinstance(first, type):
        return dataclasses.replace(first, **{f.name: cat_states([getattr(s, f.name) for s in states])
                                             for f in dataclasses.fields(first) if f.init})
    return first


def run_in_row_slices(fn: Callable, arguments: dict[str, Any], token_args: tuple[str, ...], rows: int) -> tuple:
    """``fn(**arguments)`` (an op returning (o [B, ...], final state or None)) as calls on ``rows`` batch rows at a
    time: the ``token_args`` tensors and the initial state sliced along dim 0, the outputs and final states joined.
    A token argument or state tensor without B rows is left to ``fn``'s own checks, which name it with the call's
    shapes (one call, before any compute)."""
    B = int(arguments[token_args[0]].shape[0])
    given = [arguments[name] for name in token_args] + state_tensors(arguments.get("initial_state"))
    if any(isinstance(x, torch.Tensor) and (x.dim() == 0 or x.shape[0] != B) for x in given):
        return fn(**arguments)
    outputs, finals = [], []
    for start in range(0, B, rows):
        part = slice(start, min(start + rows, B))
        call = dict(arguments)
        for name in token_args:
            if isinstance(arguments[name], torch.Tensor):
                call[name] = arguments[name][part]
        call["initial_state"] = state_rows(arguments.get("initial_state"), part)
        o, final = fn(**call)
        outputs.append(o)
        finals.append(final)
    return torch.cat(outputs, dim=0), (None if finals[0] is None else cat_states(finals))
