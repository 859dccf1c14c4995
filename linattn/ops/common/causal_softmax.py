"""Causal masks and an explicit masked softmax for the softmax family (DeltaFormer, PaTH, ...).

Queries are the *last* Tq positions of a sequence of Tk keys (a cache of Tk - Tq past positions
followed by the new ones), so query i sits at absolute position Tk - Tq + i ("bottom-right"
alignment, unlike SDPA's ``is_causal`` for Tq != Tk, which aligns top-left).
"""

from __future__ import annotations

import torch


def causal_mask(Tq: int, Tk: int, *, strict: bool = False, device: torch.device | str = "cpu") -> torch.Tensor:
    """Bool [Tq, Tk]: query i may see key j iff j <= Tk - Tq + i (j < ... when ``strict``)."""
    i = torch.arange(Tq, device=device)[:, None] + (Tk - Tq)
    j = torch.arange(Tk, device=device)[None, :]
    return j < i if strict else j <= i


class ChunkMasks:
    """Causal masks of every query block as *views* of one bool [C, width + C] tensor.

    ``masks(end, rows)`` is the bool [rows, end] mask of ``rows`` <= C queries that are the last
    ``rows`` of keys [0, end): row i sees keys j <= end - rows + i (j < ... when ``strict``). Autograd
    saves views, so memory stays C x width however many blocks there are. With ``dtype`` the masks are
    additive (0 where seen, -inf elsewhere) in that dtype: SDPA saves a float mask for its backward,
    converting a bool one into a new float tensor per call, whereas a float view is saved as is.
    """

    def __init__(self, C: int, width: int, *, strict: bool = False, device: torch.device | str = "cpu",
                 dtype: torch.dtype | None = None):
        self.C, self.W = C, width + C
        self.base = causal_mask(C, self.W, strict=strict, device=device)
        if dtype is not None:
            self.base = torch.zeros(self.base.shape, dtype=dtype, device=device).masked_fill(~self.base, float("-inf"))

    def __call__(self, end: int, rows: int | None = None) -> torch.Tensor:
        rows = self.C if rows is None else rows
        if not (0 < rows <= self.C and rows <= end <= self.W - self.C):
            raise ValueError(f"need 0 < rows <= {self.C} and rows <= end <= {self.W - self.C}, got {rows}, {end}")
        return self.base[self.C - rows:, self.W - end:]


def masked_softmax(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim restricted to ``mask`` (True = kept); rows with no kept entry give 0.

    The row maximum is detached (softmax does not depend on it), so gradients are the exact ones.
    """
    scores = scores.masked_fill(~mask, float("-inf"))
    m = scores.amax(dim=-1, keepdim=True).detach()
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(scores - m)
    return e / e.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(e.dtype).tiny)
