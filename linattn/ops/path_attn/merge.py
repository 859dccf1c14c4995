"""The flash pass's inputs for blocks of two UT chunks: fewer, larger steps down path_attn's query chain.

The UT transform works on chunks of C positions (its [C, C] inverse and its sweeps over K's columns bound C), and
the flash pass walks a query block's chain back one block at a time: per (query block, earlier block) pair a
[C, K] x [K, K] product and, in the backward pass, atomic adds of [K, K], [C, K] and [C, V] gradients. Merging
chunks 2c and 2c+1 (a, b below) into one block of 2C rows leaves a quarter of the pairs, each with twice the rows
and keys: half the chain's products and half the [C, K] and [C, V] adds in all, a quarter of the [K, K] ones:

    P_blk = P_b P_a,  so  E_blk = I - P_b P_a = E_a + E_b - E_b E_a
    Q^_blk = [Q^_a ; Q^_b P_a]          (queries moved to the block's start: b's rows also through a)
    K^_blk = [P_b K^_a ; K^_b]          (keys moved to the block's end: a's rows also through b; as rows,
                                          K^_a - K^_a E_b^T)
    intra_blk = [[intra_a, -inf], [X, intra_b]],   X = scale (Q^_b K^_a^T + G_t - G_s)

X is the logit of b's queries (at b's start) against a's keys (at a's end, the same point): every key of a
precedes every query of b. The logits are those of the chunk-by-chunk pass, the products regrouped. An odd number
of chunks gets one more: no keys, no queries, identity product (E = 0), gates flat, each row seeing only itself.
PyTorch operations, differentiated by autograd. The products are computed in float32 from the inputs' dtype and
rounded once into it (the cross logits stay float32); autograd keeps their inputs, not float32 copies.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class _Product(torch.autograd.Function):
    """c + alpha a @ b in float32 math, returned in ``dtype``; keeps a and b as given (batched [n, i, j] @ [n, j, l],
    c like the result or None)."""

    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor | None, alpha: float, dtype: torch.dtype):
        ctx.save_for_backward(a, b)
        ctx.alpha, ctx.has_c = alpha, c is not None
        out = torch.bmm(a.float(), b.float()).mul_(alpha)
        if c is not None:
            out += c.float()
        return out.to(dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        a, b = ctx.saved_tensors
        g = grad.float() * ctx.alpha
        da = torch.bmm(g, b.float().transpose(-1, -2)).to(a.dtype)
        db = torch.bmm(a.float().transpose(-1, -2), g).to(b.dtype)
        return da, db, grad if ctx.has_c else None, None, None


def _product(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor | None = None, alpha: float = 1.0,
             dtype: torch.dtype | None = None) -> torch.Tensor:
    """c + alpha a @ b over the leading dims of a [..., i, j] and b [..., j, l] (:class:`_Product`), in ``dtype``
    (default a's)."""
    lead = a.shape[:-2]
    flat = lambda x: x.reshape(-1, *x.shape[-2:])
    out = _Product.apply(flat(a), flat(b), None if c is None else flat(c), alpha, dtype or a.dtype)
    return out.view(*lead, *out.shape[-2:])


def merge_chunk_pairs(qh: torch.Tensor, intra: torch.Tensor, E: torch.Tensor, kh: torch.Tensor, v: torch.Tensor,
                      G: torch.Tensor, scale: float) -> tuple[torch.Tensor, ...]:
    """(qh, intra, E, kh, v, G) for blocks of 2C from those of chunks of C (module docstring): qh, kh [B, H, N C, K],
    intra [B, H, N, C, C] float32 (natural-log logits, -inf above the diagonal), E [B, H, N, K, K], v [B, H, N C, V],
    G [B, H, T0 + N C] float64 (the cache's positions first). Rows stay in position order; N odd: one empty chunk
    is appended first."""
    B, H, NC, K = qh.shape
    N, C = intra.shape[2], intra.shape[3]
    if N % 2:
        qh, kh, v = (F.pad(x, (0, 0, 0, C)) for x in (qh, kh, v))
        E = F.pad(E, (0, 0, 0, 0, 0, 1))
        alone = torch.zeros(C, C, device=intra.device, dtype=intra.dtype)
        alone = alone.masked_fill(torch.ones_like(alone, dtype=torch.bool).triu(1), float("-inf"))
        intra = torch.cat([intra, alone.expand(B, H, 1, C, C)], dim=2)
        G = torch.cat([G, G[..., -1:].expand(B, H, C)], dim=-1)
        N, NC = N + 1, NC + C
    M = N // 2
    qa, qb = qh.unflatten(2, (M, 2, C)).unbind(3)  # [B, H, M, C, K] each
    ka, kb = kh.unflatten(2, (M, 2, C)).unbind(3)
    Ea, Eb = E.unflatten(2, (M, 2)).unbind(3)  # [B, H, M, K, K] each
    qh_blk = torch.stack([qa, _product(qb, Ea, qb, -1.0)], dim=3).flatten(2, 4)
    kh_blk = torch.stack([_product(ka, Eb.transpose(-1, -2), ka, -1.0), kb], dim=3).flatten(2, 4)
    E_blk = (_product(Eb, Ea, None, -1.0, torch.float32) + Ea.float() + Eb.float()).to(E.dtype)
    Gn = G[..., G.shape[-1] - NC:].unflatten(-1, (M, 2, C))  # [B, H, M, 2, C]
    gates = scale * (Gn[..., 1, :, None] - Gn[..., 0, None, :]).float()  # G_t (t in b) - G_s (s in a)
    cross = _product(qb, ka.transpose(-1, -2), gates, scale, torch.float32)
    ia, ib = intra.unflatten(2, (M, 2)).unbind(3)
    intra_blk = torch.cat([torch.cat([ia, torch.full_like(ia, float("-inf"))], dim=-1),
                           torch.cat([cross, ib], dim=-1)], dim=-2)
    return qh_blk, intra_blk, E_blk, kh_blk, v, G
