"""Single-token steps of the softmax family on static KV buffers (see static_cache.py).

A token's key and value are written at its row's position with a scatter, and the query attends over the
whole ``max_length`` buffer with a mask made from the positions: key j is visible to the token at
position p when j <= p (and j > p - window). Positions past p hold zeros (the buffers are zeroed before a
prefill) or values a later token overwrites, and are masked. The cost of a step is therefore that of
``max_length`` keys, whatever the position; in exchange its shapes never change and one CUDA graph serves
every step. Math in the buffers' dtype (float32), as the cached path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from linattn.ops.common.kv_cache import KVCache
from linattn.ops.common.positions import apply_rope

from .static_cache import StaticKV


def allocate_kv(batch_size: int, heads: int, max_length: int, K: int, V: int, *, dtype: torch.dtype,
                device: torch.device, extras: dict[str, int] | None = None) -> StaticKV:
    """Zeroed keys [B, heads, L, K], values [B, heads, L, V] and extras [B, H_extra, L] by name."""
    B, L = batch_size, max_length
    z = dict(dtype=dtype, device=device)
    return StaticKV(torch.zeros(B, heads, L, K, **z), torch.zeros(B, heads, L, V, **z),
                    {name: torch.zeros(B, h, L, **z) for name, h in (extras or {}).items()})


def load_kv_rows(buffers: StaticKV, cache: KVCache, rows: torch.Tensor) -> None:
    """Copy a cached path's KVCache (k, v [n, T0, H, *], extras [n, T0, H]) into rows ``rows`` of the buffers."""
    T0 = cache.k.shape[1]
    if T0 > buffers.max_length:
        raise ValueError(f"a cache of {T0} positions does not fit static KV buffers of max_length "
                         f"{buffers.max_length}")
    buffers.k[:, :, :T0].index_copy_(0, rows, cache.k.transpose(1, 2).to(buffers.k.dtype))
    buffers.v[:, :, :T0].index_copy_(0, rows, cache.v.transpose(1, 2).to(buffers.v.dtype))
    for name, buf in buffers.extras.items():
        buf[:, :, :T0].index_copy_(0, rows, cache.extras[name].transpose(1, 2).to(buf.dtype))


def write_at(buf: torch.Tensor, pos: torch.Tensor, x: torch.Tensor) -> None:
    """buf[b, :, pos[b]] = x[b] for a buffer [B, H, L, *] (or [B, H, L]) and x [B, H, *] (or [B, H])."""
    idx = pos.view(-1, *([1] * x.dim())).expand(*x.shape[:2], 1, *x.shape[2:])
    buf.scatter_(2, idx, x.unsqueeze(2).to(buf.dtype))


def key_mask(pos: torch.Tensor, max_length: int, *, window_size: int | None = None,
             strict: bool = False) -> torch.Tensor:
    """Bool [B, L]: key j visible to the token at pos[b]: j <= pos (j < pos when ``strict``), and
    j > pos - window_size with a window."""
    j = torch.arange(max_length, device=pos.device)[None]
    p = pos[:, None]
    visible = j < p if strict else j <= p
    if window_size is not None:
        visible = visible & (j > p - window_size)
    return visible


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, scale: float,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """softmax_j(scale q.k_j + bias_j) over the visible keys, times v: q [B, H, K], k [B, H_kv, L, K],
    v [B, H_kv, L, V] (H_kv dividing H: query head h reads head h // (H / H_kv)), visible [B, L], bias
    [B, H, L] or None. Returns [B, H, V].

    The H / H_kv query heads of a key head are passed to SDPA as that head's queries, so grouped heads need
    no copy of the buffers (SDPA's GQA option is not supported by every kernel)."""
    B, H, K = q.shape
    H_kv, L, V = k.shape[1], k.shape[2], v.shape[-1]
    qg = q.reshape(B, H_kv, H // H_kv, K)
    if bias is None:
        mask = visible[:, None, None, :]
    else:
        mask = bias.reshape(B, H_kv, H // H_kv, L).masked_fill(~visible[:, None, None, :], float("-inf"))
    o = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scale)
    return o.reshape(B, H, V)


def rope_at(x: torch.Tensor, pos: torch.Tensor, **rope: float) -> torch.Tensor:
    """RoPE of one token per row: x [B, H, D] at positions pos [B] (:func:`positions.apply_rope`)."""
    return apply_rope(x[:, None], pos, **rope)[:, 0]
