"""Argument checks shared by ttt_linear and titans (on top of common/checks.py)."""

from __future__ import annotations

import torch

from ..common.checks import Dims, check_shape, compute_dtype
from .state import MiniBatchState

# What the Triton kernels take (ttt/triton_linear.py, ttt/triton.py): a scan program holds the [K, V] weights (or
# their gradient) in registers, and mini-batches of 16 or 32 tokens (titans: larger ones exceeded an H100's shared
# memory in the backward kernel; ttt_linear's parallel kernels work on chunks of 64 tokens).
TRITON_MINI_BATCH_SIZES = (16, 32)
TRITON_MAX_HEAD_DIM = 128


def triton_takes(mini_batch_size: int, K: int, V: int) -> bool:
    """Whether ttt_linear's Triton backend runs this mini-batch size and these head dims ("auto" falls back to
    chunk otherwise)."""
    return mini_batch_size in TRITON_MINI_BATCH_SIZES and max(K, V) <= TRITON_MAX_HEAD_DIM


def titans_triton_takes(mini_batch_size: int, K: int) -> bool:
    """Whether titans' Triton backend runs this mini-batch size and key dim (its programs split V into blocks, so
    any V); "auto" falls back to chunk otherwise."""
    return mini_batch_size in TRITON_MINI_BATCH_SIZES and K <= TRITON_MAX_HEAD_DIM


def check_mini_batch_size(mini_batch_size: object) -> int:
    """A positive int."""
    if not isinstance(mini_batch_size, int) or isinstance(mini_batch_size, bool) or mini_batch_size < 1:
        raise ValueError(f"mini_batch_size must be a positive int, got {mini_batch_size!r}")
    return mini_batch_size


def check_weights(name: str, state: object, d: Dims, n: int) -> tuple[torch.Tensor, ...]:
    """A [B, H, K, V] tensor (n = 1) or a pair of them (n = 2: titans' (M, S))."""
    if n == 1:
        return (check_shape(name, state, (d.B, d.H, d.K, d.V), "[B, H, K, V]"),)
    if not isinstance(state, (tuple, list)) or len(state) != 2:
        raise TypeError(f"{name} must be a pair (M [B, H, K, V], S [B, H, K, V]), got {type(state).__name__}")
    return tuple(check_shape(f"{name}[{i}] ({m})", x, (d.B, d.H, d.K, d.V), "[B, H, K, V]")
                 for i, (m, x) in enumerate(zip("MS", state)))


def check_step_state(state: object, d: Dims, n: int, mini_batch_size: int, like: torch.Tensor) -> MiniBatchState:
    """None (zeros), the op's state (a mini-batch boundary) or a :class:`MiniBatchState`; returned in
    the compute dtype of ``like`` (float32, float64 for float64)."""
    dt = compute_dtype(like)
    if state is None:
        zeros = torch.zeros(d.B, d.H, d.K, d.V, dtype=dt, device=like.device)
        return MiniBatchState.at_boundary((zeros,) * n)
    if not isinstance(state, MiniBatchState):
        return MiniBatchState.at_boundary(tuple(x.to(dt) for x in check_weights("state", state, d, n)))
    if not isinstance(state.current, tuple) or len(state.current) != n:
        raise TypeError(f"state.current must be a tuple of {n} tensors [B, H, K, V], got {state.current!r:.80}")
    current = check_weights("state.current", state.current[0] if n == 1 else state.current, d, n)
    start = check_shape("state.start", state.start, (d.B, d.H, d.K, d.V), "[B, H, K, V]")
    if not isinstance(state.count, int) or not 0 <= state.count < mini_batch_size:
        raise ValueError(f"state.count must be an int in [0, mini_batch_size = {mini_batch_size}), got {state.count!r}")
    return MiniBatchState(tuple(x.to(dt) for x in current), start.to(dt), state.count)


def resolve_inner_norm(inner_norm: object, norm_weight: object, norm_bias: object, norm_eps: object,
                       d: Dims, like: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(weight, bias) [H, V] of the inner LayerNorm (defaults 1 and 0), or (None, None) without it."""
    if not isinstance(inner_norm, bool):
        raise TypeError(f"inner_norm must be a bool, got {type(inner_norm).__name__}")
    if not inner_norm:
        if norm_weight is not None or norm_bias is not None:
            raise ValueError("norm_weight / norm_bias were given but inner_norm=False; pass inner_norm=True")
        return None, None
    if d.K != d.V:
        raise ValueError(f"inner_norm=True needs K == V (the residual f(x) = x + LN(W^T x)), got K={d.K}, V={d.V}")
    if not isinstance(norm_eps, (int, float)) or isinstance(norm_eps, bool) or norm_eps <= 0:
        raise ValueError(f"norm_eps must be a positive float, got {norm_eps!r}")
    ones = torch.ones(d.H, d.V, dtype=like.dtype, device=like.device)
    weight = ones if norm_weight is None else check_shape("norm_weight", norm_weight, (d.H, d.V), "[H, V]")
    bias = torch.zeros_like(ones) if norm_bias is None else check_shape("norm_bias", norm_bias, (d.H, d.V), "[H, V]")
    return weight, bias


def split_initial_state(initial_state: object, d: Dims, n: int, mini_batch_size: int,
                        like: torch.Tensor) -> tuple[object, MiniBatchState | None]:
    """An op's ``initial_state``: None, the op's own state (W, or (M, S); a mini-batch boundary) or the
    :class:`MiniBatchState` a step returned. Returns (the state for the op's backends, or None; the step state
    when it is inside a mini-batch, whose buffered tokens the op's first tokens must complete, else None)."""
    if initial_state is None:
        return None, None
    if not isinstance(initial_state, MiniBatchState):
        weights = check_weights("initial_state", initial_state, d, n)
        return (weights[0] if n == 1 else weights), None
    st = check_step_state(initial_state, d, n, mini_batch_size, like)
    if st.count or not _same_tensor(st.start, st.current[0]):  # a step takes its gradients at ``start`` until
        return None, st                                         # the mini-batch ends, even at count 0
    return (st.current[0] if n == 1 else st.current), None


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether a and b view the same memory the same way (no values read: no host sync)."""
    return a is b or (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
                      and a.dtype == b.dtype and a.device == b.device)
