"""Batched solves of the MesaNet read-out system (G_t + diag(lambda)) x_t = q_t.

The matrix is symmetric positive definite (G_t is a decayed sum of beta_s k_s k_s^T with beta >= 0,
lambda > 0), so the exact solver is a Cholesky factorisation; the approximate one is conjugate
gradient started from x = 0 with a fixed number of steps (in exact arithmetic CG with K steps is
exact). Both are differentiable by autograd (CG by unrolling its steps).
"""

from __future__ import annotations

import torch

SOLVERS = ("exact", "cg")


def _safe_div(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """num / den where den is a normal positive number, 0 elsewhere (a converged CG step); NaN-free
    in both directions of autograd."""
    ok = den > torch.finfo(den.dtype).tiny
    return torch.where(ok, num / torch.where(ok, den, torch.ones_like(den)), torch.zeros_like(num))


def conjugate_gradient(A: torch.Tensor, b: torch.Tensor, steps: int) -> torch.Tensor:
    """``steps`` iterations of CG on A x = b from x_0 = 0; A [..., K, K] SPD, b [..., K] -> x [..., K]."""
    x = torch.zeros_like(b)
    r = b
    p = r
    rr = (r * r).sum(-1)
    for _ in range(steps):
        Ap = (A @ p[..., None]).squeeze(-1)
        alpha = _safe_div(rr, (p * Ap).sum(-1))[..., None]
        x = x + alpha * p
        r = r - alpha * Ap
        rr_new = (r * r).sum(-1)
        p = r + _safe_div(rr_new, rr)[..., None] * p
        rr = rr_new
    return x


def spd_solve(A: torch.Tensor, b: torch.Tensor, solver: str, cg_steps: int | None) -> torch.Tensor:
    """Solve A x = b batched over the leading dims: A [..., K, K] SPD, b [..., K].

    ``solver="exact"``: Cholesky factorisation and two triangular solves. ``solver="cg"``: ``cg_steps``
    conjugate-gradient steps from zero (None means K steps).
    """
    if solver == "exact":
        L = torch.linalg.cholesky(A)
        return torch.cholesky_solve(b[..., None], L).squeeze(-1)
    return conjugate_gradient(A, b, A.shape[-1] if cg_steps is None else cg_steps)
