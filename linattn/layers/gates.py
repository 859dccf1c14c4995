"""Gate parameterisations shared by several layers (FLA's defaults)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .fused import use_fused_kernels


class MambaDecay(nn.Module):
    """Mamba2-style scalar decay per head: dt = softplus(W_a x + dt_bias), g = -exp(A_log) * dt.

    Returns (g [B, T, H] log decay <= 0, dt [B, T, H]). Initialisation as Mamba2: A = exp(A_log)
    uniform in [1, 16], dt = softplus(dt_bias) log-uniform in [dt_min, dt_max] = [1e-3, 0.1].
    """

    def __init__(self, d_model: int, n_heads: int, dt_min: float = 1e-3, dt_max: float = 0.1) -> None:
        super().__init__()
        self.a_proj = nn.Linear(d_model, n_heads, bias=False)
        self.A_log = nn.Parameter(torch.empty(n_heads).uniform_(1.0, 16.0).log())
        dt = torch.exp(torch.rand(n_heads) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))  # softplus^-1(dt)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.from_projection(self.a_proj(x))

    def from_projection(self, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(g, dt) from a = W_a x (computed by the caller, e.g. jointly with other projections)."""
        if use_fused_kernels(a):  # one kernel each way instead of a chain of small ones (gates_triton.py)
            from .gates_triton import mamba_gate_triton

            return mamba_gate_triton(a, self.A_log, self.dt_bias)
        dt = F.softplus(a.float() + self.dt_bias.float())
        return -torch.exp(self.A_log.float()) * dt, dt

    def with_beta(self, a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(g, sigmoid(b)) in ``dtype`` from a = W_a x and b = W_b x: the decay and a delta rule's strength, one
        fused kernel each way on CUDA (gates_triton.py)."""
        if use_fused_kernels(a):
            from .gates_triton import mamba_gate_beta_triton

            return mamba_gate_beta_triton(a, self.A_log, self.dt_bias, b, dtype)
        g, _ = self.from_projection(a)
        return g.to(dtype), torch.sigmoid(b).to(dtype)

    def with_keys(self, a: torch.Tensor, k: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(g in ``dtype``, dt k in k's dtype) from a = W_a x [..., H] and keys k [..., H, K]: Mamba2's decay and its
        keys scaled by the step size, one fused kernel each way on CUDA (gates_triton.py)."""
        if use_fused_kernels(a):
            from .gates_triton import mamba_gate_keys_triton

            return mamba_gate_keys_triton(a, self.A_log, self.dt_bias, k, dtype)
        g, dt = self.from_projection(a)
        return g.to(dtype), k * dt[..., None].to(k.dtype)


class LowRankLogSigmoidGate(nn.Module):
    """GLA's gate: g = logsigmoid(W_2 W_1 x + b) / normaliser, [B, T, H, K] (rank 16, normaliser 16)."""

    def __init__(self, d_model: int, n_heads: int, head_dim: int, rank: int = 16, normaliser: float = 16.0) -> None:
        super().__init__()
        self.n_heads, self.head_dim, self.normaliser = n_heads, head_dim, normaliser
        self.down = nn.Linear(d_model, rank, bias=False)
        self.up = nn.Linear(rank, n_heads * head_dim, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        a = self.up(self.down(x))
        if torch.compiler.is_compiling():
            # the plain composition (the compiler chooses what to keep): Dynamo of torch 2.11 traced the Function
            # without its gradient, so the gate's weights got none
            g = scaled_logsigmoid(a, self.normaliser)
        else:
            g = ScaledLogSigmoid.apply(a, self.normaliser)
        return g.view(B, T, self.n_heads, self.head_dim)


def scaled_logsigmoid(a: torch.Tensor, n: float) -> torch.Tensor:
    """logsigmoid(a) / n, computed in float32 and returned in a's dtype."""
    return (F.logsigmoid(a.float()) / n).to(a.dtype)


class ScaledLogSigmoid(torch.autograd.Function):
    """g = logsigmoid(a) / n, computed in float32 and returned in a's dtype; d a = sigmoid(-a) / n d g.

    Autograd through ``F.logsigmoid(a.float()) / n`` would keep a float32 copy of a and logsigmoid's float32
    buffer (four times a's bf16 bytes); this keeps a alone."""

    @staticmethod
    def forward(ctx, a: torch.Tensor, n: float) -> torch.Tensor:
        ctx.save_for_backward(a)
        ctx.n = n
        return scaled_logsigmoid(a, n)

    @staticmethod
    def backward(ctx, dg: torch.Tensor) -> tuple[torch.Tensor, None]:
        (a,) = ctx.saved_tensors
        return (dg.float() * torch.sigmoid(-a.float()) / ctx.n).to(a.dtype), None
