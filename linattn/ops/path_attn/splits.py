"""Keys moved to the end of their split: groups of chunks that path_attn's flash pass crosses with one product.

The flash pass walks a query block's chain back chunk by chunk, Q <- Q P_j = Q - Q E_j: a [C, K] x [K, K] product
per (query block, earlier chunk) pair, a dependent step between every two key blocks. Grouping the chunks into
splits of S, and moving every key to the end of its split,

    K~_j = K^_j P_{j+1}^T .. P_{e}^T    (chunk j's keys, at its end, through the later chunks e of its split)
    E~_J = I - P_e .. P_f               (the split's whole product, chunks f .. e)

lets the pass cross a whole earlier split J with one product: its S key blocks all meet the same query
(the query at J's end) and are read as in plain flash attention. Chunks of the query's own split are still crossed
one by one (at most S - 1 steps, against the chunk keys K^_j and E_j).

Computed in log2(S) levels, pairing neighbouring groups (a, b) of 2^l chunks: a's keys move through b's product
(K~_a <- K~_a - K~_a E~_b^T) and E~_ab = E~_a + E~_b - E~_b E~_a. A split past the last chunk is padded with
identity chunks (E = 0), which move nothing. float32 math from the inputs' dtype, rounded once into it; the levels
are recomputed in the backward pass (a checkpoint keeps only kh and E). O(T K^2 log2 S) work.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


def split_size(split: int | str, chunks: int, split_from: int = 1) -> int:
    """The chunks per split for a pass over ``chunks`` chunks: ``split`` (a power of two, or "sqrt": the largest
    power of two at most sqrt(chunks), which balances the at most S - 1 chunk steps of a query's own split against
    its chunks / S split crossings) from ``split_from`` chunks on, else 1; at most the power of two that covers them
    all (a longer split would only add identity chunks)."""
    if split != "sqrt" and (isinstance(split, bool) or not isinstance(split, int) or split < 1 or split & (split - 1)):
        raise ValueError(f"path_attn launch setting split must be a power of two >= 1 (chunks per split) or "
                         f"\"sqrt\", got {split!r}")
    if chunks < split_from:
        return 1
    if split == "sqrt":
        split = 1 << (math.isqrt(max(chunks, 1)).bit_length() - 1)
    cover = 1 << max(chunks - 1, 0).bit_length()
    return min(split, cover)


def _levels(kh: torch.Tensor, E: torch.Tensor, split: int) -> tuple[torch.Tensor, torch.Tensor]:
    B, H, NC, K = kh.shape
    N = E.shape[2]
    C = NC // N
    pad = -N % split
    keys = F.pad(kh, (0, 0, 0, pad * C)).float()
    prod = F.pad(E, (0, 0, 0, 0, 0, pad)).float()
    group = 1
    while group < split:
        ka, kb = keys.unflatten(2, (-1, 2, group * C)).unbind(3)  # [B, H, pairs, group C, K]
        Ea, Eb = prod.unflatten(2, (-1, 2)).unbind(3)  # [B, H, pairs, K, K]
        ka = ka - ka @ Eb.transpose(-1, -2)
        prod = Ea + Eb - Eb @ Ea
        keys = torch.stack([ka, kb], dim=3).flatten(2, 4)
        group *= 2
    return keys[:, :, :NC].to(kh.dtype), prod.to(E.dtype)


def keys_to_split_end(kh: torch.Tensor, E: torch.Tensor, split: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(K~ [B, H, N C, K] like kh, E~ [B, H, ceil(N / split), K, K] like E) from the chunk keys kh [B, H, N C, K]
    and the chunks' E [B, H, N, K, K] (module docstring); ``split`` a power of two (1: kh and E themselves)."""
    if split == 1:
        return kh, E
    if torch.is_grad_enabled() and (kh.requires_grad or E.requires_grad):
        return checkpoint(_levels, kh, E, split, use_reentrant=False)
    return _levels(kh, E, split)
