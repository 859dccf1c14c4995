"""Keys moved to the end of their split: groups of chunks that path_attn's flash pass crosses with one product.

The flash pass walks a query block's chain back chunk by chunk, Q <- Q P_j = Q - Q E_j: a [C, K] x [K, K] product
per (query block, earlier chunk) pair, a dependent step between every two key blocks. Grouping the chunks into
splits of S, and moving every key to the end of its split,

    K~_j = K^_j P_{j+1}^T .. P_{e}^T    (chunk j's keys, at its end, through the later chunks e of its split)
    E~_J = I - P_e .. P_f               (the split's whole product, chunks f .. e)

lets the pass cross a whole earlier split J with one product: its S key blocks all meet the same query
(the query at J's end) and are read as in plain flash attention. Chunks of the query's own split are still crossed
one by one (at most S - 1 steps, against the chunk keys K^_j and E_j).

Computed by the kernels of ``split_keys_kernels.py``, a program per split chaining its chunks' products from the
last down (O(T K^2) work), inside path_attn's flash ops: the forward op moves the keys, the backward op moves them
again (nothing of them is kept between the two) and adds the transform's gradient to those of K^ and E.
"""

from __future__ import annotations

import math

import torch

from ..common.triton_utils import block, dot_precision, upcast_dots
from .split_keys_kernels import split_keys_bwd_kernel, split_keys_fwd_kernel


def split_size(split: int | str, chunks: int, split_from: int = 1) -> int:
    """The chunks per split for a pass over ``chunks`` chunks: ``split`` (a power of two, or "sqrt": the largest
    power of two at most sqrt(2 chunks), which balances the S / 2 chunk steps an average query takes in its own
    split against its chunks / S split crossings) from ``split_from`` chunks on, else 1; at most the power of two
    that covers them all (a longer split would only add identity chunks)."""
    if split != "sqrt" and (isinstance(split, bool) or not isinstance(split, int) or split < 1 or split & (split - 1)):
        raise ValueError(f"path_attn launch setting split must be a power of two >= 1 (chunks per split) or "
                         f"\"sqrt\", got {split!r}")
    if chunks < split_from:
        return 1
    if split == "sqrt":
        split = 1 << (math.isqrt(max(2 * chunks, 1)).bit_length() - 1)
    cover = 1 << max(chunks - 1, 0).bit_length()
    return min(split, cover)


def _shapes(kh: torch.Tensor, E: torch.Tensor, split: int) -> dict:
    NC, K = kh.shape[2:]
    N = E.shape[2]
    return dict(N=N, K=K, C=NC // N, SPLIT=split, BK=block(K), PREC=dot_precision(kh.dtype), UP=upcast_dots(kh.dtype))


def keys_to_split_end(kh: torch.Tensor, E: torch.Tensor, split: int, options: dict, keep: bool = False
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(K~ [B, H, N C, K] like kh, E~ [B, H, ceil(N / split), K, K] like E, the chain's R_j or None) from the chunk
    keys kh [B, H, N C, K] and the chunks' E [B, H, N, K, K] (contiguous; module docstring); ``split`` a power of two
    > 1; ``options`` the launch's num_warps and num_stages; with ``keep`` the R_j that :func:`split_keys_backward`
    reads, [B H, NS, split, BK, BK] like kh."""
    B, H, NC, K = kh.shape
    NS = -(-E.shape[2] // split)
    ks, Es = torch.empty_like(kh), E.new_empty(B, H, NS, K, K)
    Rs = kh.new_empty(B * H, NS, split, block(K), block(K)) if keep else None
    # without keep, Rs is any pointer: the kernel's stores to it are compiled out
    split_keys_fwd_kernel[(NS, B * H)](kh=kh, E=E, ks=ks, Es=Es, Rs=Rs if keep else ks, KEEP=keep,
                                       **_shapes(kh, E, split), **options)
    return ks, Es, Rs


def split_keys_backward(kh: torch.Tensor, E: torch.Tensor, dks: torch.Tensor, dEs: torch.Tensor, Rs: torch.Tensor,
                        dkh: torch.Tensor, dE: torch.Tensor, split: int, options: dict) -> None:
    """Adds to dkh and dE (float32, like kh and E) the gradient that dks and dEs (float32, like the outputs of
    :func:`keys_to_split_end`) carry back through the transform; Rs: that call's kept R_j."""
    B, H = kh.shape[:2]
    split_keys_bwd_kernel[(dEs.shape[2], B * H)](kh=kh, E=E, dks=dks, dEs=dEs, Rs=Rs, dkh=dkh, dE=dE,
                                                 **_shapes(kh, E, split), **options)
