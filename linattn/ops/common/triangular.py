"""Unit-lower-triangular solves: the UT transform of the delta-rule family.

The delta rule's chunk and matrix forms need U = (I + A)^-1 R with A strictly lower triangular
(A_ts = b_t <k_t, k_s> D_ts for s < t). Written out, (I + A) U = R is the forward substitution

    u_t = r_t - sum_{s<t} A_ts u_s,

i.e. exactly the recurrence for the "pseudo-values" u_t, solved for all t at once. DeltaFormer's
U = (I + tril(...))^-1 V is the same solve.
"""

from __future__ import annotations

import torch


def solve_unit_lower(A: torch.Tensor, rhs: torch.Tensor) -> torch.Tensor:
    """Solve (I + A) X = rhs for X, batched over leading dims.

    ``A`` [..., C, C]: only its strictly lower triangle is read (the diagonal is taken to be 1 and
    the upper triangle to be 0); ``rhs`` [..., C, D]. Differentiable in both (the gradient of A is
    strictly lower triangular).
    """
    return torch.linalg.solve_triangular(A, rhs, upper=False, unitriangular=True)


def unit_lower_inverse(A: torch.Tensor) -> torch.Tensor:
    """(I + A)^-1 for ``A`` [..., C, C] (strictly lower triangle read, as in :func:`solve_unit_lower`).

    For many small systems sharing one matrix and a wide right-hand side (the chunk backends), forming
    the inverse once and applying it with a matmul is faster on GPUs than a triangular solve against
    the wide right-hand side.
    """
    C = A.shape[-1]
    eye = torch.eye(C, dtype=A.dtype, device=A.device).expand(A.shape)
    return torch.linalg.solve_triangular(A, eye, upper=False, unitriangular=True)
