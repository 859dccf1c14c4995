"""The inner (fast-weight) linear model of TTT-Linear and Titans, and its loss gradient.

Per head, with weights W [K, V]:

    plain:       f(x; W) = W^T x,                       loss l = 0.5 ||f(k; W) - v||^2
                 grad_W l = k (W^T k - v)^T
    inner_norm:  f(x; W) = x + LN(W^T x)   (K == V),    loss l = 0.5 ||f(k; W) - v||^2
                 LN(z) = w ⊙ (z - mean z) / sqrt(var z + eps) + b over the V channels,
                 grad_W l = k (dLN^T e)^T with e = k + LN(W^T k) - v (the LayerNorm backward written out)

The gradients are written as formulas (not taken by autograd), so the outer model's autograd
differentiates through them like any other op. Everything broadcasts over leading dims: W
[B, H, K, V] with x [B, H, K], or W [B, H, N, K, V] with x [B, H, N, C, K].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class InnerNorm:
    """LayerNorm parameters of the inner model: ``weight``, ``bias`` broadcastable to z [..., V]."""

    weight: torch.Tensor
    bias: torch.Tensor
    eps: float

    def forward(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(LN(z), the normalised z_hat, 1 / std) over the last dim."""
        mu = z.mean(-1, keepdim=True)
        rstd = torch.rsqrt(((z - mu) ** 2).mean(-1, keepdim=True) + self.eps)
        z_hat = (z - mu) * rstd
        return self.weight * z_hat + self.bias, z_hat, rstd

    def backward(self, grad_y: torch.Tensor, z_hat: torch.Tensor, rstd: torch.Tensor) -> torch.Tensor:
        """dl/dz from dl/dy for y = LN(z): rstd (g - mean g - z_hat mean(g z_hat)), g = weight grad_y."""
        gh = self.weight * grad_y
        return rstd * (gh - gh.mean(-1, keepdim=True) - z_hat * (gh * z_hat).mean(-1, keepdim=True))


def read(W: torch.Tensor, x: torch.Tensor, norm: InnerNorm | None) -> torch.Tensor:
    """f(x; W) for x [..., C, K] and W [..., K, V] -> [..., C, V]."""
    z = x @ W
    return z if norm is None else x + norm.forward(z)[0]


def error(W: torch.Tensor, k: torch.Tensor, v: torch.Tensor, norm: InnerNorm | None) -> torch.Tensor:
    """dl/dz at z = W^T k for the tokens k [..., C, K], v [..., C, V]; grad_W l = k error^T."""
    z = k @ W
    if norm is None:
        return z - v
    y, z_hat, rstd = norm.forward(z)
    return norm.backward(k + y - v, z_hat, rstd)
