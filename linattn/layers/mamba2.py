"""Mamba2-style layer on the simple_gla op (scalar data-dependent decay, SSD)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from linattn.ops.simple_gla import simple_gla, simple_gla_step

from .base import MixerLayer, MixOut, Streams
from .gates import MambaDecay


class GatedGroupRMSNorm(nn.Module):
    """Mamba2's own output norm: y = RMSNorm_groups(o ⊙ SiLU(z)) ⊙ w, the gate applied before the norm, the
    statistics taken over each of ``groups`` equal slices of the ``width`` channels (all heads together for one
    group), and one weight per channel (``width`` of them, not one per head channel)."""

    def __init__(self, width: int, groups: int, eps: float) -> None:
        super().__init__()
        if not isinstance(groups, int) or isinstance(groups, bool) or groups < 1 or width % groups:
            raise ValueError(f"norm_groups must be a positive int dividing n_heads * head_dim_v = {width}, "
                             f"got {groups!r}")
        self.groups, self.eps = groups, eps
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, o: Tensor, z: Tensor) -> Tensor:
        """o, z [B, T, width] -> [B, T, width] in o's dtype, computed in float32."""
        x = o.float() * F.silu(z.float())
        xg = x.unflatten(-1, (self.groups, -1))
        xg = xg * torch.rsqrt(xg.square().mean(-1, keepdim=True) + self.eps)
        return (xg.flatten(-2) * self.weight.float()).to(o.dtype)


class Mamba2Layer(MixerLayer):
    """Mamba2 (SSD) token mixer, arXiv 2405.21060, on :func:`linattn.ops.simple_gla.simple_gla`.

    Per head h: dt_t = softplus(W_a x_t + dt_bias_h), A_h = -exp(A_log_h),
        S_t = exp(dt_t A_h) S_{t-1} + (dt_t B_t) x_t^T,   y_t = S_t^T C_t + D_h x_t
    with C = q, B = k, x = v (one B, C per head, i.e. ngroups = n_heads), no query scaling, the
    ShortConv on x, B and C by default (short_conv="qkv"), and the output RMSNorm(y) * SiLU(W_z x)
    per head. ``norm_groups=G`` switches to the original Mamba2 output norm instead (the gate before an
    RMSNorm over G groups of channels with one weight per channel, :class:`GatedGroupRMSNorm`), as in
    checkpoints of Mamba2 and FLA's Mamba2 (G = their n_groups).
    """

    op = staticmethod(simple_gla)
    op_step = staticmethod(simple_gla_step)
    step_inplace = True
    default_short_conv = "qkv"
    default_output_gate = True
    scale = 1.0

    def __init__(self, d_model: int, n_heads: int, *, norm_groups: int | None = None, **kwargs) -> None:
        super().__init__(d_model, n_heads, **kwargs)
        self.decay = MambaDecay(d_model, n_heads)
        self.D = nn.Parameter(torch.ones(n_heads))
        self.norm_groups = norm_groups
        if norm_groups is not None:
            if self.o_norm is None or self.g_proj is None:
                raise ValueError("norm_groups needs output_norm=True and output_gate=True (it normalises the gated "
                                 f"output), got output_norm={self.output_norm}, output_gate={self.output_gate}")
            self.o_norm = GatedGroupRMSNorm(n_heads * self.head_dim_v, norm_groups, self.o_norm.eps)

    def x_projections(self) -> dict[str, nn.Linear]:
        return {**super().x_projections(), "a": self.decay.a_proj}

    def mix_inputs(self, x: Tensor, q: Tensor, k: Tensor, v: Tensor, offset: int, streams: Streams) -> MixOut:
        g, k = self.decay.with_keys(streams["a"], k, q.dtype)
        return q, k, v, {"g": g}, {}

    def skip(self, o: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return o + self.D[:, None].to(o.dtype) * v

    def _gated_output(self, o: Tensor, x: Tensor) -> Tensor:
        if self.norm_groups is None:
            return super()._gated_output(o, x)
        return self.o_proj(self.o_norm(o.flatten(2), self.g_proj(x)))
