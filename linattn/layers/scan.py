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
