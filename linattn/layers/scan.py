"""A first-order linear recurrence h_t = a_t ⊙ h_{t-1} + b_t over time, in plain PyTorch."""

from __future__ import annotations

import torch


def linear_scan(a: torch.Tensor, b: torch.Tensor, h0: torch.Tensor | None = None) -> torch.Tensor:
    """All h_t of h_t = a_t ⊙ h_{t-1} + b_t (h_{-1} = ``h0`` or 0) for a, b [B, T, ...] (real or complex).

    Hillis-Steele doubling scan with the associative pair product (a1, b1)·(a2, b2) = (a1 a2, a2 b1 + b2):
    log2(T) steps of elementwise products; only products of the a's are formed (no division), so
    |a| <= 1 never overflows.
    """
    if h0 is not None:
        b = torch.cat([b[:, :1] + a[:, :1] * h0[:, None], b[:, 1:]], dim=1)
    T, d = a.shape[1], 1
    while d < T:
        b = torch.cat([b[:, :d], b[:, d:] + a[:, d:] * b[:, :-d]], dim=1)
        a = torch.cat([a[:, :d], a[:, d:] * a[:, :-d]], dim=1)
        d *= 2
    return b


def diagonal_scan(log_a: torch.Tensor, b: torch.Tensor, h0: torch.Tensor | None = None, chunk_size: int = 64
                  ) -> torch.Tensor:
    """All h_t of h_t = a ⊙ h_{t-1} + b_t for a time-invariant a = exp(``log_a``) [N] and b [B, T, N] (complex
    or real; h_{-1} = ``h0`` [B, N] or 0), chunkwise: in a chunk of C tokens h = L b with the Toeplitz matrix
    L[t, s] = a^(t-s) (t >= s) per channel, one batched matmul; only the T / C chunk-end states go through
    the scan. Work B T C N instead of the doubling scan's B T N log2(T) full-tensor copies, most of it in one
    matmul. Powers are exp(k log_a) with k >= 0 only, so |a| <= 1 never overflows."""
    Bsz, T, N = b.shape
    C = max(1, min(chunk_size, T))
    n = -(-T // C)
    if n * C != T:
        b = torch.cat([b, b.new_zeros(Bsz, n * C - T, N)], dim=1)
    k = torch.arange(C, device=b.device)
    diff = k[:, None] - k[None, :]  # t - s
    # clamp before exp: the masked (t < s) entries would be a^(negative), which overflows for |a| < 1
    L = torch.where((diff >= 0)[..., None], torch.exp(diff.clamp_min(0)[..., None].to(log_a.dtype) * log_a),
                    torch.zeros((), dtype=log_a.dtype, device=b.device))  # [C, C, N]
    h = torch.einsum("tsn,bjsn->bjtn", L.to(b.dtype), b.view(Bsz, n, C, N))  # zero entering state
    if n > 1 or h0 is not None:
        ends = linear_scan(torch.exp(C * log_a).to(b.dtype).expand(Bsz, n, N), h[:, :, -1], h0)  # state after chunk j
        first = torch.zeros_like(ends[:, :1]) if h0 is None else h0[:, None].to(b.dtype)
        enter = torch.cat([first, ends[:, :-1]], dim=1)
        h = h + torch.exp((k + 1)[:, None].to(log_a.dtype) * log_a).to(b.dtype) * enter[:, :, None]
    return h.reshape(Bsz, n * C, N)[:, :T]
