"""Chunking helpers for the chunkwise-parallel backends.

A sequence of length T is padded at the end to a multiple of the chunk size C and viewed as
[B, N, C, ...] with N = ceil(T / C). Padding must be neutral for the op: zeros for q, k, v, beta and
log gates (g = 0 means "no decay"), so padded steps change neither outputs nor the state.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def pad_time(x: torch.Tensor, C: int, dim: int = 1, value: float = 0.0) -> torch.Tensor:
    """Pad ``x`` with ``value`` along ``dim`` up to a multiple of ``C``."""
    T = x.shape[dim]
    pad = (-T) % C
    if pad == 0:
        return x
    spec = [0, 0] * (x.dim() - 1 - dim) + [0, pad]
    return F.pad(x, spec, value=value)


def to_chunks(x: torch.Tensor, C: int) -> torch.Tensor:
    """[B, T, ...] -> [B, N, C, ...] after zero-padding T to a multiple of C."""
    x = pad_time(x, C, dim=1)
    return x.reshape(x.shape[0], x.shape[1] // C, C, *x.shape[2:])


def from_chunks(x: torch.Tensor, T: int) -> torch.Tensor:
    """[B, N, C, ...] -> [B, T, ...], dropping the padding."""
    return x.reshape(x.shape[0], x.shape[1] * x.shape[2], *x.shape[3:])[:, :T]


def chunk_local_cumsum(g: torch.Tensor, C: int) -> torch.Tensor:
    """[B, T, ...] log gates -> [B, N, C, ...] cumulative sums restarted at every chunk boundary.

    Only differences within one chunk are ever exponentiated, so nothing over- or underflows
    for any T (never exp of a cumulative sum over more than one chunk).
    """
    return torch.cumsum(to_chunks(g, C), dim=2)
