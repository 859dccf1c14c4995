"""Pieces shared by the chunkwise-parallel backends of the decay family (and any linear RNN).

A chunk backend computes everything that does not depend on the state entering a chunk for all
chunks at once, in the layout [B, H, N, C, D] (N chunks of C tokens). Only the state recurrence
between chunks,

    S_{n+1} = decay_n ⊙ S_n + U_n,

runs as a Python loop over the N chunks (:func:`chunk_state_scan`).
"""

from __future__ import annotations

import torch

from .chunking import to_chunks


def chunks_heads_first(x: torch.Tensor, C: int) -> torch.Tensor:
    """[B, T, H, ...] -> [B, H, N, C, ...] (time zero-padded to a multiple of C)."""
    x = to_chunks(x, C)  # [B, N, C, H, ...]
    return x.movedim(3, 1)


def chunks_heads_last(x: torch.Tensor, T: int) -> torch.Tensor:
    """[B, H, N, C, ...] -> [B, T, H, ...], dropping the padding (inverse of :func:`chunks_heads_first`)."""
    x = x.movedim(1, 3)  # [B, N, C, H, ...]
    return x.reshape(x.shape[0], x.shape[1] * x.shape[2], *x.shape[3:])[:, :T]


def chunk_state_scan(
    decay: torch.Tensor, U: torch.Tensor, initial_state: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run S_{n+1} = decay_n ⊙ S_n + U_n over the chunks n = 0..N-1, starting from S_0 = initial_state.

    Args: ``decay`` [B, H, N, K, 1] (per key channel) or [B, H, N, 1, 1] (scalar per head), the total
    decay over chunk n (entries in [0, 1]); ``U`` [B, H, N, K, V], the state that chunk n writes on
    its own; ``initial_state`` [B, H, K, V] or None (zeros), in U's dtype.
    Returns (the states entering every chunk [B, H, N, K, V], the state after the last chunk).
    """
    B, H, N, K, V = U.shape
    S = U.new_zeros(B, H, K, V) if initial_state is None else initial_state.to(U.dtype)
    entering = []
    # unbind once: indexing U[:, :, n] in the loop would make autograd write N full-size zero tensors
    for decay_n, U_n in zip(decay.unbind(2), U.unbind(2)):
        entering.append(S)
        S = decay_n * S + U_n
    return torch.stack(entering, dim=2), S


def largest_divisor_at_most(C: int, limit: int) -> int:
    """The largest divisor of C that is <= limit (the sub-chunk size of a chunk of C tokens)."""
    return max(d for d in range(1, min(C, limit) + 1) if C % d == 0)
