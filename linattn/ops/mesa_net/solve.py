"""Batched solves of the MesaNet read-out system (G_t + diag(lambda)) x_t = q_t.

The matrix is symmetric positive definite (G_t is a decayed sum of beta_s k_s k_s^T with beta >= 0,
lambda > 0), so the exact solver is a Cholesky factorisation; the approximate one is conjugate
gradient started from x = 0 with a fixed number of steps (in exact arithmetic CG with K steps is
exact; systems that converge earlier stop moving). Both are differentiable by autograd (CG by
unrolling its steps).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..common.values import value_checks_enabled

SOLVERS = ("exact", "cg")


class NotPositiveDefiniteError(torch.linalg.LinAlgError, ValueError):
    """mesa_net's read-out system G_t + diag(lamb) is not positive definite (NaN or inf inputs, a gate that
    grows G_t, or keys so large that G_t + diag(lamb) is singular to the compute dtype's precision). A ValueError,
    since bad inputs cause it; still a LinAlgError for callers that catch torch's."""


def _not_positive_definite(what: str, dtype: torch.dtype) -> NotPositiveDefiniteError:
    precision = str(dtype).removeprefix("torch.")
    return NotPositiveDefiniteError(f"mesa_net: G_t + diag(lamb) is not positive definite (NaN or inf in q, k, v, "
                                    f"beta, g or the initial state? or keys so large that G_t dwarfs lamb beyond "
                                    f"{precision} precision: scale k down or raise lamb); {what}")


def _ratio(num: torch.Tensor, den: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
    """num / den where ``active`` (and den is a normal positive number), 0 elsewhere; NaN-free in both
    directions of autograd."""
    ok = active & (den > torch.finfo(den.dtype).tiny)
    return torch.where(ok, num / torch.where(ok, den, torch.ones_like(den)), torch.zeros_like(num))


def conjugate_gradient(A: torch.Tensor, b: torch.Tensor, steps: int) -> torch.Tensor:
    """``steps`` iterations of CG on A x = b from x_0 = 0; A [..., K, K] SPD, b [..., K] -> x [..., K].
    See :func:`cg_solve` (this is it with the product A p)."""
    return cg_solve(lambda p: (A @ p[..., None]).squeeze(-1), b, steps)


def cg_solve(
    matvec: Callable[[torch.Tensor], torch.Tensor],
    b: torch.Tensor,
    steps: int,
) -> torch.Tensor:
    """``steps`` iterations of CG on A x = b from x_0 = 0, batched over the leading dims of b [..., K];
    ``matvec(p)`` returns A p for every system at once (A SPD).

    A system whose residual has reached rounding level (||r|| <= 32 eps ||b||) is frozen: its later
    steps are exactly zero. Without this, the steps taken on rounding noise are harmless forwards
    but their gradients (through r.r / p.Ap of two noise-sized numbers) amplify the noise. The step
    sizes are per-system tensors: no host synchronisation, no data-dependent exit.
    """
    floor = cg_floor(b)
    x = torch.zeros_like(b)
    r = b
    p = r
    rr = (r * r).sum(-1)
    for _ in range(steps):
        active = rr > floor
        Ap = matvec(p)
        alpha = _ratio(rr, (p * Ap).sum(-1), active)[..., None]
        x = x + alpha * p
        r = r - alpha * Ap
        rr_new = (r * r).sum(-1)
        p = r + _ratio(rr_new, rr, active & (rr_new > floor))[..., None] * p
        rr = rr_new
    return x


def cg_floor(b: torch.Tensor) -> torch.Tensor:
    """The squared residual below which :func:`cg_solve` freezes a system: (32 eps ||b||)^2, over b's last dim."""
    return (b * b).sum(-1) * (32 * torch.finfo(b.dtype).eps) ** 2


def shifted_cg_solve(product: Callable[[torch.Tensor], torch.Tensor], lamb: torch.Tensor, b: torch.Tensor,
                     steps: int) -> torch.Tensor:
    """:func:`cg_solve` on (G + diag(lamb)) x = b, ``product(p)`` giving G p."""
    return cg_solve(lambda p: product(p) + lamb * p, b, steps)


def spd_solve(A: torch.Tensor, b: torch.Tensor, solver: str, cg_steps: int | None) -> torch.Tensor:
    """Solve A x = b batched over the leading dims: A [..., K, K] SPD, b [..., K].

    ``solver="exact"``: Cholesky factorisation and two triangular solves. ``solver="cg"``: ``cg_steps``
    conjugate-gradient steps from zero (None means K steps). A failed factorisation (A not positive
    definite, e.g. NaN inputs; for CG, NaN or inf in A) raises :class:`NotPositiveDefiniteError` where
    value checks run (values.py): reading its status is a host synchronisation, which a CUDA decoding
    step (and its captured graph) must not have.
    """
    if solver == "exact":
        L, info = torch.linalg.cholesky_ex(A)
        # cuSOLVER factorises a NaN matrix without reporting it (info 0, NaN factor): read the factor too (detached,
        # so that the check saves nothing for backward: a checkpointed block's recompute must save what its forward did)
        if value_checks_enabled(info) and (bool((info != 0).any()) or not bool(torch.isfinite(L.detach()).all())):
            raise _not_positive_definite("its Cholesky factorisation failed", A.dtype)
        return torch.cholesky_solve(b[..., None], L).squeeze(-1)
    # CG has no factorisation to fail: it would carry NaN or inf in A silently into the output
    if value_checks_enabled(A) and not bool(torch.isfinite(A).all()):
        raise _not_positive_definite("it has NaN or inf entries, so conjugate gradient cannot solve it", A.dtype)
    return conjugate_gradient(A, b, A.shape[-1] if cg_steps is None else cg_steps)
